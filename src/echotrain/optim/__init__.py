"""echotrain.optim: optimizers (AdamW with 4-bit states, SAM and late-phase SAM) by name."""

from echotrain.optim.registry import OPTIMIZERS, build_optimizer, optimizer_class
from echotrain.optim.sam import SAM, frozen_running_stats
from echotrain.optim.schedules import LateSAM, resolve_sam_start

__all__ = [
    "OPTIMIZERS",
    "SAM",
    "LateSAM",
    "build_optimizer",
    "frozen_running_stats",
    "optimizer_class",
    "resolve_sam_start",
]
