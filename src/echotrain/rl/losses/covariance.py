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

from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import PolicyLossConfig
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

    ``mean_adv``, ``mean_log_prob``: means over the step's valid tokens; ``threshold``: the int64
    key at or above which a token is selected (None: no token); ``num_selected``: tokens selected
    over the step (ties included).
    """

    mean_adv: float
    mean_log_prob: float
    threshold: int | None
    num_selected: float


def ordered_key(v: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the float64 values ``v`` are (IEEE bit patterns, negatives flipped)."""
    bits = v.to(torch.float64).view(torch.int64)
    return torch.where(bits < 0, bits ^ _I64_MAX, bits)


def _shift_right(h: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 ``h`` by ``n`` bits (torch's ``>>`` is arithmetic)."""
    return (h >> n) & ((1 << (64 - n)) - 1)


def token_hash(old_log_prob: torch.Tensor) -> torch.Tensor:
    """A deterministic pseudo-random int64 key in [0, 2^62) per token ``(B, T)`` (splitmix64 finaliser)
    of the float64 bits of ``old_log_prob`` and the position t: Clip-Cov's random draw, made a
    function of the data so that every micro-batch split draws the same tokens."""
    t = torch.arange(old_log_prob.shape[-1], device=old_log_prob.device, dtype=torch.int64)
    h = old_log_prob.detach().to(torch.float64).view(torch.int64) ^ (t * _GOLDEN)
    h = (h ^ _shift_right(h, 30)) * _MIX1
    h = (h ^ _shift_right(h, 27)) * _MIX2
    h = h ^ _shift_right(h, 31)
    return _shift_right(h, 2)


def kth_largest_key(keys: list[torch.Tensor], k: int, reduce_fn: ReduceFn, values: list[torch.Tensor]) -> int | None:
    """The k-th largest of the int64 ``keys`` of every micro-batch and rank (None if there are none).

    ``values`` are the float64 values the keys order (their global min / max bound the search).
    Exact: a bisection over the int64 keys with one all-reduced count per round (<= 64 rounds).
    If fewer than k keys exist, the smallest (all are selected).
    """
    f64 = dict(dtype=torch.float64, device=keys[0].device if keys else None)
    n = float(reduce_fn(torch.tensor([float(sum(int(kk.numel()) for kk in keys))], **f64), "sum"))
    if n == 0:
        return None
    nonempty = [v for v in values if v.numel()]
    hi_v = max((float(v.max()) for v in nonempty), default=float("-inf"))
    lo_v = min((float(v.min()) for v in nonempty), default=float("inf"))
    ext = reduce_fn(torch.tensor([hi_v, -lo_v], **f64), "max")
    lo = int(ordered_key(-ext[1:2]).item())
    hi = int(ordered_key(ext[0:1]).item())
    k = min(k, int(n))
    while lo < hi:  # invariant: count(key >= lo) >= k; count(key >= hi + 1) < k
        mid = lo + (hi - lo + 1) // 2
        count = float(reduce_fn(torch.tensor([float(sum(int((kk >= mid).sum()) for kk in keys))], **f64), "sum"))
        if count >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _covariance(adv: torch.Tensor, log_prob: torch.Tensor, mean_adv: float, mean_lp: float) -> torch.Tensor:
    """Cov_{i,t} = (A - mean A)(log pi - mean log pi), float64 ``(B, T)`` (detached)."""
    return (adv.detach().to(torch.float64) - mean_adv) * (log_prob.detach().to(torch.float64) - mean_lp)


def _ppo_clip_active(ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """verl's ``clip_by_origin``: the PPO clip of the token is active (bool ``(B, T)``)."""
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return l2 > l1


def _candidate_keys(mb: StepBatch, cfg: PolicyLossConfig, mode: str, mean_adv: float,
                    mean_lp: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keys, values) 1-d of one micro-batch's candidate tokens: the ordered keys of Cov and Cov
    itself for kl_cov; -hash and None for clip_cov."""
    mask = mb.response_mask
    cov = _covariance(mb.advantages, mb.log_prob, mean_adv, mean_lp)
    if mode == "kl_cov":
        return ordered_key(cov[mask]), cov[mask]
    ratio = torch.exp(clamped_log_ratio(mb.log_prob, mb.old_log_prob, cfg.log_ratio_clamp, mask))
    cand = mask & ~_ppo_clip_active(ratio, mb.advantages, cfg) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    return -token_hash(mb.old_log_prob)[cand], None


def _local_sums(mb: StepBatch, cfg: PolicyLossConfig) -> torch.Tensor:
    """[sum A, sum log pi] (float64) over one micro-batch's valid tokens (pre-pass log pi)."""
    mask = mb.response_mask
    adv = torch.where(mask, mb.advantages.to(torch.float64).expand_as(mask), 0)
    lp = torch.where(mask, mb.log_prob.detach().to(torch.float64), 0)
    return torch.stack([adv.sum(), lp.sum()])


def _finish(mode: str):
    def finish(sums: torch.Tensor, mbs: list[StepBatch], step: StepStats, reduce_fn: ReduceFn) -> CovStats:
        cfg = step.config
        n = max(step.num_tokens, 1.0)
        mean_adv, mean_lp = float(sums[0]) / n, float(sums[1]) / n
        ratio = cfg.kl_cov_ratio if mode == "kl_cov" else cfg.clip_cov_ratio
        k = max(1, int(step.num_tokens * ratio))
        parts = [_candidate_keys(mb, cfg, mode, mean_adv, mean_lp) for mb in mbs]
        keys = [p[0] for p in parts]
        if mode == "clip_cov":
            threshold = _kth_int(keys, k, reduce_fn)
        else:
            threshold = kth_largest_key(keys, k, reduce_fn, [p[1] for p in parts])
        count = 0.0 if threshold is None else float(sum(int((kk >= threshold).sum()) for kk in keys))
        f64 = dict(dtype=torch.float64, device=sums.device)
        selected = float(reduce_fn(torch.tensor([count], **f64), "sum"))
        return CovStats(mean_adv, mean_lp, threshold, selected)

    return finish


def _kth_int(keys: list[torch.Tensor], k: int, reduce_fn: ReduceFn) -> int | None:
    """The k-th largest of int64 ``keys`` in (-2^62, 0] over micro-batches and ranks (None if none)."""
    device = keys[0].device if keys else None
    f64 = dict(dtype=torch.float64, device=device)
    n = float(reduce_fn(torch.tensor([float(sum(int(kk.numel()) for kk in keys))], **f64), "sum"))
    if n == 0:
        return None
    lo, hi, k = -(1 << 62), 0, min(k, int(n))
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = float(reduce_fn(torch.tensor([float(sum(int((kk >= mid).sum()) for kk in keys))], **f64), "sum"))
        if count >= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _stats(x: PreparedInputs, mode: str) -> CovStats:
    """The step statistics: the step's (``x.step``) or, without one, this input's as the whole step."""
    if x.step is not None:
        stats = x.step.loss_stats
        if not isinstance(stats, CovStats):
            raise ValueError(f"step has no {mode} statistics: compute_step_stats(..., loss_mode={mode!r}) is required")
        return stats
    mb = StepBatch(x.old_log_prob.detach(), x.log_prob.detach(), x.advantages.detach(), x.mask, None)
    n = float(x.mask.sum())
    step = StepStats(loss_mode=mode, loss_agg_mode="token-mean", num_tokens=n, num_seqs=0.0, dp_size=1, config=x.cfg)
    return _finish(mode)(_local_sums(mb, x.cfg), [mb], step, lambda t, op: t)


def _selected(x: PreparedInputs, mode: str, stats: CovStats) -> torch.Tensor:
    """bool ``(B, T)``: the tokens the step's threshold selects in this call."""
    if stats.threshold is None:
        return torch.zeros_like(x.mask)
    mb = StepBatch(x.old_log_prob, x.log_prob.detach(), x.advantages, x.mask, None)
    mask = x.mask
    cov = _covariance(mb.advantages, mb.log_prob, stats.mean_adv, stats.mean_log_prob)
    if mode == "kl_cov":
        return mask & (ordered_key(cov) >= stats.threshold)
    ratio = torch.exp(x.log_ratio.detach())
    cand = mask & ~_ppo_clip_active(ratio, x.advantages, x.cfg) & (cov > x.cfg.clip_cov_lb) & (cov < x.cfg.clip_cov_ub)
    return cand & (-token_hash(x.old_log_prob) >= stats.threshold)


#: Clip-Cov's and KL-Cov's declaration of their step statistics: the pre-pass, two sums, the threshold.
CLIP_COV_STEP_STATS = LossStepStats(needs_log_prob=True, num_sums=2, local_sums=_local_sums, finish=_finish("clip_cov"))
KL_COV_STEP_STATS = LossStepStats(needs_log_prob=True, num_sums=2, local_sums=_local_sums, finish=_finish("kl_cov"))


@register_policy_loss("clip_cov", step_stats=CLIP_COV_STEP_STATS,
                      settings=("clip_ratio_low", "clip_ratio_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
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
    stats = _stats(x, "clip_cov")
    drawn = _selected(x, "clip_cov", stats)
    loss_mat, flags = ppo_clip_loss(torch.exp(x.log_ratio), x.advantages, x.cfg.clip_ratio_low, x.cfg.clip_ratio_high)
    loss_mat = torch.where(drawn, 0.0, loss_mat)
    metrics = clip_metrics(flags, x.log_ratio, x.mask)
    metrics["pg_covfrac"] = token_share(drawn, x.mask)
    return weighted_sum(loss_mat, x.mask, x.seq_weights), metrics


@register_policy_loss("kl_cov", step_stats=KL_COV_STEP_STATS, settings=("kl_cov_ratio", "ppo_kl_coef"))
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
    stats = _stats(x, "kl_cov")
    chosen = _selected(x, "kl_cov", stats)
    lr = x.log_ratio
    loss_mat = -x.advantages * torch.exp(lr) + torch.where(chosen, x.cfg.ppo_kl_coef * lr.abs(), 0.0)
    metrics = {"pg_covfrac": token_share(chosen, x.mask), "ppo_kl": ppo_kl(lr, x.mask)}
    return weighted_sum(loss_mat, x.mask, x.seq_weights), metrics
