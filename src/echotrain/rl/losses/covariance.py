"""Clip-Cov and KL-Cov: act on the few tokens with the largest advantage / log-prob covariance.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv 2505.22617, §4, Eq. 10-12; verl ``clip_cov`` / ``kl_cov``): the policy entropy falls in
proportion to the covariance between a token's log-prob and its advantage, so a small share of
high-covariance tokens is kept from driving the collapse. Per valid token

    Cov_{i,t} = (A_{i,t} - mean A) (log pi(o_{i,t}) - mean log pi),

the means over the step's valid tokens, log pi the current policy (detached).

- ``clip_cov``: among the tokens with ``clip_cov_lb < Cov < clip_cov_ub`` whose PPO clip is not
  already active, n = max(1, int(``clip_cov_ratio`` N)) are drawn at random and their gradient is
  detached (loss 0); the others get the PPO clip loss (clip_ratio_low/high).
- ``kl_cov``: the k = max(1, int(``kl_cov_ratio`` N)) tokens of largest Cov get the penalty
  ``ppo_kl_coef`` |log rho|; every token gets the unclipped -rho A.

Exactness (ours). verl computes the means, N and the selection over whatever one call sees (a
micro-batch). Here they are the *step's*, declared as step statistics (:data:`COV_STEP_STATS`):
the no-grad pre-pass ``log_prob`` gives the step's means (one all-reduce of two sums), and the
selection is a threshold on a per-token key found by an exact bisection over the float64 bit
patterns of the keys (about 64 all-reduce rounds of one count each): KL-Cov's key is Cov itself
(the k-th largest Cov of the step; ties at the threshold are all selected), Clip-Cov's is a
deterministic pseudo-random hash of the token's ``old_log_prob`` bits and position (its n
smallest among the candidates), in place of verl's ``torch.randperm``. The draw has verl's
distribution (a uniform subset of n candidates) but is a function of the data, so one big batch
and any micro-batch split select the same tokens and the accumulated gradient is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from echotrain.metrics import declare_metric
from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import PolicyLossConfig, check_finite_float, check_fraction, check_non_negative, loss_setting
from echotrain.rl.losses.common import ppo_kl, token_share
from echotrain.rl.objectives import PreparedInputs, clip_metrics, prepared_policy_loss, register_policy_loss
from echotrain.rl.step import LossStepStats, ReduceFn, StepBatch, StepStats
from echotrain.rl.surrogate import clamped_log_ratio, ppo_clip_loss

_I64_MAX = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / phi, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


@dataclass(frozen=True)
class CovStats:
    """The step statistics of ``clip_cov`` / ``kl_cov`` (``step.loss_stats``).

    ``mean_adv``, ``mean_log_prob``: means over the step's valid tokens; ``threshold``: the value
    at or above which a token is selected (KL-Cov: a Cov value; Clip-Cov: an int64 key, minus the
    hash), None when no token is; ``num_selected``: tokens selected over the step (ties included).
    """

    mean_adv: float
    mean_log_prob: float
    threshold: float | int | None
    num_selected: float


def ordered_key(v: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the float64 values ``v`` are (IEEE bit patterns, negatives flipped)."""
    bits = v.to(torch.float64).view(torch.int64)
    return torch.where(bits < 0, bits ^ _I64_MAX, bits)


def key_value(key: int) -> float:
    """The float64 value whose :func:`ordered_key` is ``key`` (inverse of ordered_key)."""
    bits = key ^ _I64_MAX if key < 0 else key
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64))


