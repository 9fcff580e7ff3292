"""Entropy terms of the policy loss: verl's ``entropy_coeff`` bonus, TRL's ``entropy_coef`` bonus
with Skywork-OR1's adaptive coefficient, and the high-entropy token mask of "Beyond the 80/20
Rule" (TRL's ``top_entropy_quantile``). Pure tensor math; docs/design/objectives.md §11.

H_{i,t} = -sum_v pi(v | .) log pi(v | .) is the token entropy (nats) of the current policy at the
sampling temperature, from the same forward as the log-probs (differentiable).
"""

from __future__ import annotations

import torch

from echotrain.rl.step import StepStats
from echotrain.rl.stepwise import step_agg_loss
from echotrain.rl.validation import check_finite, check_tensor

#: How an entropy bonus is aggregated: ``"loss_agg_mode"`` (verl's ``entropy_coeff``: like the
#: policy loss, with the step's normalisers) or ``"token-mean"`` (TRL's ``entropy_coef``: the mean
#: over the step's valid tokens whatever the loss's aggregation).
ENTROPY_AGGREGATIONS = ("loss_agg_mode", "token-mean")


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, step: StepStats, how: str, *,
                  advantages: torch.Tensor | None = None, group_index: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's share of the step's entropy bonus H_agg (the loss subtracts coef * H_agg).

    - ``how="loss_agg_mode"`` (verl 0.9.1 ``actor.entropy_coeff``: ``agg_loss(entropy,
      response_mask, loss_agg_mode)``): aggregated like the policy loss, with the step's normalisers
      (:func:`echotrain.rl.stepwise.step_agg_loss`), so summed over micro-batches and ranks it is
      the whole step's aggregate.
    - ``how="token-mean"`` (TRL 1.16 ``entropy_coef``): sum_{i,t} H m / (valid tokens of the step),
      times ``step.dp_size``; the same for every ``loss_agg_mode``.

    Args:
        entropy: ``(b, T)`` float token entropies (nats), with grad for the bonus to act.
        response_mask: ``(b, T)`` 0/1 tokens the bonus covers (the policy loss's mask).
        step: the optimizer step's statistics (:func:`echotrain.rl.compute_step_stats`).
        how: one of :data:`ENTROPY_AGGREGATIONS`.
        advantages, group_index: this micro-batch's, for ``loss_agg_mode=balanced``.

    Returns:
        0-d tensor (differentiable through ``entropy``).

    Raises:
        ValueError: unknown ``how``, shape mismatch, NaN/Inf entropy on valid tokens.
    """
    if how not in ENTROPY_AGGREGATIONS:
        raise ValueError(f"how={how!r} is unknown; valid: {list(ENTROPY_AGGREGATIONS)}")
    check_tensor("entropy", entropy, 2)
    if response_mask.shape != entropy.shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, entropy {tuple(entropy.shape)}")
    valid = response_mask.bool()
    check_finite("entropy", entropy.detach()[valid])
    ent = torch.where(valid, entropy, 0.0)
    if how == "loss_agg_mode":
        return step_agg_loss(ent, response_mask, step, advantages=advantages, group_index=group_index)
    return ent.sum() / max(step.num_tokens, 1.0) * step.dp_size


def high_entropy_mask(entropy: torch.Tensor, response_mask: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """The tokens whose entropy is in the top ``top_entropy_quantile`` of the valid ones (Wang et
    al., "Beyond the 80/20 Rule", arXiv 2506.01939; TRL's ``get_high_entropy_mask``).

    Threshold: ``torch.quantile`` (linear interpolation) at ``1 - top_entropy_quantile`` of the
    entropies on valid tokens; a token is kept if valid and its entropy >= the threshold. 1.0
    keeps every valid token, 0.0 only the highest-entropy one(s); no valid token: all False.

    Args:
        entropy: ``(B, T)`` float token entropies (nats).
        response_mask: ``(B, T)`` 0/1 valid tokens.
        top_entropy_quantile: rho in [0, 1].

    Returns:
        ``(B, T)`` bool.

    Raises:
        ValueError: rho outside [0, 1], shape mismatch, NaN/Inf entropy on valid tokens.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    check_tensor("entropy", entropy, 2)
    if response_mask.shape != entropy.shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, entropy {tuple(entropy.shape)}")
    valid = response_mask.bool()
    values = entropy[valid].float()
    check_finite("entropy", values)
    if values.numel() == 0:
        return torch.zeros_like(valid)
    if top_entropy_quantile >= 1.0:
        return valid.clone()
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    return valid & (entropy.float() >= threshold)


def adaptive_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, coef_min: float,
                          coef_max: float) -> float:
    """Skywork-OR1's adaptive entropy control (arXiv 2505.22312 §3.2.2, TRL's
    ``use_adaptive_entropy``): after an optimizer step whose token-mean entropy (nats) was
    ``entropy``, the coefficient moves by ``delta`` up (entropy <= ``target``) or down, clipped to
    ``[coef_min, coef_max]``. The bonus of the next step uses the new coefficient only where
    ``entropy <= target`` (:func:`applied_entropy_coef`)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The coefficient an optimizer step applies under adaptive control: ``coef`` when the previous
    optimizer step's entropy was at or below ``target``, else 0 (TRL: the first step, with no
    previous entropy, applies 0)."""
    return coef if last_entropy <= target else 0.0
