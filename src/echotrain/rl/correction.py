"""Behaviour-policy (rollout) corrections: a stage between the sampler and any policy loss.

The policy that *sampled* a response (the behaviour policy mu: the inference engine, bf16
generation, older weights) is not the policy the loss's ratio is taken against (pi_old, the
learner's recomputed ``old_log_prob``). A correction turns the sampler's per-token log-probs
``rollout_log_prob`` (B, T) into

- per-token weights ``rollout_is_weights`` (B, T) that multiply every token's policy loss
  (verl's ``rollout_is_weights`` argument), and/or
- a modified ``response_mask`` (B, T): rejected tokens leave the loss *and* its normalisers,

so every registered policy loss gets every correction with no per-loss code
(:func:`echotrain.rl.compute_policy_loss` applies them; docs/design/objectives.md §10). One
exception, verl's: ``geo_mean`` (GMPO) turns the token weights into one weight per response,
their geometric mean (``geo_mean_correction``, :mod:`echotrain.rl.losses.sequence`). The
importance ratio of the correction is w = pi_old / mu = exp(old_log_prob - rollout_log_prob)
(log-ratio clamped to +-``log_ratio_clamp``, verl's safety bound of 20).

Registered corrections (:data:`ROLLOUT_CORRECTIONS`; ``rollout_correction=a,b`` chains them:
weights multiply, rejections combine with AND, flags with OR):

- ``token_is``: truncated IS per token, clip(w_t, lower, C) (TIS; Yao et al. 2025).
- ``seq_is``: truncated IS per sequence, clip(prod_t w_t, lower, C) on all its tokens.
- ``token_mask``: w_t inside [lower, C], else 0 (IcePop, arXiv 2510.18855, Eq. 4).
- ``seq_mask``: the sequence's prod_t w_t inside [lower, C], else 0 (MIS; Liu, Li et al. 2025).
- ``rejection``: drop tokens / sequences whose k1/k2/k3 statistic (``rollout_rs``) is out of
  bounds (verl ``rollout_rs``; estimators of Schulman 2020, "Approximating KL divergence").
- ``offpolicy_mask``: weight 0 for negative-advantage sequences whose mean k1 KL(mu || pi_old)
  exceeds delta (DeepSeek-V3.2, arXiv 2512.02556, off-policy sequence masking, §3.1).
- ``decoupled``: decoupled PPO (Hilton et al. 2021 arXiv 2110.00641 Eq. 2; AReaL arXiv
  2505.24298 Eq. 5): the loss's clipped surrogate is taken against the proximal policy
  pi_prox = pi_old (the learner's ``old_log_prob``) and multiplied by pi_prox / mu, with
  AReaL's optional cap (tokens above it get weight 0).

Step-global pieces (batch normalisation of the weights to mean 1, ESS, the metrics) are sums
over the optimizer step: :func:`echotrain.rl.compute_step_stats` joins them to its one
all-reduce (:class:`CorrectionStats` in ``StepStats.correction``), so the loss and gradient are
exact under micro-batches and data-parallel ranks. Sequence aggregates (seq_is, seq_mask,
seq_* rejection, offpolicy_mask) are row-local and exact by construction.

Metrics (all step-global, already reduced over micro-batches and ranks: the trainer logs the
step's value; ``rollout_corr/*`` is the prefix verl uses) - :data:`CORRECTION_METRICS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from echotrain.metrics import Metric, declare_metric
from echotrain.rl.config import CAP_LOG_TOLERANCE, PolicyLossConfig, as_policy_loss_config
from echotrain.rl.correction_names import (  # noqa: F401  re-exported
    LEVELS,
    ROLLOUT_CORRECTIONS,
    parse_rollout_correction,
    register_rollout_correction,
)
from echotrain.rl.validation import as_bool_mask, check_finite, check_same_shape, check_tensor

#: Every metric this module produces, declared in the metric schema (:mod:`echotrain.metrics`).
#: All are step values computed from the optimizer step's all-reduced sums. The four mismatch
#: metrics are logged by the trainer for every training step (``reduce="step"``, from the whole
#: batch, or the first mini-batch's rows where the others' old_log_prob is the sampler's own
#: (``reuse_sampler_log_probs``); with a correction the loss returns them too, per optimizer step, and the trainer's
#: whole-batch value is the one written); the others come with each optimizer step's loss when a ``rollout_correction`` is set
#: (``reduce="mean"``: one value per optimizer step, averaged over the step's optimizer steps).
_MISMATCH_WHEN = ("every step (rollout_log_prob recorded); over the first mini-batch's rows where the others' "
                  "old_log_prob is the sampler's (reuse_sampler_log_probs)")


def _declare_mismatch(name: str, help: str, **plot: str) -> Metric:
    """A train/inference mismatch metric: nats, one value per training step from the whole batch."""
    return declare_metric(name, reduce="step", unit="nats", when=_MISMATCH_WHEN, help=help, **plot)


def _declare_corrected(name: str, unit: str, help: str, **plot: str) -> Metric:
    """A metric of the correction stage: one value per optimizer step, averaged over the step's."""
    return declare_metric(name, reduce="mean", unit=unit, when="rollout_correction set", help=help, **plot)


