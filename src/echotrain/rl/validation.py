"""Input checks shared by the objectives: every bad input raises a clear error, never a NaN.

Each check names the argument and the problem. They run on every call (a handful of
reductions), so they are cheap compared with the loss and can stay on in production.
"""

from __future__ import annotations

from typing import Iterable

import torch


def check_choice(name: str, value: str, valid: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``valid``.

    Raises:
        ValueError: ``value`` is not in ``valid`` (the message lists the valid names).
    """
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{name}={value!r} is unknown; valid: {sorted(valid)}")
    return value


def check_tensor(name: str, x: object, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Check that ``x`` is a tensor with ``ndim`` dimensions (an int or a tuple of allowed ones).

    Raises:
        TypeError: ``x`` is not a ``torch.Tensor``.
        ValueError: wrong number of dimensions.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(x.shape)}")
    return x


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Check that ``x`` has no NaN/Inf (only where ``mask`` is True, if given).

    Padding positions may hold anything (e.g. -inf log-probs); they never enter a loss.

    Raises:
        ValueError: NaN or Inf found (the message gives the count).
    """
    finite = torch.isfinite(x.detach())
    if bool(finite.all()):  # fast path: one pass, no mask needed
        return x
    bad = ~finite if mask is None else ~finite & mask
    n_bad = int(bad.sum())
    if n_bad:
        raise ValueError(f"{name} has {n_bad} NaN/Inf value(s) at valid positions")
    return x


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Check that every tensor in ``others`` has the shape of ``ref``.

    Raises:
        ValueError: a shape differs (the message names both arguments and shapes).
    """
    for name, x in others.items():
        if x is not None and tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def as_bool_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor; it must be bool or hold only 0 and 1.

    Raises:
        TypeError: not a tensor.
        ValueError: values other than 0/1 (e.g. 0.5, 2, NaN).
    """
    check_tensor(name, mask)
    if mask.dtype == torch.bool:
        return mask
    ok = (mask == 0) | (mask == 1)
    if not bool(ok.all()):
        bad = mask[~ok].flatten()[:3].tolist()
        raise ValueError(f"{name} must be boolean or hold only 0/1 values, found e.g. {bad}")
    return mask.bool()


def check_group_index(name: str, group_index: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Check a ``(B,)`` integer group-id tensor.

    Raises:
        TypeError: not a tensor or not an integer dtype.
        ValueError: wrong shape.
    """
    check_tensor(name, group_index, 1)
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool or group_index.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {group_index.dtype}")
    if group_index.shape[0] != batch_size:
        raise ValueError(f"{name} has shape {tuple(group_index.shape)}, expected ({batch_size},)")
    return group_index


def check_token_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the ``(B, T)`` inputs of a policy loss.

    ``advantages`` may be ``(B, T)`` or ``(B,)`` (broadcast over tokens).

    Returns:
        ``(advantages (B, T), response_mask (B, T) bool)``; the returned advantages are 0 at
        padding (``torch.where``), so that a NaN/Inf there cannot reach a gradient.

    Raises:
        TypeError / ValueError: non-tensors, wrong dims, shape mismatches, NaN/Inf in
        ``log_prob``, ``old_log_prob`` or ``advantages`` at valid tokens, non-0/1 masks.
    """
    check_tensor("log_prob", log_prob, 2)
    check_tensor("old_log_prob", old_log_prob, 2)
    check_tensor("advantages", advantages, (1, 2))
    mask = as_bool_mask("response_mask", response_mask)
    check_same_shape("log_prob", log_prob, old_log_prob=old_log_prob, response_mask=mask)
    if advantages.dim() == 1:
        if advantages.shape[0] != log_prob.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}; expected ({log_prob.shape[0]},) or {tuple(log_prob.shape)}"
            )
        advantages = advantages.unsqueeze(-1).expand_as(log_prob)
    check_same_shape("log_prob", log_prob, advantages=advantages)
    check_finite("log_prob", log_prob, mask)
    check_finite("old_log_prob", old_log_prob, mask)
    check_finite("advantages", advantages, mask)
    return torch.where(mask, advantages, 0), mask
