"""echotrain.optim: optimizers (AdamW with 4-bit states, SAM and late-phase SAM) by name."""

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit
from echotrain.optim.registry import OPTIMIZERS, build_optimizer, optimizer_class
from echotrain.optim.sam import SAM, frozen_running_stats
from echotrain.optim.schedules import LateSAM, resolve_sam_start

__all__ = [
    "AdamW4bit",
    "quant",
    "OPTIMIZERS",
    "SAM",
    "LateSAM",
    "build_optimizer",
    "frozen_running_stats",
    "optimizer_class",
    "resolve_sam_start",
]