def _shift_right(h: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 ``h`` by ``n`` bits (torch's ``>>`` is arithmetic)."""
    return (h >> n) & ((1 << (64 - n)) - 1)


def token_hash(old_log_prob: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A deterministic pseudo-random int64 key in [0, 2^62) per token (splitmix64 finaliser) of the
    float64 bits of its ``old_log_prob`` and its position t (same shapes): Clip-Cov's random draw,
    made a function of the data so that every micro-batch split draws the same tokens."""
    h = old_log_prob.detach().to(torch.float64).view(torch.int64) ^ (position.to(torch.int64) * _GOLDEN)
    h = (h ^ _shift_right(h, 30)) * _MIX1
    h = (h ^ _shift_right(h, 27)) * _MIX2
    h = h ^ _shift_right(h, 31)
    return _shift_right(h, 2)


def kth_largest_key(keys: list[torch.Tensor], k: int, reduce_fn: ReduceFn,
                    device: torch.device | None = None) -> int | None:
    """The k-th largest of the int64 ``keys`` of every micro-batch and rank (None if there are none;
    the smallest if fewer than k exist, so that all are selected).

    Exact: each rank keeps its own k largest (the step's k largest are among them), then a
    bisection over the int64 range with one all-reduced count per round (64 rounds). ``device``:
    where the all-reduced counts live when this rank has no micro-batch (default: the keys').
    """
    local = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64, device=device)
    if local.numel() > k:
        local = torch.topk(local, k).values
    f64 = dict(dtype=torch.float64, device=local.device)
    n = float(reduce_fn(torch.tensor([float(local.numel())], **f64), "sum"))
    if n == 0:
        return None
    k = min(k, int(n))
    lo, hi = -(1 << 63), (1 << 63) - 1  # invariant: count(key >= lo) >= k > count(key >= hi + 1)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if float(reduce_fn(torch.tensor([float((local >= mid).sum())], **f64), "sum")) >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def kth_largest_local(keys: torch.Tensor, k: int) -> int | None:
    """:func:`kth_largest_key` of one tensor on one process (no all-reduce): ``torch.topk``."""
    if keys.numel() == 0:
        return None
    return int(torch.topk(keys, min(k, keys.numel())).values[-1])


def _covariance(adv: torch.Tensor, log_prob: torch.Tensor, mean_adv: float, mean_lp: float) -> torch.Tensor:
    """Cov_{i,t} = (A - mean A)(log pi - mean log pi), ``(B, T)`` in the inputs' dtype (detached)."""
    return (adv.detach() - mean_adv) * (log_prob.detach() - mean_lp)


def _ppo_clip_active(ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """verl's ``clip_by_origin``: the PPO clip of the token is active (bool ``(B, T)``), the same
    comparison as :func:`~echotrain.rl.surrogate.ppo_clip_loss`'s flags."""
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return l2 > l1


def _clip_cov_candidates(cov: torch.Tensor, mask: torch.Tensor, clip_active: torch.Tensor, old_log_prob: torch.Tensor,
                         cfg: PolicyLossConfig) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Clip-Cov's candidates (indices ``(rows, cols)``) and their keys (minus the hash, 1-d int64)."""
    idx = torch.nonzero(mask & ~clip_active & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub), as_tuple=True)
    return idx, -token_hash(old_log_prob.detach()[idx], idx[1])


def _local_keys(mb: StepBatch, cfg: PolicyLossConfig, mode: str, mean_adv: float, mean_lp: float) -> torch.Tensor:
    """One micro-batch's selection keys (1-d int64): ordered Cov of every valid token (kl_cov) or
    minus the hash of every candidate (clip_cov)."""
    mask = mb.response_mask
    cov = _covariance(mb.advantages, mb.log_prob, mean_adv, mean_lp)
    if mode == "kl_cov":
        return ordered_key(cov[mask])
    ratio = torch.exp(clamped_log_ratio(mb.log_prob, mb.old_log_prob, cfg.log_ratio_clamp, mask))
    return _clip_cov_candidates(cov, mask, _ppo_clip_active(ratio, mb.advantages, cfg), mb.old_log_prob, cfg)[1]


def _local_sums(mb: StepBatch, cfg: PolicyLossConfig) -> torch.Tensor:
    """[sum A, sum log pi] (float64) over one micro-batch's valid tokens (pre-pass log pi)."""
    mask = mb.response_mask
    adv = torch.where(mask, mb.advantages.detach(), 0).sum(dtype=torch.float64)
    lp = torch.where(mask, mb.log_prob.detach(), 0).sum(dtype=torch.float64)
    return torch.stack([adv, lp])


def _finish(mode: str):
    def finish(sums: torch.Tensor, mbs: list[StepBatch], step: StepStats, reduce_fn: ReduceFn) -> CovStats:
        cfg = step.config
        n = max(step.num_tokens, 1.0)
        mean_adv, mean_lp = float(sums[0]) / n, float(sums[1]) / n
        share = cfg.kl_cov_ratio if mode == "kl_cov" else cfg.clip_cov_ratio
        keys = [_local_keys(mb, cfg, mode, mean_adv, mean_lp) for mb in mbs]
        key = kth_largest_key(keys, max(1, int(step.num_tokens * share)), reduce_fn, sums.device)
        count = 0.0 if key is None else float(sum(int((kk >= key).sum()) for kk in keys))
        selected = float(reduce_fn(torch.tensor([count], dtype=torch.float64, device=sums.device), "sum"))
        threshold = key if key is None or mode == "clip_cov" else key_value(key)
        return CovStats(mean_adv, mean_lp, threshold, selected)

    return finish


def _step_stats(x: PreparedInputs, mode: str) -> CovStats | None:
    """The step's statistics (``x.step.loss_stats``), or None when the call is the whole step.

    Raises:
        ValueError: ``x.step`` carries no :class:`CovStats`.
    """
    if x.step is None:
        return None
    stats = x.step.loss_stats
    if not isinstance(stats, CovStats):
        raise ValueError(f"step has no {mode} statistics: compute_step_stats(..., loss_mode={mode!r}) is required")
    return stats


def _own_means(x: PreparedInputs) -> tuple[float, float]:
    """(mean A, mean log pi) over this call's valid tokens (the call is the whole step)."""
    sums = _local_sums(StepBatch(x.old_log_prob, x.log_prob, x.advantages, x.mask, None), x.cfg)
    n = max(float(x.mask.sum()), 1.0)
    return float(sums[0]) / n, float(sums[1]) / n


def _share_count(x: PreparedInputs, share: float) -> int:
    return max(1, int(float(x.mask.sum()) * share))


#: the metric Clip-Cov and KL-Cov add to the clip metrics
COV_METRICS = (
    declare_metric("pg_covfrac", reduce="token_mean", unit="fraction of tokens", when="loss_mode=clip_cov or kl_cov",
                   help="clip_cov: share of valid tokens whose gradient is detached; kl_cov: share given the "
                        "|log rho| penalty"),
)

#: Clip-Cov's and KL-Cov's declaration of their step statistics: the pre-pass, two sums, the threshold.
CLIP_COV_STEP_STATS = LossStepStats(needs_log_prob=True, num_sums=2, local_sums=_local_sums, finish=_finish("clip_cov"))
KL_COV_STEP_STATS = LossStepStats(needs_log_prob=True, num_sums=2, local_sums=_local_sums, finish=_finish("kl_cov"))


def clip_cov_band_problem(values: object) -> str | None:
    """Clip-Cov's band must be an interval: clip_cov_lb < clip_cov_ub (``values``: any object with
    the two settings as attributes), else the problem."""
    lb, ub = getattr(values, "clip_cov_lb", None), getattr(values, "clip_cov_ub", None)
    if check_finite_float(lb) is None and check_finite_float(ub) is None and not lb < ub:
        return f"clip_cov_lb={lb!r} must be < clip_cov_ub={ub!r}"
    return None


#: Clip-Cov's settings (flat keys, verl's names: actor.policy_loss.clip_cov_*); their band rule is
#: :func:`clip_cov_band_problem`, registered with the loss
CLIP_COV_SETTINGS = {
    "clip_cov_ratio": loss_setting(
        2e-4, "Clip-Cov (Cui et al., arXiv 2505.22617): share r of the step's valid tokens whose gradient is "
        "detached, drawn among those with clip_cov_lb < Cov < clip_cov_ub. verl default 2e-4.",
        check_fraction, flat=True),
    "clip_cov_lb": loss_setting(
        1.0, "Clip-Cov: lower bound of the covariance band of candidate tokens (verl default 1.0).",
        check_finite_float, flat=True),
    "clip_cov_ub": loss_setting(
        5.0, "Clip-Cov: upper bound of the covariance band (> clip_cov_lb; verl default 5.0).",
        check_finite_float, flat=True),
}
#: KL-Cov's settings (flat keys, verl's names: actor.policy_loss.kl_cov_ratio / ppo_kl_coef)
KL_COV_SETTINGS = {
    "kl_cov_ratio": loss_setting(
        2e-4, "KL-Cov (Cui et al., arXiv 2505.22617): share k of the step's valid tokens with the largest "
        "covariance Cov = (A - mean A)(log pi - mean log pi) that get the KL penalty. verl default 2e-4.",
        check_fraction, flat=True),
    "ppo_kl_coef": loss_setting(
        0.1, "KL-Cov: coefficient of the |log rho| penalty on the selected tokens (verl default 0.1).",
        check_non_negative, flat=True),
}


@register_policy_loss("clip_cov", settings=CLIP_COV_SETTINGS, settings_check=clip_cov_band_problem, metrics=("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "pg_clipfrac_lower", "pg_covfrac", "ppo_kl"), step_stats=CLIP_COV_STEP_STATS,
                      reads=("clip_ratio_low", "clip_ratio_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
@prepared_policy_loss("token-mean")
def compute_policy_loss_clip_cov(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (arXiv 2505.22617, Eq. 11; verl ``clip_cov``): PPO clip, plus the gradient of a few
    high-covariance tokens detached.

    l_{i,t} = (1 - D_{i,t}) max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A), D = 1 on the
    drawn tokens (module docstring). Default ``loss_agg_mode`` ``token-mean``. Metrics: the PPO
    clip shares (``pg_clipfrac`` ...; verl reports the drawn share under ``pg_clipfrac``),
    ``pg_covfrac`` (drawn share), ``ppo_kl``. With ``step``, the means and the draw are the
    step's (:data:`CLIP_COV_STEP_STATS`, which needs the no-grad pre-pass ``log_prob``). Inputs
    ``(B, T)`` as :func:`~echotrain.rl.compute_policy_loss` (verl's signature); returns
    ``(loss 0-d, metrics)``; same errors, and ``ValueError`` for a ``step`` without its statistics.
    """
    stats = _step_stats(x, "clip_cov")
    mean_adv, mean_lp = (stats.mean_adv, stats.mean_log_prob) if stats is not None else _own_means(x)
    loss_mat, flags = ppo_clip_loss(torch.exp(x.log_ratio), x.advantages, x.cfg.clip_ratio_low, x.cfg.clip_ratio_high)
    cov = _covariance(x.advantages, x.log_prob, mean_adv, mean_lp)
    idx, keys = _clip_cov_candidates(cov, x.mask, flags["high"] | flags["low"], x.old_log_prob, x.cfg)
    threshold = stats.threshold if stats is not None else kth_largest_local(keys, _share_count(x, x.cfg.clip_cov_ratio))
    keep, num_drawn = x.mask, 0
    if threshold is not None:
        sel = keys >= threshold
        keep = x.mask.clone()
        keep[idx[0][sel], idx[1][sel]] = False  # the drawn tokens: no value, no gradient
        num_drawn = int(sel.sum())
    metrics = clip_metrics(flags, x.log_ratio, x.mask)
    metrics["pg_covfrac"] = num_drawn / max(int(x.mask.sum()), 1)
    return weighted_sum(loss_mat, keep, x.seq_weights), metrics


@register_policy_loss("kl_cov", metrics=("pg_covfrac", "ppo_kl"), step_stats=KL_COV_STEP_STATS, reads=("kl_cov_ratio", "ppo_kl_coef"),
                      settings=KL_COV_SETTINGS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_kl_cov(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (arXiv 2505.22617, Eq. 12; verl ``kl_cov``): unclipped -rho A, plus ``ppo_kl_coef`` |log rho|
    on the top-k covariance tokens.

    l_{i,t} = -rho A + S_{i,t} beta |log rho|, S = 1 on the k tokens of largest Cov (module
    docstring), beta = ``ppo_kl_coef``. No ratio clip (as verl). Default ``loss_agg_mode``
    ``token-mean``. Metrics: ``pg_covfrac`` (selected share), ``ppo_kl`` (mean -log rho; verl's
    ``kl_cov`` reports mean |log rho| under that name). With ``step``, the means and the top-k
    are the step's (:data:`KL_COV_STEP_STATS`, pre-pass ``log_prob``). Shapes, signature and
    errors as :func:`compute_policy_loss_clip_cov`.
    """
    stats = _step_stats(x, "kl_cov")
    mean_adv, mean_lp = (stats.mean_adv, stats.mean_log_prob) if stats is not None else _own_means(x)
    lr = x.log_ratio
    loss = weighted_sum(-x.advantages * torch.exp(lr), x.mask, x.seq_weights)
    cov = _covariance(x.advantages, x.log_prob, mean_adv, mean_lp)
    if stats is not None:
        threshold = stats.threshold
    else:
        key = kth_largest_local(ordered_key(cov[x.mask]), _share_count(x, x.cfg.kl_cov_ratio))
        threshold = None if key is None else key_value(key)
    num_chosen = 0
    if threshold is not None:  # the threshold is one of the inputs' Cov values, exact in their dtype
        rows, cols = torch.nonzero(x.mask & (cov >= threshold), as_tuple=True)
        penalty = x.cfg.ppo_kl_coef * lr[rows, cols].abs()  # only the k chosen tokens: a sparse term
        w = x.seq_weights  # (B,) per sequence, or (B, T) per token with a rollout correction
        w = w[rows, cols] if w.dim() == 2 else w[rows]
        loss = loss + (w.to(lr.dtype) * penalty).sum()
        num_chosen = int(rows.numel())
    metrics = {"pg_covfrac": num_chosen / max(int(x.mask.sum()), 1), "ppo_kl": ppo_kl(lr, x.mask)}
    return loss, metrics
