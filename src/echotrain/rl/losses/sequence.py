"""Sequence-level objectives: GMPO (geometric mean of the token ratios) and LUSPO (length-scaled GSPO).

Both give one loss per response; the loss matrix holds it on every valid token of the
response, so ``seq-mean-token-mean`` (w_i = 1 / (|o_i| N_seqs)) averages the sequence losses and
every other ``loss_agg_mode`` weights them as it weights tokens. Per response, hence exact
under micro-batches with the aggregation's step statistics only.
"""

from __future__ import annotations

import torch

from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import loss_setting
from echotrain.rl.losses.common import ppo_kl, token_share
from echotrain.rl.objectives import (
    PreparedInputs,
    ppo_clipped_loss,
    prepared_policy_loss,
    register_policy_loss,
    sequence_log_ratio,
)

#: ``geo_mean_correction`` values: how GMPO applies a rollout correction's per-token weights.
GEO_MEAN_CORRECTIONS = ("geometric", "token")
#: verl's floor inside the log of the geometric mean of the correction weights (a weight of 0 gives log 1e-10).
GEO_MEAN_WEIGHT_FLOOR = 1e-10


def geometric_sequence_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One correction weight per response: exp((1/|o_i|) sum_t log(c_{i,t} + 1e-10)) over its valid tokens.

    ``weights`` ``(B, T)`` float >= 0 (a rollout correction's ``rollout_is_weights``), ``mask``
    bool ``(B, T)``; returns ``(B,)`` float64 (1e-10 for an empty response, whose loss is 0
    anyway). verl 0.9.1's ``geo_mean`` (``seq_is_weights``): GMPO's ratio is the geometric mean
    of the token ratios, so the correction of pi_old / mu per token enters as its geometric mean
    too, prod_t (rho_t c_t)^(1/|o|) = geomean(rho) geomean(c). The floor 1e-10 is verl's: a
    masked token (c = 0) shrinks the response's weight by (1e-10)^(1/|o|) instead of zeroing it.
    """
    lengths = mask.sum(-1).clamp(min=1).to(torch.float64)
    log_c = torch.log(weights.detach().to(torch.float64) + GEO_MEAN_WEIGHT_FLOOR)
    return torch.exp(torch.where(mask, log_c, 0).sum(-1) / lengths)


@register_policy_loss("geo_mean", metrics=("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ppo_kl"),
                      reads=("clip_ratio_low", "clip_ratio_high", "geo_mean_correction"), settings={
    "geo_mean_correction": loss_setting(
        "geometric", "geo_mean (GMPO) under a rollout_correction: geometric (default, verl 0.9.1's geo_mean) turns "
        "the per-token correction weights c_t into one weight per response, exp(mean_t log(c_t + 1e-10)), as GMPO's "
        "ratio is a geometric mean; token multiplies each token's loss by its own c_t (the rule of every other loss, "
        "an arithmetic mean in effect; echotrain before this flag). Sequence-level corrections give the same weight "
        "either way (up to the 1e-10 floor).", choices=GEO_MEAN_CORRECTIONS)})
@prepared_policy_loss("seq-mean-token-mean")
def compute_policy_loss_geo_mean(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: maximise the geometric mean of the token ratios (arXiv 2507.20673, Eq. 4; verl ``geo_mean``).

    Per response i with sequence advantage A_i (the mean of A over its valid tokens):
    J_i = A_i exp((1/|o_i|) sum_t sgn(A_i) min(sgn(A_i) log rho_{i,t}, sgn(A_i) clip(log rho_{i,t},
    -eps_low, eps_high))), the token clip in log space (paper: eps = 0.4, i.e. rho in
    (e^-0.4, e^0.4)); l_{i,t} = -J_i on every valid token. Default ``loss_agg_mode``
    ``seq-mean-token-mean`` = the mean of -J_i over responses (verl's ``geo_mean`` ignores
    ``loss_agg_mode`` and takes ``torch.mean`` over *all* rows, empty ones included; we leave
    empty responses out, as every mode does, and honour ``loss_agg_mode``). log rho is clamped to
    +-``log_ratio_clamp`` first (verl leaves it unclamped). A rollout correction's per-token
    weights c_{i,t} enter as one weight per response, their geometric mean
    (:func:`geometric_sequence_weights`, verl's), with ``geo_mean_correction="geometric"`` (the
    default); ``"token"`` multiplies each token's loss by its own c_{i,t}, as every other loss.
    Metrics: ``pg_clipfrac_high`` (A > 0, log rho > eps_high), ``pg_clipfrac_low`` (A < 0,
    log rho < -eps_low), ``pg_clipfrac``, ``ppo_kl``. Inputs ``(B, T)`` as
    :func:`~echotrain.rl.compute_policy_loss` (verl's signature); returns ``(loss 0-d, metrics)``;
    same errors.
    """
    cfg, mask, lr = x.cfg, x.mask, x.log_ratio
    lengths = mask.sum(-1).clamp(min=1).to(lr.dtype)
    adv_seq = torch.where(mask, x.advantages, 0).sum(-1) / lengths  # (B,)
    sgn = torch.sign(adv_seq).unsqueeze(-1)
    lr_clip = torch.clamp(lr, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clip)
    seq_ratio = torch.exp(torch.where(mask, lr_min, 0).sum(-1) / lengths)
    loss_mat = (-adv_seq * seq_ratio).unsqueeze(-1).expand_as(lr)
    high = (sgn > 0) & (lr.detach() > cfg.clip_ratio_high)
    low = (sgn < 0) & (lr.detach() < -cfg.clip_ratio_low)
    h, lo = token_share(high, mask), token_share(low, mask)
    metrics = {"pg_clipfrac": h + lo, "pg_clipfrac_high": h, "pg_clipfrac_low": lo, "ppo_kl": ppo_kl(lr, mask)}
    w = x.seq_weights
    if x.rollout_is_weights is not None and cfg.geo_mean_correction == "geometric":
        w = x.agg_weights * geometric_sequence_weights(x.rollout_is_weights, mask)
    return weighted_sum(loss_mat, mask, w), metrics


@register_policy_loss("luspo", metrics=("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "pg_clipfrac_lower", "ppo_kl"), reads=("clip_ratio_low", "clip_ratio_high"))
@prepared_policy_loss("seq-mean-token-sum")
def compute_policy_loss_luspo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """LUSPO: GSPO's clipped sequence ratio, each response's loss scaled by its length (arXiv 2602.05261; TRL 1.16).

    s_i = exp((1/|o_i|) sum_t log rho_{i,t}); l_{i,t} = -min(s_i A_{i,t}, clip(s_i, 1 - eps_low,
    1 + eps_high) A_{i,t}) as :func:`~echotrain.rl.objectives.compute_policy_loss_gspo`
    (gradient through s_i, as TRL's ``importance_sampling_level="sequence"``, which ``luspo``
    requires), with default ``loss_agg_mode`` ``seq-mean-token-sum``: (1/N_seqs) sum_i |o_i| l_i,
    the length-unbiased sequence mean (TRL: ``(per_token_loss * mask).sum(-1).mean()``, over every
    row; we leave empty responses out of N_seqs, as every mode does: TRL = ours x N_nonempty / B).
    Each token's log rho is clamped to +-``log_ratio_clamp`` (20) before the sequence mean, with
    zero gradient beyond; TRL averages the raw log-ratios (they differ only where some
    |log rho| > 20). Metrics and errors as
    :func:`~echotrain.rl.objectives.compute_policy_loss_gspo`.
    """
    c = x.cfg.log_ratio_clamp
    seq_log_ratio = sequence_log_ratio(x.log_ratio, x.mask).clamp(-c, c)
    return ppo_clipped_loss(x, torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(x.log_ratio))
