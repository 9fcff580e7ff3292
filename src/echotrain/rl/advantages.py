"""Outcome-reward advantages: one scalar reward r_i per response, grouped by prompt.

docs/design/objectives.md §1. :func:`compute_advantages` returns ``(B,)`` float32 for the
sequence-level estimators (broadcast to tokens with ``advantages[:, None] * response_mask``, or
pass ``(B,)`` to the policy losses directly); :func:`compute_token_advantages` returns the
``(B, T)`` advantages of every estimator, token-level ones included (verl's
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and ``gdpo`` whiten over the batch's
valid tokens). The estimators carry verl 0.9.1's ``adv_estimator`` names and semantics; where
they differ from verl (groups of one, ties in ``grpo_passk``) objectives.md §1 lists it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from echotrain.registry import Registry
from echotrain.rl.validation import check_choice, check_finite, check_group_index, check_tensor


@dataclass(frozen=True)
class GroupedRewards:
    """What an advantage estimator reads: one step's rewards and their prompt groups.

    ``rewards`` ``(B,)`` float64; ``ids`` ``(B,)`` dense group ids in ``[0, num_groups)``;
    ``count`` ``(num_groups,)`` float64 responses per group; ``centred`` ``(B,)`` float64
    r_i - mean_g r; ``eps`` the std guard (> 0). ``response_mask`` ``(B, T)`` float64 (None
    where the caller gave none: only sequence-level estimators run then); ``reward_baselines``
    ``(B,)`` float64 (ReMax's greedy-rollout reward, None unless given); ``gamma`` the discount
    of ``reinforce_plus_plus``; ``norm_adv_by_std_in_grpo`` verl's switch of the group std;
    ``old_log_prob`` ``(B, T)`` float64 log pi(y_t) and ``sum_pi_squared`` ``(B, T)`` float64
    sum over the vocabulary of pi(v)^2 at each position (the optimal-token-baseline estimators'
    policy statistics; None unless given).
    """

    rewards: torch.Tensor
    ids: torch.Tensor
    num_groups: int
    count: torch.Tensor
    centred: torch.Tensor
    eps: float
    response_mask: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    old_log_prob: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


AdvEstimatorFn = Callable[[GroupedRewards], torch.Tensor]
#: ``adv_estimator`` name -> ``fn(GroupedRewards) -> (B,) or (B, T) float64`` advantages; the
#: registration's info: ``token_level`` (returns ``(B, T)``, needs ``response_mask``),
#: ``zero_flat_groups`` (a zero-variance group's responses are set to exactly 0 afterwards),
#: ``needs_baseline`` (reads ``reward_baselines``), ``group_baseline`` (a group of one response
#: has advantage 0, so ``num_generations=1`` trains nothing), ``needs_pi_stats`` (reads
#: ``old_log_prob`` and ``sum_pi_squared``: the trainer computes them in a no-grad pass first).
ADV_ESTIMATOR_REGISTRY: Registry[AdvEstimatorFn] = Registry("advantage estimator", "adv_estimator")
#: The registered advantage estimator names (a live view of :data:`ADV_ESTIMATOR_REGISTRY`).
ADV_METHODS = ADV_ESTIMATOR_REGISTRY.names()
#: The estimators that need ``reward_baselines`` (ReMax): the trainer rolls out one greedy
#: response per prompt for them (a live view).
ADV_NEEDS_BASELINE = ADV_ESTIMATOR_REGISTRY.names(lambda info: info.get("needs_baseline", False))
#: The estimators that read the policy's ``old_log_prob`` and ``sum_pi_squared`` (the optimal token
#: baselines): the trainer computes both before the advantages (a live view).
ADV_NEEDS_PI_STATS = ADV_ESTIMATOR_REGISTRY.names(lambda info: info.get("needs_pi_stats", False))


def register_adv_estimator(name: str, *, token_level: bool = False, zero_flat_groups: bool = True,
                           needs_baseline: bool = False, needs_pi_stats: bool = False,
                           group_baseline: bool = True) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register ``fn(GroupedRewards) -> advantages`` under ``name``.

    Args:
        token_level: ``fn`` returns ``(B, T)`` float64 (reads ``g.response_mask``); else ``(B,)``.
        zero_flat_groups: after ``fn``, every response of a zero-variance group (all rewards
            equal, incl. a group of one) gets exactly 0 (no rounding residue). False for
            estimators whose output is not group-relative (batch whitening, ReMax's baseline).
        needs_baseline: ``fn`` reads ``g.reward_baselines`` ``(B,)`` (callers must pass them).
        needs_pi_stats: ``fn`` reads ``g.old_log_prob`` and ``g.sum_pi_squared`` ``(B, T)`` (callers
            must pass them; implies ``token_level``).
        group_baseline: the baseline comes from the response's own group, so a group of one
            has advantage 0 (the trainer then refuses ``num_generations=1``).

    The result is cast to float32 by the callers, so an estimator need not.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return ADV_ESTIMATOR_REGISTRY.register(name, token_level=token_level or needs_pi_stats,
                                           zero_flat_groups=zero_flat_groups, needs_baseline=needs_baseline,
                                           needs_pi_stats=needs_pi_stats, group_baseline=group_baseline)


def _dense_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    check_tensor("rewards", rewards, 1)
    check_group_index("group_index", group_index, rewards.shape[0])
    check_finite("rewards", rewards)
    ids = torch.unique(group_index, return_inverse=True)[1]
    return ids, int(ids.max()) + 1 if ids.numel() else 0


def _group_sum(values: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


def zero_variance_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Flag responses whose prompt group has all-equal rewards (DAPO dynamic sampling).

    Compares the group's min and max exactly (no tolerance, no variance residue), so a group of
    one response is flagged too. Key it on the raw correctness reward, not a shaped one
    (DAPO, arXiv 2503.14476, Eq. 11: keep groups with 0 < #correct < G).

    Args:
        rewards: ``(B,)`` float (or int/bool) rewards.
        group_index: ``(B,)`` int prompt ids (any integers).

    Returns:
        ``(B,)`` bool, True for every response of a zero-variance group.

    Raises:
        TypeError / ValueError: non-tensors, wrong shapes, non-integer ids, NaN/Inf rewards.
    """
    r = rewards.to(torch.float64) if not rewards.dtype.is_floating_point else rewards
    ids, n = _dense_groups(r, group_index)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    hi = torch.full((n,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, ids, r, "amax")
    lo = torch.full((n,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, ids, r, "amin")
    return (hi == lo)[ids]


def _grouped(rewards: torch.Tensor, group_index: torch.Tensor, adv_estimator: str, eps: float,
             response_mask: torch.Tensor | None, reward_baselines: torch.Tensor | None, gamma: float,
             norm_adv_by_std_in_grpo: bool, old_log_prob: torch.Tensor | None = None,
             sum_pi_squared: torch.Tensor | None = None) -> GroupedRewards | None:
    """Checked inputs as a :class:`GroupedRewards` (None for an empty batch)."""
    check_choice("adv_estimator", adv_estimator, ADV_METHODS)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = rewards.to(torch.float64)
    ids, n = _dense_groups(r, group_index)
    mask = None
    if response_mask is not None:
        check_tensor("response_mask", response_mask, 2)
        if response_mask.shape[0] != r.shape[0]:
            raise ValueError(f"response_mask has {response_mask.shape[0]} rows but rewards has {r.shape[0]}")
        mask = response_mask.to(torch.float64)
    base = None
    if ADV_ESTIMATOR_REGISTRY.info(adv_estimator)["needs_baseline"]:
        if reward_baselines is None:
            raise ValueError(f"adv_estimator={adv_estimator!r} needs reward_baselines (the reward of one greedy "
                             "rollout per prompt, repeated over its group)")
        check_tensor("reward_baselines", reward_baselines, 1)
        if reward_baselines.shape != r.shape:
            raise ValueError(f"reward_baselines has shape {tuple(reward_baselines.shape)}, rewards {tuple(r.shape)}")
        check_finite("reward_baselines", reward_baselines)
        base = reward_baselines.to(torch.float64)
    stats = (None, None)
    if ADV_ESTIMATOR_REGISTRY.info(adv_estimator).get("needs_pi_stats", False):
        stats = tuple(_pi_stat(name, t, mask, adv_estimator) for name, t in
                      (("old_log_prob", old_log_prob), ("sum_pi_squared", sum_pi_squared)))
    if n == 0:
        return None
    count = _group_sum(torch.ones_like(r), ids, n)
    mean = _group_sum(r, ids, n) / count
    return GroupedRewards(r, ids, n, count, r - mean[ids], eps, mask, base, float(gamma), bool(norm_adv_by_std_in_grpo),
                          *stats)


def _pi_stat(name: str, t: torch.Tensor | None, mask: torch.Tensor | None, adv_estimator: str) -> torch.Tensor:
    """A checked ``(B, T)`` float64 policy statistic of the optimal-token-baseline estimators."""
    if t is None:
        raise ValueError(f"adv_estimator={adv_estimator!r} needs {name} (B, T): the policy's log-probs of the "
                         "sampled tokens and the sum of squared vocabulary probabilities per token")
    check_tensor(name, t, 2)
    if mask is not None and t.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, response_mask {tuple(mask.shape)}")
    t = t.to(torch.float64)
    check_finite(name, torch.where(mask > 0, t, 0.0) if mask is not None else t)
    return t


def _zero_flat(adv: torch.Tensor, adv_estimator: str, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    if not ADV_ESTIMATOR_REGISTRY.info(adv_estimator)["zero_flat_groups"]:
        return adv
    flat = zero_variance_groups(rewards.to(torch.float64), group_index)
    return torch.where(flat.view(-1, *([1] * (adv.dim() - 1))), 0.0, adv)


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    adv_estimator: str = "grpo",
    eps: float = 1e-6,
    *,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> torch.Tensor:
    """Outcome advantages ``(B,)`` float32 of a sequence-level estimator (one per response).

    - ``grpo`` (DeepSeekMath, arXiv 2402.03300 §4.1.2): A_i = (r_i - mean_g r) / (std_g r + eps),
      std the unbiased (n - 1) sample std within the group, as verl and TRL compute it
      (``norm_adv_by_std_in_grpo=False``: r_i - mean_g r, verl's switch). ``grpo_vectorized``:
      the same numbers under verl's other name.
    - ``grpo_no_std`` (Dr. GRPO, arXiv 2503.20783 Eq. 3): A_i = r_i - mean_g r.
    - ``batch_std`` (group mean, batch std; "Lite PPO", arXiv 2508.08221): A_i = (r_i - mean_g r)
      / (std over the whole batch of r + eps).
    - ``rloo`` / ``rloo_vectorized`` (Ahmadian et al., arXiv 2402.14740): A_i = r_i - mean of the
      group's other rewards = n / (n - 1) (r_i - mean_g r).
    - ``opo`` (arXiv 2505.23585): A_i = r_i - sum_g(L_j r_j) / sum_g L_j, the length-weighted
      group baseline (L_j: valid tokens of response j; needs ``response_mask``, so
      :func:`compute_token_advantages` only).
    - ``grpo_passk`` (arXiv 2503.19595): only the group's best response gets an advantage,
      (r_max - r_second) / (std_g r + eps) (no std with ``norm_adv_by_std_in_grpo=False``);
      ties: the first best response in batch order.
    - ``gpg`` (arXiv 2504.02546): A_i = alpha (r_i - mean_g r), alpha = B / #(r != 0) over the
      batch (1 if every reward is 0).
    - ``remax`` (Li et al., arXiv 2310.10505): A_i = r_i - b_i, b_i the reward of a greedy
      rollout of the same prompt (``reward_baselines``).
    Token-level estimators (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gdpo``,
    ``opo``) need the response mask: :func:`compute_token_advantages`.

    Every response of a zero-variance group (all rewards equal, incl. a group of one) gets
    A = 0 exactly for the group-relative estimators; the mean and variance are computed in two
    passes in float64.

    Args:
        rewards: ``(B,)`` rewards (any real dtype).
        group_index: ``(B,)`` int prompt ids (any integers; responses of one prompt share one).
        adv_estimator: one of :data:`ADV_METHODS` (the trainer's ``adv_estimator`` key).
        eps: added to the std (> 0).
        reward_baselines: ``(B,)`` ReMax baselines (only ``remax`` reads them).
        gamma: discount of ``reinforce_plus_plus`` in [0, 1] (unused here).
        norm_adv_by_std_in_grpo: divide by the group std in ``grpo`` / ``grpo_passk`` / ``gdpo``.

    Raises:
        ValueError: unknown estimator (lists the valid ones), a token-level estimator, NaN/Inf
            rewards or baselines, shape mismatch, eps <= 0, missing ``reward_baselines``.
        TypeError: non-tensor inputs or non-integer ``group_index``.
    """
    check_choice("adv_estimator", adv_estimator, ADV_METHODS)
    if ADV_ESTIMATOR_REGISTRY.info(adv_estimator)["token_level"]:
        raise ValueError(f"adv_estimator={adv_estimator!r} gives token-level advantages: use "
                         "compute_token_advantages(rewards, group_index, response_mask, ...)")
    g = _grouped(rewards, group_index, adv_estimator, eps, None, reward_baselines, gamma, norm_adv_by_std_in_grpo)
    if g is None:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    adv = _zero_flat(ADV_ESTIMATOR_REGISTRY[adv_estimator](g), adv_estimator, g.rewards, group_index)
    return adv.to(torch.float32)


def compute_token_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    adv_estimator: str = "grpo",
    eps: float = 1e-6,
    *,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    old_log_prob: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of every token ``(B, T)`` float32 and one figure per response ``(B,)`` float32.

    A sequence-level estimator's ``(B,)`` advantages are broadcast: ``A[:, None] * response_mask``
    (and returned as the per-response figure). The token-level ones (verl 0.9.1's semantics):

    - ``reinforce_plus_plus`` (REINFORCE++, arXiv 2501.03262): the outcome reward sits on the
      response's last valid token; G_t = sum over the valid tokens s >= t of gamma^(#valid tokens
      in (t, s]) r_s (tokens with mask 0 carry the return unchanged), then whitened over the
      batch's valid tokens: (G - mean) / sqrt(var + 1e-8), var unbiased over the valid tokens.
      No groups: a flat group keeps its whitened value.
    - ``reinforce_plus_plus_baseline``: r_i - mean_g r on every valid token, whitened the same way.
    - ``gdpo`` (arXiv 2601.05242) with one reward dimension (echotrain's rewards are scalar):
      ``grpo``'s advantage on every valid token, whitened the same way.
    - ``opo``: see :func:`compute_advantages`.
    - ``optimal_token_baseline`` (OTB, verl 0.9.1): a baseline per token position t of each group,
      B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + 1e-8), with G_it the reward-to-go (the outcome
      reward on every position up to the last valid token), W_it = sum_{j <= t} m_ij (1 - 2 pi_ij +
      sum_v pi_ij(v)^2) the cumulative path-variance proxy (``old_log_prob``, ``sum_pi_squared``);
      A = (G - B) m. Positions are the tensor's columns. A group of one has B = 0 (A = the reward,
      as verl); when one response is strictly the group's longest, its B is 0 from the second
      longest's valid-token count on (verl's ``handle_zero_tail``). Flat groups are not zeroed.
    - ``tir_optimal_token_baseline`` (verl's multi-turn OTB): the same with each response's valid
      tokens compacted (the k-th valid token of every response shares a baseline, so the
      environment's holes do not misalign turns); empty responses take no part and get 0.

    The per-response figure of a token-level estimator is its mean over the valid tokens (0 for an
    empty response); it feeds the metrics only.

    Args:
        rewards, group_index, adv_estimator, eps, reward_baselines, gamma,
            norm_adv_by_std_in_grpo: as :func:`compute_advantages`.
        response_mask: ``(B, T)`` 0/1 (any real or bool dtype) valid-token mask; holes allowed.
        old_log_prob, sum_pi_squared: ``(B, T)`` log pi of the sampled tokens and sum_v pi(v)^2 at each
            position (only the optimal-token-baseline estimators read them; NaN/Inf refused on valid
            tokens).

    Raises:
        ValueError / TypeError: as :func:`compute_advantages`, a ``response_mask`` that is not
            ``(B, T)``, and missing, mis-shaped or non-finite ``old_log_prob`` / ``sum_pi_squared``
            for an estimator that reads them.
    """
    g = _grouped(rewards, group_index, adv_estimator, eps, response_mask, reward_baselines, gamma,
                 norm_adv_by_std_in_grpo, old_log_prob, sum_pi_squared)
    if g is None:
        z = torch.zeros(0, dtype=torch.float32, device=rewards.device)
        return torch.zeros(response_mask.shape, dtype=torch.float32, device=rewards.device), z
    adv = _zero_flat(ADV_ESTIMATOR_REGISTRY[adv_estimator](g), adv_estimator, g.rewards, group_index)
    if adv.dim() == 1:
        seq = adv.to(torch.float32)
        return (seq.unsqueeze(-1) * response_mask).to(torch.float32), seq
    tok = (adv * g.response_mask).to(torch.float32)
    n = g.response_mask.sum(-1)
    seq = torch.where(n > 0, (adv * g.response_mask).sum(-1) / n.clamp(min=1), 0.0).to(torch.float32)
    return tok, seq


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the valid entries, times ``mask``.

    The mean and the unbiased variance (n / (n - 1)) run over the entries with ``mask == 1``
    (verl's ``masked_whiten``); fewer than 2 valid entries give 0 (verl raises there).

    Args:
        values, mask: ``(B, T)`` float64.

    Returns:
        ``(B, T)`` float64, 0 where ``mask`` is 0.
    """
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / n
    var = ((values - mean) ** 2 * mask).sum() / n * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


def _need_mask(g: GroupedRewards, name: str) -> torch.Tensor:
    if g.response_mask is None:  # pragma: no cover - compute_advantages refuses token-level ones first
        raise ValueError(f"adv_estimator={name!r} needs response_mask")
    return g.response_mask


def _group_std(g: GroupedRewards) -> torch.Tensor:
    """``(num_groups,)`` unbiased group std of the rewards (0 for a group of one)."""
    var = _group_sum(g.centred**2, g.ids, g.num_groups) / (g.count - 1).clamp(min=1)
    return var.sqrt()


@register_adv_estimator("grpo")
def _grpo(g: GroupedRewards) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), unbiased (n - 1) group std (DeepSeekMath §4.1.2);
    r_i - mean_g r with ``norm_adv_by_std_in_grpo=False``."""
    if not g.norm_adv_by_std_in_grpo:
        return g.centred
    return g.centred / (_group_std(g)[g.ids] + g.eps)


register_adv_estimator("grpo_vectorized")(_grpo)


@register_adv_estimator("grpo_no_std")
def _grpo_no_std(g: GroupedRewards) -> torch.Tensor:
    """A_i = r_i - mean_g r (Dr. GRPO, arXiv 2503.20783 Eq. 3)."""
    return g.centred


@register_adv_estimator("batch_std")
def _batch_std(g: GroupedRewards) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std of the whole batch's r + eps) (arXiv 2508.08221)."""
    r = g.rewards
    batch_std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return g.centred / (batch_std + g.eps)


@register_adv_estimator("rloo")
def _rloo(g: GroupedRewards) -> torch.Tensor:
    """A_i = r_i - mean of the other responses' rewards = n / (n - 1) (r_i - mean_g r) (RLOO,
    arXiv 2402.14740); a group of one: 0."""
    n = g.count[g.ids]
    return g.centred * n / (n - 1).clamp(min=1)


register_adv_estimator("rloo_vectorized")(_rloo)


@register_adv_estimator("opo", token_level=True)
def _opo(g: GroupedRewards) -> torch.Tensor:
    """A_i = r_i - sum_g(L_j r_j) / sum_g(L_j), L_j the valid tokens of response j (OPO,
    arXiv 2505.23585); a group with no valid token: baseline 0. Constant over a response."""
    length = _need_mask(g, "opo").sum(-1)
    num = _group_sum(length * g.rewards, g.ids, g.num_groups)
    den = _group_sum(length, g.ids, g.num_groups)
    base = torch.where(den > 0, num / den.clamp(min=1), 0.0)
    return (g.rewards - base[g.ids]).unsqueeze(-1).expand_as(g.response_mask)


@register_adv_estimator("grpo_passk")
def _grpo_passk(g: GroupedRewards) -> torch.Tensor:
    """Pass@k advantage (arXiv 2503.19595): the group's best response gets (r_max - r_second)
    / (std_g r + eps) (no std with ``norm_adv_by_std_in_grpo=False``), every other response 0;
    ties: the first best response in batch order; a group of one: 0."""
    r, ids, n = g.rewards, g.ids, g.num_groups
    hi = torch.full((n,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, ids, r, "amax")
    pos = torch.arange(len(r), device=r.device)
    first = torch.full((n,), len(r), dtype=torch.long, device=r.device).scatter_reduce(
        0, ids, torch.where(r == hi[ids], pos, len(r)), "amin")
    is_best = pos == first[ids]
    second = torch.full((n,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(
        0, ids, torch.where(is_best, -torch.inf, r), "amax")
    gap = torch.where(torch.isfinite(second), hi - second, 0.0)
    if g.norm_adv_by_std_in_grpo:
        gap = gap / (_group_std(g) + g.eps)
    return torch.where(is_best, gap[ids], 0.0)


@register_adv_estimator("gpg")
def _gpg(g: GroupedRewards) -> torch.Tensor:
    """A_i = alpha (r_i - mean_g r), alpha = B / max(#(r != 0), 1) over the batch (GPG,
    arXiv 2504.02546, verl's f_norm = 1)."""
    alpha = len(g.rewards) / max(int((g.rewards != 0).sum()), 1)
    return alpha * g.centred


@register_adv_estimator("remax", needs_baseline=True, zero_flat_groups=False, group_baseline=False)
def _remax(g: GroupedRewards) -> torch.Tensor:
    """A_i = r_i - b_i, b_i the greedy rollout's reward for the same prompt (ReMax, arXiv 2310.10505)."""
    return g.rewards - g.reward_baselines


@register_adv_estimator("reinforce_plus_plus", token_level=True, zero_flat_groups=False, group_baseline=False)
def _reinforce_pp(g: GroupedRewards) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): discounted return of the outcome reward (on the last valid
    token; masked tokens carry it), whitened over the batch's valid tokens."""
    mask = _need_mask(g, "reinforce_plus_plus")
    after = mask.flip(-1).cumsum(-1).flip(-1) - mask  # valid tokens after t
    returns = g.rewards.unsqueeze(-1) * torch.pow(torch.full_like(after, g.gamma), after) * mask
    return masked_whiten(returns, mask)


@register_adv_estimator("reinforce_plus_plus_baseline", token_level=True, zero_flat_groups=False)
def _reinforce_pp_baseline(g: GroupedRewards) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): r_i - mean_g r on every valid token, whitened over
    the batch's valid tokens (a group of one: 0 before whitening)."""
    mask = _need_mask(g, "reinforce_plus_plus_baseline")
    return masked_whiten(g.centred.unsqueeze(-1) * mask, mask)


@register_adv_estimator("gdpo", token_level=True, zero_flat_groups=False)
def _gdpo(g: GroupedRewards) -> torch.Tensor:
    """GDPO (arXiv 2601.05242) with one reward dimension: ``grpo``'s advantage (zero-variance groups
    0) on every valid token, whitened over the batch's valid tokens."""
    mask = _need_mask(g, "gdpo")
    flat = zero_variance_groups(g.rewards, g.ids)
    a = torch.where(flat, 0.0, _grpo(g))
    return masked_whiten(a.unsqueeze(-1) * mask, mask)


#: verl's epsilon of the optimal token baseline's denominator
OTB_EPS = 1e-8


def _otb_inputs(g: GroupedRewards, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, G, W) ``(B, T)`` float64: the valid-token mask, the reward-to-go (the outcome reward
    on every position up to the last valid token) and the cumulative path-variance proxy
    W_t = sum_{j <= t} m_j (1 - 2 pi_j + sum_v pi_j(v)^2)."""
    mask = _need_mask(g, name)
    last = mask.flip(-1).cumsum(-1).flip(-1) > 0  # at or before the last valid token
    returns = g.rewards.unsqueeze(-1) * last
    w = 1.0 - 2.0 * g.old_log_prob.exp() + g.sum_pi_squared
    return mask, returns, (torch.where(mask > 0, w, 0.0) * mask).cumsum(-1)


def _otb_baselines(returns: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor,
                   num_groups: int, lengths: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Per-group position-wise baselines ``(B, T)``: sum_i G W m / (sum_i W m + eps) over the
    group's ``members`` (bool ``(B,)``), 0 for a group of one member, and 0 from the second longest
    member's length on for a strictly longest member."""
    base = torch.zeros_like(returns)
    for grp in range(num_groups):
        rows = torch.nonzero((ids == grp) & members).flatten()
        if rows.numel() < 2:
            continue
        num = (returns[rows] * w[rows] * mask[rows]).sum(0)
        den = (w[rows] * mask[rows]).sum(0) + OTB_EPS
        base[rows] = (num / den).unsqueeze(0)
        ls = lengths[rows]
        second, top = torch.sort(ls).values[-2:].tolist()
        longest = torch.nonzero(ls == top).flatten()
        if longest.numel() == 1 and top > second:
            base[rows[longest[0]], int(second):] = 0.0
    return base


@register_adv_estimator("optimal_token_baseline", needs_pi_stats=True, zero_flat_groups=False, group_baseline=False)
def _otb(g: GroupedRewards) -> torch.Tensor:
    """Optimal token baseline (verl 0.9.1's ``optimal_token_baseline``): A_t = G_t - B_t with a
    per-position group baseline weighted by the cumulative path variance (see
    :func:`compute_token_advantages`)."""
    mask, returns, w = _otb_inputs(g, "optimal_token_baseline")
    lengths = mask.sum(-1)
    base = _otb_baselines(returns, w, mask, g.ids, g.num_groups, lengths, torch.ones_like(lengths, dtype=torch.bool))
    return (returns - base) * mask


@register_adv_estimator("tir_optimal_token_baseline", needs_pi_stats=True, zero_flat_groups=False,
                        group_baseline=False)
def _tir_otb(g: GroupedRewards) -> torch.Tensor:
    """verl's multi-turn optimal token baseline: :func:`_otb` over each response's valid tokens
    compacted to the front (the k-th model token of every response shares a baseline), then
    scattered back to their columns; empty responses get 0."""
    mask, returns, w = _otb_inputs(g, "tir_optimal_token_baseline")
    valid = mask > 0
    lengths = valid.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    k = valid.cumsum(-1) - 1  # the rank of each valid token within its response
    rows, cols = torch.nonzero(valid, as_tuple=True)
    packed_mask = torch.zeros(mask.shape[0], width, dtype=mask.dtype)
    packed_mask[rows, k[rows, cols]] = 1.0
    packed_ret, packed_w = torch.zeros_like(packed_mask), torch.zeros_like(packed_mask)
    packed_ret[rows, k[rows, cols]] = returns[rows, cols]
    packed_w[rows, k[rows, cols]] = w[rows, cols]
    base = _otb_baselines(packed_ret, packed_w, packed_mask, g.ids, g.num_groups, lengths.to(mask.dtype), lengths > 0)
    adv = torch.zeros_like(returns)
    adv[rows, cols] = (packed_ret - base)[rows, k[rows, cols]]
    return adv * mask
