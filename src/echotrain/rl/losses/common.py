"""Pieces shared by the losses of :mod:`echotrain.rl.losses`: the score-function form and metrics.

Several losses of the field (CISPO, DPPO, GPG, DRO, VESPO) are REINFORCE with a detached
per-token weight: l_{i,t} = -sg(w_{i,t}) A_{i,t} log pi(o_{i,t}), whose gradient is
-w A grad log pi. verl and TRL write the loss value with ``log_prob`` itself (not log rho), so
its value is not 0 on-policy; we keep their value so that losses compare one to one.
"""

from __future__ import annotations

import torch


def masked_log_prob(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_prob`` ``(B, T)`` with padding set to 0 through ``torch.where`` (NaN/-inf there reach
    neither value nor gradient)."""
    return torch.where(mask, log_prob, 0)


def score_function_loss(weight: torch.Tensor, advantages: torch.Tensor, log_prob: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """l = -sg(w) A log pi per token, ``(B, T)`` in ``log_prob``'s dtype; 0 at padding.

    Args:
        weight: ``(B, T)`` (or broadcastable) per-token weight; detached here.
        advantages: ``(B, T)`` A. log_prob: ``(B, T)`` log pi (carries grad). mask: bool ``(B, T)``.
    """
    return -(weight.detach().to(log_prob.dtype) * advantages) * masked_log_prob(log_prob, mask)


def token_share(flag: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid tokens where the bool ``(B, T)`` ``flag`` holds (0 with no valid token)."""
    with torch.no_grad():
        return float((flag & mask).sum(dtype=torch.float64) / mask.sum().clamp(min=1))


def ppo_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``ppo_kl`` = mean over valid tokens of -log rho (``log_ratio`` is 0 at padding)."""
    with torch.no_grad():
        return float(-log_ratio.sum(dtype=torch.float64) / mask.sum().clamp(min=1))
