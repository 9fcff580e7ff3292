"""The token importance ratio and PPO's clipped surrogate: the pieces every policy loss builds on.

Pure tensor math shared by :mod:`echotrain.rl.objectives` and :mod:`echotrain.rl.echo`.
"""

from __future__ import annotations

import torch


def clamped_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, clamp: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """log rho = clamp(log_prob - old_log_prob, -clamp, clamp), ``(B, T)`` (design §2).

    With ``mask`` (bool ``(B, T)``), padding positions are set to 0 (rho = 1) through
    ``torch.where``, so NaN/Inf log-probs there reach neither a value nor a gradient: a product
    ``0 * NaN`` in any later backward (e.g. through ECHO's kappa) would poison every token.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -clamp, clamp)
    return log_ratio if mask is None else torch.where(mask, log_ratio, 0)


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped loss l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    With ``clip_ratio_c`` (dual-clip, arXiv 1912.09729, Eq. 5) the loss of A < 0 tokens is
    capped at -A c; A >= 0 tokens are untouched.

    Args:
        ratio: ``(B, T)`` importance ratio rho (any float dtype).
        advantages: ``(B, T)`` A, same shape.
        clip_ratio_low, clip_ratio_high: eps_low, eps_high.
        clip_ratio_c: dual-clip c > 1, or None.

    Returns:
        ``(loss_mat (B, T), flags)`` where flags are bool ``(B, T)`` tensors ``high``
        (A > 0, rho > 1 + eps_high), ``low`` (A < 0, rho < 1 - eps_low) and ``dual``
        (A < 0 and the cap -A c is active).
    """
    l_unclipped = -advantages * ratio
    l_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(l_unclipped, l_clipped)
    clip_active = l_clipped > l_unclipped
    flags = {"high": clip_active & (advantages > 0), "low": clip_active & (advantages < 0)}
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        flags["dual"] = dual
    else:
        flags["dual"] = torch.zeros_like(clip_active)
    return loss, flags
