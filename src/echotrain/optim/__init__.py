"""echotrain.optim: optimizers (AdamW with 4-bit states, SAM, late-phase SAM) by name."""

from echotrain.optim.registry import OPTIMIZERS, build_optimizer, optimizer_class

__all__ = ["OPTIMIZERS", "build_optimizer", "optimizer_class"]
