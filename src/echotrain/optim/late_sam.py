"""Late-phase SAM: the base optimizer until ``sam_start``, SAM from there to the end.

Zhou, Wang, Mao et al., "Sharpness-Aware Minimization Efficiently Selects Flatter Minima Late in
Training", ICLR 2025 (arXiv 2410.10373), Sec. 4: switching from SGD to SAM for the last few
epochs (WideResNet-16-8 / CIFAR-10: SGD to epoch 175, SAM to 200) reaches nearly the test error
and sharpness of SAM used throughout, at a fraction of SAM's doubled cost.

One object serves plain PyTorch loops and the trainer: it *is* a ``torch.optim.Optimizer`` (LR
schedulers and checkpoints work as usual) whose ``step(closure)`` calls the closure once and
steps the base optimizer before the switch, and does a full SAM step (two closure calls) after::

    opt = LateSAM(model.parameters(), "sgd", sam_start=0.875, sam_start_unit="fraction",
                  total_steps=epochs * len(loader), lr=0.1, momentum=0.9, rho=0.05, model=model)
    for x, y in loader:
        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)

Before the switch ``step()`` without a closure also works (after the caller's own backward), so
a loop may build the closure only when ``opt.sam_active()`` is true.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import torch

from echotrain.optim.registry import SAM_SETTINGS, register_optimizer
from echotrain.optim.sam import SAM, Closure

SAM_START_UNITS: tuple[str, ...] = ("step", "epoch", "fraction")


def resolve_sam_start(
    sam_start: float,
    unit: str = "step",
    total_steps: int | None = None,
    steps_per_epoch: int | None = None,
) -> int:
    """The index (0-based) of the first optimizer step that uses SAM.

    Args:
        sam_start: where SAM starts, in ``unit``: a step index, an epoch index (SAM from the
            first step of that epoch), or a fraction of training in [0, 1] (0: SAM throughout,
            1: never; the step is ``round(sam_start * total_steps)``).
        unit: ``"step"``, ``"epoch"`` or ``"fraction"``.
        total_steps: the number of optimizer steps in the run; needed for ``"fraction"``.
        steps_per_epoch: optimizer steps per epoch; needed for ``"epoch"``.

    Returns:
        t0 such that step t uses SAM iff t >= t0.

    Raises:
        ValueError: unknown ``unit``; NaN/Inf ``sam_start``; negative/non-integral step or
            epoch; fraction outside [0, 1]; the ``total_steps`` / ``steps_per_epoch`` the unit
            needs missing, non-integral or < 1.
    """
    if unit not in SAM_START_UNITS:
        raise ValueError(f"sam_start_unit={unit!r} is unknown; valid: {list(SAM_START_UNITS)}")
    if not (isinstance(sam_start, numbers.Real) and math.isfinite(sam_start)):
        raise ValueError(f"sam_start={sam_start!r} must be a finite number")
    if unit == "fraction":
        if total_steps is None or total_steps < 1 or total_steps != int(total_steps):
            raise ValueError(f"total_steps={total_steps!r} must be an integer >= 1 when sam_start_unit='fraction'")
        if not 0.0 <= sam_start <= 1.0:
            raise ValueError(f"sam_start={sam_start!r} must lie in [0, 1] when sam_start_unit='fraction'")
        return int(round(sam_start * total_steps))
    if sam_start < 0 or sam_start != int(sam_start):
        raise ValueError(f"sam_start={sam_start!r} must be a non-negative integer {unit} index")
    if unit == "epoch":
        if steps_per_epoch is None or steps_per_epoch < 1 or steps_per_epoch != int(steps_per_epoch):
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch!r} must be an integer >= 1 when sam_start_unit='epoch'"
            )
        return int(sam_start) * int(steps_per_epoch)
    return int(sam_start)


class LateSAM(SAM):
    """SAM switched on late in training (Zhou et al. 2025); the base optimizer before.

    Args:
        params: parameters or param groups; ``None`` when ``base_optimizer`` is an instance.
        base_optimizer: class, registry name (``"sgd"``) or instance, as for :class:`SAM`.
        sam_start: first SAM step, in ``sam_start_unit`` (see :func:`resolve_sam_start`).
        sam_start_unit: ``"step"`` (default), ``"epoch"`` or ``"fraction"``.
        total_steps: optimizer steps in the whole run (for ``"fraction"``).
        steps_per_epoch: optimizer steps per epoch (for ``"epoch"``).
        restart_momentum: at the switch, clear the base optimizer's per-parameter state
            (default True, as in the paper's code, which steps a separate, fresh SGD+SAM
            optimizer from the switch on). For SGD this restarts the momentum buffer; for
            Adam-type optimizers it also resets the second moment and the bias-correction count.
        **sam_kwargs: ``rho``, ``adaptive``, ``eps``, ``model``, ``max_grad_norm`` and the base
            optimizer's keyword arguments, as for :class:`SAM`; ``max_grad_norm`` also clips the
            base optimizer's gradient before the switch (after unscaling with a ``grad_scaler``).

    The step counter (:attr:`steps_taken`) is saved in ``state_dict()`` under ``"late_sam"``,
    so a resumed run switches at the same step.

    Raises:
        ValueError: as :func:`resolve_sam_start` and :class:`SAM`.
    """

    def __init__(
        self,
        params: Iterable[Any] | None,
        base_optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | str,
        sam_start: float,
        sam_start_unit: str = "step",
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        restart_momentum: bool = True,
        **sam_kwargs: Any,
    ) -> None:
        self.sam_start_step = resolve_sam_start(sam_start, sam_start_unit, total_steps, steps_per_epoch)
        super().__init__(params, base_optimizer, **sam_kwargs)
        self.restart_momentum = restart_momentum
        self.steps_taken = 0
        self.momentum_restarted = False

    def sam_active(self, step: int | None = None) -> bool:
        """Whether optimizer step ``step`` (default: the next one) is a SAM step."""
        return (self.steps_taken if step is None else step) >= self.sam_start_step

    def step(self, closure: Closure | None = None, grad_scaler: Any | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """One optimizer step: the base optimizer's before the switch, SAM's from it on.

        Args:
            closure: computes the loss and calls backward (see :meth:`SAM.step`). Required from
                the switch on; before it, optional (without one, the ``.grad`` already present
                is used, as with any optimizer).
            grad_scaler: optional ``torch.amp.GradScaler``; call ``grad_scaler.update()`` after.

        Returns:
            the closure's loss (at w), or None without a closure.

        Raises:
            ValueError: no closure at a SAM step.
            FloatingPointError: without a scaler, a NaN/Inf gradient (nothing written; see
                :mod:`echotrain.optim.finite` and :meth:`SAM.step`).
        """
        if not self.sam_active():
            loss = None
            if closure is not None:
                self.zero_grad()
                with torch.enable_grad():
                    loss = closure()
            self.base_update(grad_scaler, "LateSAM (before the switch)")
            self.steps_taken += 1
            return loss
        if closure is None:
            raise ValueError(
                f"closure is required from step {self.sam_start_step} on (SAM re-evaluates the loss); "
                f"this is step {self.steps_taken}"
            )
        if self.restart_momentum and not self.momentum_restarted:
            self.state.clear()  # in place: the state dict is shared with the base optimizer
            self.momentum_restarted = True
        loss = super().step(closure, grad_scaler=grad_scaler)
        self.steps_taken += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict plus ``"late_sam"``: the step counter and switch flag."""
        sd = super().state_dict()
        sd["late_sam"] = {
            "steps_taken": self.steps_taken,
            "sam_start_step": self.sam_start_step,
            "momentum_restarted": self.momentum_restarted,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; restores the step counter so the switch step holds."""
        state_dict = dict(state_dict)
        late = state_dict.pop("late_sam", None)
        super().load_state_dict(state_dict)
        if late is not None:
            self.steps_taken = int(late["steps_taken"])
            self.momentum_restarted = bool(late["momentum_restarted"])


register_optimizer("late_sam", "echotrain.optim.late_sam:LateSAM", wraps_base=True,
                   takes=SAM_SETTINGS + ("sam_start", "sam_start_unit", "total_steps", "restart_momentum"))