CORRECTION_METRICS: dict[str, Metric] = {m.name: m for m in (
    _declare_mismatch("rollout_corr/log_prob_abs_diff",
              "mean |rollout_log_prob - old_log_prob| over valid tokens (train/inference mismatch)"),
    _declare_mismatch("rollout_corr/kl", "k1 KL(mu || pi_old): mean (rollout_log_prob - old_log_prob); verl rollout_corr/kl",
              panel="Policy drift", label="rollout_corr/kl = KL(rollout || old), k1"),
    _declare_mismatch("rollout_corr/k3_kl", "k3 KL(mu || pi_old): mean (w - 1 - log w), w = pi_old/mu; verl rollout_corr/k3_kl"),
    declare_metric("rollout_corr/behaviour_ess", reduce="step", unit="fraction", when=_MISMATCH_WHEN,
                   help="effective sample size (sum w)^2 / (n sum w^2) of the untruncated behaviour weights "
                        "w = pi_old/mu over valid tokens, in (0, 1]; 1 on-policy, whether or not a correction is set",
                   panel="Rollout correction", label="behaviour ESS (untruncated)"),
    _declare_corrected("rollout_corr/is_mean", "1", "mean correction weight over kept tokens, before batch normalisation"),
    _declare_corrected("rollout_corr/is_min", "1", "smallest correction weight on a kept token, before batch normalisation"),
    _declare_corrected("rollout_corr/is_max", "1", "largest correction weight on a kept token, before batch normalisation"),
    _declare_corrected("rollout_corr/ess", "fraction", "effective sample size (sum w)^2 / (n sum w^2) over kept tokens, in (0, 1]",
               panel="Rollout correction", label="effective sample size"),
    _declare_corrected("rollout_corr/frac_high", "fraction",
               "valid tokens truncated, masked or rejected above the upper threshold",
               panel="Rollout correction", label="frac_high"),
    _declare_corrected("rollout_corr/frac_low", "fraction", "valid tokens truncated, masked or rejected below the lower threshold",
               panel="Rollout correction", label="frac_low"),
    _declare_corrected("rollout_corr/zero_weight_frac", "fraction", "kept tokens whose correction weight is 0 (masked)"),
    _declare_corrected("rollout_corr/rejected_frac", "fraction", "valid tokens removed from the loss by rejection"),
    _declare_corrected("rollout_corr/seq_rejected_frac", "fraction", "non-empty sequences with a rejected token"),
    _declare_corrected("rollout_corr/batch_norm_factor", "1",
               "the step's mean weight the weights were divided by (1 without batch normalisation)"),
)}


# --------------------------------------------------------------------------- the registry


class CorrectionInputs(NamedTuple):
    """What a correction reads, for one (micro-)batch.

    ``old_log_prob``, ``rollout_log_prob``: ``(B, T)`` float log-probs (nats) of the sampled
    tokens under pi_old and the behaviour policy mu; ``advantages``: ``(B, T)`` or ``(B, 1)``;
    ``response_mask``: bool ``(B, T)``; ``log_ratio``: ``(B, T)`` float64 log(pi_old / mu),
    clamped to +-``log_ratio_clamp``, 0 at padding; ``seq_log_ratio``: ``(B,)`` float64 sum of
    the *unclamped* token log-ratios of each sequence, clamped to +-``log_ratio_clamp``.
    """

    old_log_prob: torch.Tensor
    rollout_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    log_ratio: torch.Tensor
    seq_log_ratio: torch.Tensor


