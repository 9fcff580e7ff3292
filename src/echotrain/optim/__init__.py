"""echotrain.optim: optimizers (AdamW with 4-bit states, SAM and late-phase SAM) by name, LR
schedules, and the sharpness measures SAM is about."""

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit
from echotrain.optim.late_sam import LateSAM, resolve_sam_start
from echotrain.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    base_optimizer_names,
    build_from_settings,
    build_optimizer,
    optimizer_class,
    optimizer_spec,
    register_optimizer,
)
from echotrain.optim.sam import SAM, frozen_running_stats
from echotrain.optim.schedules import LR_DECAYS, step_decay, warmup_decay

__all__ = [
    "AdamW4bit",
    "quant",
    "OPTIMIZERS",
    "OptimizerSpec",
    "SAM",
    "LateSAM",
    "LR_DECAYS",
    "base_optimizer_names",
    "build_from_settings",
    "build_optimizer",
    "frozen_running_stats",
    "optimizer_class",
    "optimizer_spec",
    "register_optimizer",
    "resolve_sam_start",
    "step_decay",
    "warmup_decay",
]
