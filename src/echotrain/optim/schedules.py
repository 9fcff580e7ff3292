"""Learning-rate schedules: the one place the trainer and the experiments take them from.

Plain functions of the step, so a caller either multiplies a peak LR (``torch.optim.lr_scheduler
.LambdaLR(opt, lambda u: warmup_decay(u, ...))``, the trainer) or sets ``group["lr"]`` itself
(``warmup_decay(step, ..., peak=lr)``, the looped-LR experiment).

- :func:`warmup_decay`: linear warm-up, then constant / linear decay to 0 / cosine decay to 0
  (Loshchilov & Hutter, "SGDR", ICLR 2017, eq. 5 without restarts) over the remaining steps.
- :func:`step_decay`: piecewise-constant multipliers at fractions of training (the WideResNet
  schedule of Zagoruyko & Komodakis 2016, as the late-phase SAM experiment uses it).

Late-phase SAM's switch step is not an LR schedule; it lives with :class:`echotrain.optim.LateSAM`.
"""

from __future__ import annotations

import math
from typing import Sequence

LR_DECAYS: tuple[str, ...] = ("constant", "linear", "cosine")
"""What :func:`warmup_decay` does after the warm-up (the trainer's ``lr_scheduler`` choices)."""


def warmup_decay(step: int, warmup_steps: int, total_steps: int, decay: str = "constant", peak: float = 1.0) -> float:
    """The LR at optimizer step ``step`` (0-based): linear warm-up, then ``decay``.

    During warm-up (``step < warmup_steps``): ``peak * (step + 1) / warmup_steps``. After it, with
    ``frac = min(1, (step - warmup_steps) / max(1, total_steps - warmup_steps))``:
    ``"constant"``: ``peak``; ``"linear"``: ``peak * (1 - frac)``; ``"cosine"``:
    ``peak * 0.5 * (1 + cos(pi * frac))``. ``peak=1`` gives a multiplier for ``LambdaLR``.

    Args:
        step: optimizer steps taken so far.
        warmup_steps: warm-up length in steps (0: none).
        total_steps: steps in the whole run (the decay reaches 0 there and stays).
        decay: one of :data:`LR_DECAYS`.
        peak: the LR after warm-up (1.0: a multiplier).

    Raises:
        ValueError: ``decay`` is not in :data:`LR_DECAYS`.
    """
    if decay not in LR_DECAYS:
        raise ValueError(f"decay={decay!r} is unknown; valid: {list(LR_DECAYS)}")
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    rest = max(1, total_steps - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / rest)
    if decay == "linear":
        return peak * (1.0 - frac)
    if decay == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * frac))
    return peak


def step_decay(step: int, total_steps: int, milestones: Sequence[float] = (0.3, 0.6),
               factors: Sequence[float] = (1.0, 0.2, 0.04)) -> float:
    """Piecewise-constant LR multiplier: ``factors[i]`` while ``step < milestones[i] * total_steps``.

    The defaults are the WideResNet step schedule as the late-phase SAM experiment runs it (x0.2
    at 30% of training, x0.04 from 60%; Zagoruyko & Komodakis, BMVC 2016, Sec. 3, there also at
    80%). ``step``/``total_steps`` may count epochs or optimizer steps.

    Raises:
        ValueError: ``len(factors) != len(milestones) + 1``.
    """
    if len(factors) != len(milestones) + 1:
        raise ValueError(f"factors={list(factors)} must have one more entry than milestones={list(milestones)}")
    for milestone, factor in zip(milestones, factors):
        if step < milestone * total_steps:
            return factor
    return factors[-1]


def __getattr__(name: str):
    """Old import path: ``LateSAM``, ``resolve_sam_start`` and ``SAM_START_UNITS`` lived here
    before they moved to :mod:`echotrain.optim.late_sam`; resolved lazily (no import cycle)."""
    if name in ("LateSAM", "resolve_sam_start", "SAM_START_UNITS"):
        from echotrain.optim import late_sam

        return getattr(late_sam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