@dataclass(frozen=True)
class Correction:
    """What one correction returns; every field ``(B, T)`` or None (= no effect).

    ``weights``: float64 >= 0 multiplying each token's loss; ``keep``: bool, False for tokens
    rejected from the loss and its normalisers; ``high`` / ``low``: bool, tokens truncated,
    masked or rejected above the upper / below the lower threshold (metrics only).
    """

    weights: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    high: torch.Tensor | None = None
    low: torch.Tensor | None = None


CorrectionFn = Callable[[CorrectionInputs, PolicyLossConfig], Correction]


# --------------------------------------------------------------------------- the corrections


def _band(w: torch.Tensor, lower: float | None, upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w > upper, w < lower)`` (the second all False without ``lower``)."""
    high = w > upper
    low = w < lower if lower is not None else torch.zeros_like(high)
    return high, low


def _truncate(w: torch.Tensor, cfg: PolicyLossConfig) -> Correction:
    high, low = _band(w, cfg.rollout_is_threshold_lower, cfg.rollout_is_threshold)
    return Correction(weights=w.clamp(min=cfg.rollout_is_threshold_lower, max=cfg.rollout_is_threshold), high=high, low=low)


def _mask(w: torch.Tensor, cfg: PolicyLossConfig) -> Correction:
    high, low = _band(w, cfg.rollout_is_threshold_lower, cfg.rollout_is_threshold)
    return Correction(weights=torch.where(high | low, 0.0, w), high=high, low=low)


def _seq_ratio(x: CorrectionInputs) -> torch.Tensor:
    """``(B, T)`` prod_t w_t of each sequence (clamped in log space), on every position."""
    return torch.exp(x.seq_log_ratio).unsqueeze(-1).expand_as(x.log_ratio)


@register_rollout_correction("token_is", level="token", settings=("rollout_is_threshold", "rollout_is_threshold_lower"))
def token_is(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """Token truncated IS: w_t = clip(pi_old/mu, lower, C), ``(B, T)`` float64 weights.

    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training" (TIS: min(pi_learner / pi_sampler, C)); the optional floor ``lower`` is ours
    (verl has none). verl: ``rollout_is=token``, ``rollout_is_threshold=C``.
    """
    return _truncate(torch.exp(x.log_ratio), cfg)


@register_rollout_correction("seq_is", level="sequence", settings=("rollout_is_threshold", "rollout_is_threshold_lower"))
def seq_is(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """Sequence truncated IS: w_i = clip(prod_t pi_old/mu, lower, C) on every token of sequence i.

    Liu, Li et al. 2025, "When Speed Kills Stability" (sequence-level TIS). verl:
    ``rollout_is=sequence``, ``rollout_is_threshold=C``.
    """
    return _truncate(_seq_ratio(x), cfg)


@register_rollout_correction("token_mask", level="token", settings=("rollout_is_threshold", "rollout_is_threshold_lower"))
def token_mask(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """IcePop token mask: w_t = pi_old/mu inside [lower, C], else 0 (the token stays in the normalisers).

    IcePop (Ling Team, arXiv 2510.18855, Eq. 4-5: M(k) = k if k in [alpha, beta] else 0;
    alpha = 0.5, beta = 5). verl: ``rollout_is=token``, ``rollout_is_threshold="lower_upper"``.
    Without ``rollout_is_threshold_lower`` only the upper side masks.
    """
    return _mask(torch.exp(x.log_ratio), cfg)


@register_rollout_correction("seq_mask", level="sequence", settings=("rollout_is_threshold", "rollout_is_threshold_lower"))
def seq_mask(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """Sequence mask (MIS): w_i = prod_t pi_old/mu inside [lower, C], else 0 for the whole sequence.

    Liu, Li et al. 2025, "When Speed Kills Stability" (masked IS). verl:
    ``rollout_is=sequence``, ``rollout_is_threshold="lower_upper"``.
    """
    return _mask(_seq_ratio(x), cfg)


def _masked_seq(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``(B,)`` sum / mean / max of ``values`` over each row's valid tokens (0 for empty rows)."""
    if how == "max":
        m = torch.where(mask, values, float("-inf")).amax(-1)
        return torch.where(torch.isinf(m), 0.0, m)
    s = torch.where(mask, values, 0).sum(-1)
    return s if how == "sum" else s / mask.sum(-1).clamp(min=1)


