"""Optimizers by name, so the trainer and the CLI can say ``optimizer=adamw4bit``.

A new optimizer is one line in :data:`OPTIMIZERS`: name -> ``"module:ClassName"``, imported
lazily so that optional dependencies are only needed when used.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

import torch

OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim:AdamW",
    "sgd": "torch.optim:SGD",
    "adamw4bit": "echotrain.optim.adamw4bit:AdamW4bit",
    "sam": "echotrain.optim.sam:SAM",
    "late_sam": "echotrain.optim.schedules:LateSAM",
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """Return the optimizer class registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names).
    """
    try:
        target = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer={name!r} is unknown; valid: {sorted(OPTIMIZERS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Instantiate the optimizer registered under ``name`` on ``params`` with ``kwargs``.

    Raises:
        ValueError: unknown ``name``.
    """
    return optimizer_class(name)(params, **kwargs)
