"""DPPO: a trust region on the divergence of each token's probability, binary TV or binary KL.

Divergence Proximal Policy Optimization (arXiv 2602.04879; prime-rl's default loss; verl
``dppo_tv`` / ``dppo_kl``): instead of clipping the ratio rho = pi / pi_old, a token is masked
out (no gradient) when its probability has moved beyond a divergence threshold *in the
direction its advantage pushes*; the others get truncated-IS REINFORCE:

    l_{i,t} = -M^D_{i,t} sg(min(rho_{i,t}, c)) A_{i,t} log pi(o_{i,t}),

c = ``clip_ratio_c`` (verl reuses the dual-clip key; unset = 20, verl's fallback). The mask
M^D (p = pi(o_t), p_old = pi_old(o_t)), thresholds delta_high = ``clip_ratio_high`` for A > 0
and delta_low = ``clip_ratio_low`` for A <= 0 (verl reuses the clip keys):

- ``dppo_tv`` (binary total variation |p - p_old|): A > 0 keeps p - p_old <= delta_high,
  A <= 0 keeps p - p_old >= -delta_low;
- ``dppo_kl`` (binary KL D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)),
  with verl's 1e-8 in the second log): A > 0 keeps D <= delta_high or p <= p_old, A <= 0 keeps
  D <= delta_low or p >= p_old.
"""

from __future__ import annotations

import torch

from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.losses.common import masked_log_prob, ppo_kl, score_function_loss, token_share
from echotrain.rl.objectives import PreparedInputs, prepared_policy_loss, register_policy_loss

#: The truncation cap of the IS weight when ``clip_ratio_c`` is unset (verl's fallback).
DPPO_DEFAULT_CAP = 20.0
_SETTINGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def _dppo(x: PreparedInputs, keep: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPPO loss and verl's metrics, given the trust-region mask ``keep`` (bool ``(B, T)``)."""
    cap = DPPO_DEFAULT_CAP if x.cfg.clip_ratio_c is None else x.cfg.clip_ratio_c
    ratio = torch.exp(x.log_ratio.detach())
    weight = torch.clamp(ratio, max=cap) * keep
    loss_mat = score_function_loss(weight, x.advantages, x.log_prob, x.mask)
    metrics = {"pg_clipfrac": token_share(~keep, x.mask), "pg_clipfrac_lower": token_share((ratio > cap) & keep, x.mask),
               "ppo_kl": ppo_kl(x.log_ratio, x.mask)}
    return weighted_sum(loss_mat, x.mask, x.seq_weights), metrics


def _probs(x: PreparedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, p_old) ``(B, T)``, detached, 1 at padding (whatever the log-probs hold there)."""
    lp = masked_log_prob(x.log_prob.detach(), x.mask)
    old = masked_log_prob(x.old_log_prob.detach(), x.mask)
    return torch.exp(lp), torch.exp(old)


@register_policy_loss("dppo_tv", metrics=("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"), reads=_SETTINGS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_dppo_tv(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO with the binary total-variation trust region (arXiv 2602.04879; verl ``dppo_tv``).

    See the module docstring for the loss and the mask. Default ``loss_agg_mode`` ``token-mean``.
    Metrics: ``pg_clipfrac`` (tokens masked out), ``pg_clipfrac_lower`` (kept tokens whose weight
    hit the cap c), ``ppo_kl``. Inputs ``(B, T)`` as :func:`~echotrain.rl.compute_policy_loss`
    (verl's signature), returns ``(loss 0-d, metrics)``, same errors.
    """
    p, p_old = _probs(x)
    d = p - p_old
    keep = torch.where(x.advantages > 0, d <= x.cfg.clip_ratio_high, d >= -x.cfg.clip_ratio_low)
    return _dppo(x, keep)


@register_policy_loss("dppo_kl", metrics=("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"), reads=_SETTINGS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_dppo_kl(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO with the binary KL trust region (arXiv 2602.04879; verl ``dppo_kl``).

    See the module docstring. Shapes, signature, metrics and errors as
    :func:`compute_policy_loss_dppo_tv`.
    """
    p, p_old = _probs(x)
    lp = masked_log_prob(x.log_prob.detach(), x.mask)
    old = masked_log_prob(x.old_log_prob.detach(), x.mask)
    binary_kl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    keep_pos = (binary_kl <= x.cfg.clip_ratio_high) | (p <= p_old)
    keep_neg = (binary_kl <= x.cfg.clip_ratio_low) | (p >= p_old)
    return _dppo(x, torch.where(x.advantages > 0, keep_pos, keep_neg))
