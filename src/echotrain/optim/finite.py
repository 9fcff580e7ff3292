"""The non-finite-gradient rule shared by every optimizer echotrain ships.

Rule: before an optimizer writes anything for a step, it checks the gradient of every
parameter of the step; on a bad one it raises :class:`FloatingPointError` naming the parameter
(param group, index in the group, shape) with every parameter and every state tensor unchanged,
so the caller can drop the step (``zero_grad``) and go on. A gradient is bad when it holds NaN
or +-Inf, or a value whose square overflows float32 (|g| > 1.8e19): Adam-type second moments
``g * g`` would turn such a gradient into Inf state.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

__all__ = ["GRAD_ABS_LIMIT", "first_nonfinite_grad", "nonfinite_grad_message"]

#: Largest |g| whose square is finite in float32 (sqrt of float32's max, ~1.84e19).
GRAD_ABS_LIMIT: float = math.sqrt(torch.finfo(torch.float32).max)


@torch.no_grad()
def first_nonfinite_grad(param_groups: Iterable[dict[str, Any]]) -> tuple[int, int, torch.Tensor] | None:
    """The first parameter whose gradient is bad (NaN, Inf or |g| > :data:`GRAD_ABS_LIMIT`).

    One max-abs reduction per gradient and a single host sync for the whole step: on CPU
    ``max(|min g|, |max g|)`` from one ``torch.aminmax`` per gradient (NaN anywhere makes both
    NaN; 16x faster than the inf-norm below, whose CPU kernel costs about as much as a whole
    torch AdamW step, docs/benchmarks.md), on other devices ``torch._foreach_norm(..., inf)``
    (one fused launch for all gradients). Sparse gradients are checked through their values.

    Args:
        param_groups: ``optimizer.param_groups`` (dicts with ``"params"``).

    Returns:
        ``(group index, param index within the group, param)`` of the first bad gradient, or
        ``None`` when every gradient is fine (or there are none).
    """
    where: list[tuple[int, int, torch.Tensor]] = []
    grads: list[torch.Tensor] = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            g = p.grad._values() if p.grad.is_sparse else p.grad
            if g.numel() == 0:
                continue
            where.append((gi, pi, p))
            grads.append(g)
    if not grads:
        return None
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    bad_any = []
    maxes: dict[int, torch.Tensor] = {}
    for idx in by_device.values():
        m = _max_abs([grads[i] for i in idx])
        for i, v in zip(idx, m):
            maxes[i] = v
        bad_any.append((~(m <= GRAD_ABS_LIMIT)).any().cpu())  # NaN compares False
    if not bool(torch.stack(bad_any).any()):
        return None
    for i in range(len(grads)):
        if not bool(maxes[i] <= GRAD_ABS_LIMIT):
            return where[i]
    return None  # pragma: no cover - unreachable


def _max_abs(grads: list[torch.Tensor]) -> torch.Tensor:
    """float32 ``max |g|`` of each gradient (one device), NaN where a gradient holds a NaN."""
    if grads[0].device.type == "cpu" and not any(g.is_complex() for g in grads):
        lo_hi = [torch.aminmax(g) for g in grads]
        return torch.maximum(-torch.stack([lo.float() for lo, _ in lo_hi]), torch.stack([hi.float() for _, hi in lo_hi]))
    return torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))])


def nonfinite_grad_message(who: str, hit: tuple[int, int, torch.Tensor]) -> str:
    """The error text for :func:`first_nonfinite_grad`'s hit: names group, index and shape."""
    gi, pi, p = hit
    return (
        f"{who}: the gradient of param_groups[{gi}] param {pi} (shape {tuple(p.shape)}) has NaN/Inf values "
        f"(or |g| > {GRAD_ABS_LIMIT:.3g}, whose square overflows float32); nothing was updated -- every parameter "
        "and optimizer state is unchanged, so the step can be skipped (zero_grad) and training can go on"
    )