def rejection_statistic(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str) -> tuple[torch.Tensor, bool]:
    """The ``rollout_rs`` statistic ``(B, T)`` float64 (a sequence's value on all its tokens) and
    whether it is a k1 statistic (bounded on both sides, as a ratio).

    ``log_ratio`` = log(pi_old / mu) ``(B, T)``: k1 = -log_ratio = log(mu / pi_old), k2 =
    log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (Schulman 2020; verl's naming).
    ``seq_{sum,mean,max}_kN`` aggregate kN over each sequence's valid tokens.
    """
    level, _, k = rollout_rs.rpartition("_")
    lr = log_ratio
    stat = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.expm1(lr) - lr}[k]
    if level != "token":
        stat = _masked_seq(stat, mask, level.split("_")[1]).unsqueeze(-1).expand_as(lr)
    return stat, k == "k1"


@register_rollout_correction("rejection", level="token", settings=("rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower"))
def rejection(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """Rejection by a KL statistic: tokens (or whole sequences) out of bounds leave the loss.

    k2/k3: keep if statistic <= ``rollout_rs_threshold``; k1 (a log-ratio): keep if
    log(lower) <= statistic <= log(upper), lower = ``rollout_rs_threshold_lower`` or 1/upper.
    Returns ``keep`` (the new response mask); verl ``rollout_rs`` / ``rollout_rs_threshold``
    (``compute_rollout_rejection_mask``).
    """
    import math

    stat, is_k1 = rejection_statistic(x.log_ratio, x.response_mask, cfg.rollout_rs)
    upper = cfg.rollout_rs_threshold
    if is_k1:
        lower = cfg.rollout_rs_threshold_lower if cfg.rollout_rs_threshold_lower is not None else 1.0 / upper
        high, low = stat > math.log(upper), stat < math.log(lower)
    else:
        high, low = stat > upper, torch.zeros_like(x.response_mask)
    return Correction(keep=~(high | low), high=high, low=low)


@register_rollout_correction("offpolicy_mask", level="sequence", settings=("offpolicy_mask_delta",))
def offpolicy_mask(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """DeepSeek-V3.2 off-policy sequence masking: weight 0 for sequence i if A_i < 0 and
    (1/|o_i|) sum_t log(mu(o_t) / pi_old(o_t)) > delta, else 1.

    arXiv 2512.02556, §3.1 (the mask M_{i,t} of the GRPO objective; their pi_old is the
    sampling policy, here mu = ``rollout_log_prob``; their pi_theta is taken as the learner's
    ``old_log_prob``, the current policy at the step's first update). A_i: the mean advantage
    over the sequence's valid tokens. The sequence stays in the normalisers (as in the paper).
    """
    mask = x.response_mask
    kl = _masked_seq(-x.log_ratio, mask, "mean")
    adv = x.advantages.to(torch.float64).expand_as(x.log_ratio)
    a = _masked_seq(adv, mask, "mean")
    masked = ((a < 0) & (kl > cfg.offpolicy_mask_delta)).unsqueeze(-1).expand_as(mask)
    return Correction(weights=(~masked).to(torch.float64), high=masked)


@register_rollout_correction("decoupled", level="token", settings=("behav_imp_weight_cap",))
def decoupled(x: CorrectionInputs, cfg: PolicyLossConfig) -> Correction:
    """Decoupled PPO: the behaviour weight pi_prox / mu = exp(old_log_prob - rollout_log_prob)
    multiplies the clipped surrogate taken against pi_prox = pi_old (the loss's own ratio).

    J = E_mu[ (pi_prox/mu) min(r A, clip(r, 1-eps, 1+eps) A) ], r = pi_theta / pi_prox (Hilton et
    al. 2021, arXiv 2110.00641, Eq. 2; AReaL, arXiv 2505.24298, Eq. 5). With
    ``behav_imp_weight_cap`` c, tokens with pi_prox/mu > c e^tol get weight 0 (AReaL's cap; tol =
    :data:`CAP_LOG_TOLERANCE` nats, so float rounding of an on-policy token is not masked at c = 1;
    a kept weight may exceed c by that factor, ~1.001). Same weights as ``token_is`` with C = inf
    when uncapped; verl's default decoupled mode is that. Returns ``(B, T)`` float64 weights.
    """
    w = torch.exp(x.log_ratio)
    if cfg.behav_imp_weight_cap is None:
        return Correction(weights=w)
    high = x.log_ratio > math.log(cfg.behav_imp_weight_cap) + CAP_LOG_TOLERANCE
    return Correction(weights=torch.where(high, 0.0, w), high=high)


# --------------------------------------------------------------------------- combining, step statistics


def correction_inputs(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, advantages: torch.Tensor,
                      response_mask: torch.Tensor, cfg: PolicyLossConfig) -> CorrectionInputs:
    """Check the tensors and build :class:`CorrectionInputs`.

    Raises:
        ValueError: ``rollout_log_prob`` is None (naming ``rollout_correction``), shapes differ,
            NaN/Inf at valid tokens, non-0/1 mask.
        TypeError: non-tensor inputs.
    """
    if rollout_log_prob is None:
        raise ValueError(f"rollout_correction={cfg.rollout_correction!r} needs rollout_log_prob (B, T), the "
                         "sampler's per-token log-probs; none was given")
    check_tensor("rollout_log_prob", rollout_log_prob, 2)
    check_tensor("old_log_prob", old_log_prob, 2)
    mask = as_bool_mask("response_mask", response_mask)
    check_same_shape("old_log_prob", old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=mask)
    check_finite("rollout_log_prob", rollout_log_prob, mask)
    check_finite("old_log_prob", old_log_prob, mask)
    adv = advantages if advantages.dim() == 2 else advantages.reshape(-1, 1)
    c = cfg.log_ratio_clamp
    raw = torch.where(mask, old_log_prob.detach().to(torch.float64) - rollout_log_prob.detach().to(torch.float64), 0)
    return CorrectionInputs(old_log_prob.detach(), rollout_log_prob.detach(), adv.detach(), mask, raw.clamp(-c, c),
                            raw.sum(-1).clamp(-c, c))


class RawCorrection(NamedTuple):
    """A chain's combined output before batch normalisation, all ``(B, T)``: ``weights`` float64
    (1 where no correction weights; 0 at padding), ``keep`` bool (response_mask & not rejected),
    ``high`` / ``low`` bool flags (valid tokens only)."""

    weights: torch.Tensor
    keep: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor


def raw_correction(names: Sequence[str], x: CorrectionInputs, cfg: PolicyLossConfig) -> RawCorrection:
    """Run the corrections ``names`` on ``x`` and combine them (weights multiply, keep AND, flags OR)."""
    mask = x.response_mask
    w = torch.ones_like(x.log_ratio)
    keep, high, low = mask.clone(), torch.zeros_like(mask), torch.zeros_like(mask)
    for n in names:
        c = ROLLOUT_CORRECTIONS[n](x, cfg)
        if c.weights is not None:
            w = w * c.weights
        if c.keep is not None:
            keep &= c.keep
        if c.high is not None:
            high |= c.high
        if c.low is not None:
            low |= c.low
    return RawCorrection(torch.where(mask, w, 0.0), keep, high & mask, low & mask)


def normalization_level(names: Sequence[str]) -> str:
    """"sequence" if every weighting correction of the chain is sequence-level, else "token"."""
    levels = {ROLLOUT_CORRECTIONS.info(n)["level"] for n in names if n != "rejection"}
    return "sequence" if levels == {"sequence"} else "token"


#: Layout of the step's correction sums (one float64 vector, all-reduced with SUM).
_SUMS = ("n_valid", "n_kept", "sum_w", "sum_w2", "n_high", "n_low", "n_zero", "n_rejected", "n_seq_valid",
         "n_seq_rejected", "seq_sum_w", "n_seq_kept", "sum_k1", "sum_k3", "sum_abs", "sum_wr", "sum_wr2")
NUM_SUMS = len(_SUMS)


def local_sums(x: CorrectionInputs, raw: RawCorrection) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums (NUM_SUMS,), maxes (2,))`` float64 of one micro-batch: the plain sums (see
    ``_SUMS``) and ``[max w, -min w]`` over kept tokens (-inf if none), for a MAX all-reduce."""
    mask, keep = x.response_mask, raw.keep
    f = lambda t: t.sum(dtype=torch.float64)  # noqa: E731
    w = torch.where(keep, raw.weights, 0.0)
    lengths, kept_len = mask.sum(-1), keep.sum(-1)
    valid_seq, kept_seq = lengths > 0, kept_len > 0
    seq_w = w.sum(-1) / kept_len.clamp(min=1)
    diff = -torch.where(mask, x.old_log_prob.to(torch.float64) - x.rollout_log_prob.to(torch.float64), 0)  # log mu/pi_old
    lr = x.log_ratio
    k3 = torch.where(mask, torch.expm1(lr) - lr, 0)
    wr = torch.where(mask, torch.exp(lr), 0)  # untruncated pi_old / mu, for the behaviour ESS
    sums = torch.stack([
        f(mask), f(keep), f(w), f(w * w), f(raw.high), f(raw.low), f(keep & (raw.weights == 0)), f(mask & ~keep),
        f(valid_seq), f(valid_seq & (kept_len < lengths)), f(torch.where(kept_seq, seq_w, 0.0)), f(kept_seq),
        f(diff), f(k3), f(diff.abs()), f(wr), f(wr * wr)])
    neg = torch.tensor(float("-inf"), dtype=torch.float64, device=w.device)
    wmax = torch.where(keep, raw.weights, neg).max() if keep.any() else neg
    wmin = torch.where(keep, -raw.weights, neg).max() if keep.any() else neg
    return sums, torch.stack([wmax, wmin])


@dataclass(frozen=True)
class CorrectionStats:
    """A step's correction statistics: ``names`` (the chain), ``norm_factor`` (the weights are
    divided by it: the step's mean weight with ``rollout_is_batch_normalize``, else 1) and
    ``metrics`` (the step's :data:`CORRECTION_METRICS`)."""

    names: tuple[str, ...]
    norm_factor: float
    metrics: dict[str, float] = field(default_factory=dict)


def finish(names: tuple[str, ...], sums: torch.Tensor, maxes: torch.Tensor, cfg: PolicyLossConfig) -> CorrectionStats:
    """The step's :class:`CorrectionStats` from the all-reduced sums and maxes."""
    s = dict(zip(_SUMS, sums.tolist()))
    n_valid, n_kept = max(s["n_valid"], 1.0), max(s["n_kept"], 1.0)
    mean_w = s["sum_w"] / n_kept
    factor = 1.0
    if cfg.rollout_is_batch_normalize:
        level_mean = mean_w if normalization_level(names) == "token" else s["seq_sum_w"] / max(s["n_seq_kept"], 1.0)
        factor = level_mean if level_mean > 1e-8 else 1.0  # all weights ~0: leave them (verl's guard)
    wmax, neg_min = maxes.tolist()
    metrics = {
        "rollout_corr/is_mean": mean_w,
        "rollout_corr/is_min": -neg_min if neg_min > float("-inf") else 0.0,
        "rollout_corr/is_max": wmax if wmax > float("-inf") else 0.0,
        "rollout_corr/ess": s["sum_w"] ** 2 / (n_kept * s["sum_w2"]) if s["sum_w2"] > 0 else 0.0,
        "rollout_corr/frac_high": s["n_high"] / n_valid,
        "rollout_corr/frac_low": s["n_low"] / n_valid,
        "rollout_corr/zero_weight_frac": s["n_zero"] / n_kept,
        "rollout_corr/rejected_frac": s["n_rejected"] / n_valid,
        "rollout_corr/seq_rejected_frac": s["n_seq_rejected"] / max(s["n_seq_valid"], 1.0),
        "rollout_corr/batch_norm_factor": factor,
        **_mismatch(s["sum_k1"], s["sum_k3"], s["sum_abs"], s["sum_wr"], s["sum_wr2"], s["n_valid"]),
    }
    return CorrectionStats(names=tuple(names), norm_factor=factor, metrics=metrics)


def _mismatch(sum_k1: float, sum_k3: float, sum_abs: float, sum_w: float, sum_w2: float, n: float) -> dict[str, float]:
    """The mismatch metrics from their sums over the valid tokens (``n`` of them; 0 / ESS 1 if none)."""
    ess = sum_w ** 2 / (n * sum_w2) if n > 0 and sum_w2 > 0 else 1.0
    n = max(n, 1.0)
    return {"rollout_corr/log_prob_abs_diff": sum_abs / n, "rollout_corr/kl": sum_k1 / n, "rollout_corr/k3_kl": sum_k3 / n,
            "rollout_corr/behaviour_ess": ess}


def rollout_mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                             log_ratio_clamp: float = 20.0) -> dict[str, float]:
    """The train/inference mismatch of a step: ``rollout_corr/log_prob_abs_diff`` (mean |mu - pi_old|
    log-prob gap), ``rollout_corr/kl`` (k1) and ``rollout_corr/k3_kl`` (k3) estimates of
    KL(mu || pi_old) per token, over the valid tokens of ``(B, T)`` inputs (0 if none), and
    ``rollout_corr/behaviour_ess``: the effective sample size (sum w)^2 / (n sum w^2) of the
    untruncated weights w = pi_old / mu (Kong 1992; Owen 2013, Eq. 9.13), 1 if no valid token.

    Raises:
        ValueError: shapes differ; NaN/Inf at valid tokens.
    """
    mask = as_bool_mask("response_mask", response_mask)
    check_same_shape("old_log_prob", old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=mask)
    check_finite("rollout_log_prob", rollout_log_prob, mask)
    check_finite("old_log_prob", old_log_prob, mask)
    d = torch.where(mask, rollout_log_prob.detach().to(torch.float64) - old_log_prob.detach().to(torch.float64), 0)
    lr = (-d).clamp(-log_ratio_clamp, log_ratio_clamp)
    k3 = torch.where(mask, torch.expm1(lr) - lr, 0)
    w = torch.where(mask, torch.exp(lr), 0)
    return _mismatch(float(d.sum()), float(k3.sum()), float(d.abs().sum()), float(w.sum()), float((w * w).sum()),
                     float(mask.sum()))


def compute_correction_stats(batches: Sequence[tuple[CorrectionInputs, RawCorrection]], cfg: PolicyLossConfig,
                             reduce_fn: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> CorrectionStats:
    """The step's :class:`CorrectionStats` from this rank's micro-batches (``(inputs, raw)``
    pairs), all-reduced with ``reduce_fn(tensor, op)`` (identity if None)."""
    names = parse_rollout_correction(cfg.rollout_correction)
    sums = torch.zeros(NUM_SUMS, dtype=torch.float64)
    maxes = torch.full((2,), float("-inf"), dtype=torch.float64)
    for x, raw in batches:
        s, m = local_sums(x, raw)
        sums, maxes = sums.to(s.device) + s, torch.maximum(maxes.to(m.device), m)
    if reduce_fn is not None:
        sums, maxes = reduce_fn(sums, "sum"), reduce_fn(maxes, "max")
    return finish(names, sums, maxes, cfg)


class CorrectedBatch(NamedTuple):
    """:func:`apply_rollout_correction`'s result: ``response_mask`` bool ``(B, T)`` (rejected
    tokens removed), ``rollout_is_weights`` float64 ``(B, T)`` (normalised; 0 at padding),
    ``metrics`` (the step's :data:`CORRECTION_METRICS`)."""

    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor
    metrics: dict[str, float]


def apply_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    stats: CorrectionStats | None = None,
) -> CorrectedBatch:
    """Apply ``config.rollout_correction`` to one (micro-)batch.

    Args:
        old_log_prob, rollout_log_prob: ``(B, T)`` float log-probs of pi_old and mu.
        advantages: ``(B, T)`` or ``(B,)``. response_mask: ``(B, T)`` bool or 0/1.
        config: :class:`~echotrain.rl.PolicyLossConfig` or dict with ``rollout_correction`` set.
        stats: the step's :class:`CorrectionStats` (``StepStats.correction``); None means this
            batch is the whole step (its own statistics).

    Returns:
        :class:`CorrectedBatch`; pass its mask and weights to the policy loss
        (``compute_policy_loss(..., response_mask, ..., rollout_is_weights=...)``) and its mask
        to any extra term aggregated with the same normalisers.

    Raises:
        ValueError: ``rollout_correction`` is none; ``rollout_log_prob`` missing; bad tensors;
            ``stats`` of another chain.
    """
    cfg = as_policy_loss_config(config)
    names = parse_rollout_correction(cfg.rollout_correction)
    if not names:
        raise ValueError("apply_rollout_correction needs config.rollout_correction (it is none)")
    x = correction_inputs(old_log_prob, rollout_log_prob, advantages, response_mask, cfg)
    raw = raw_correction(names, x, cfg)
    if stats is None:
        stats = compute_correction_stats([(x, raw)], cfg)
    elif stats.names != names:
        raise ValueError(f"stats were computed for rollout_correction={','.join(stats.names)!r}, not {cfg.rollout_correction!r}")
    return CorrectedBatch(raw.keep, raw.weights / stats.norm_factor, dict(stats.metrics))
