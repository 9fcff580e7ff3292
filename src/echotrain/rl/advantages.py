"""Outcome-reward advantages: one scalar reward r_i per response, grouped by prompt.

docs/design/objectives.md §1. All estimators return ``(B,)`` float32; broadcast to tokens with
``advantages[:, None] * response_mask`` (or pass ``(B,)`` to the policy losses directly).
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
    r_i - mean_g r; ``eps`` the std guard (> 0).
    """

    rewards: torch.Tensor
    ids: torch.Tensor
    num_groups: int
    count: torch.Tensor
    centred: torch.Tensor
    eps: float


AdvEstimatorFn = Callable[[GroupedRewards], torch.Tensor]
#: ``adv_estimator`` name -> ``fn(GroupedRewards) -> (B,) float64`` advantages.
ADV_ESTIMATOR_REGISTRY: Registry[AdvEstimatorFn] = Registry("advantage estimator", "adv_estimator")
#: The registered advantage estimator names (a live view of :data:`ADV_ESTIMATOR_REGISTRY`).
ADV_METHODS = ADV_ESTIMATOR_REGISTRY.names()


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register ``fn(GroupedRewards) -> (B,) float64 advantages`` under ``name``.

    :func:`compute_advantages` sets every response of a zero-variance group to exactly 0 after
    the estimator and casts to float32, so an estimator need not handle either.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return ADV_ESTIMATOR_REGISTRY.register(name)


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


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    adv_estimator: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative outcome advantages ``(B,)`` float32.

    - ``grpo`` (DeepSeekMath, arXiv 2402.03300 §4.1.2): A_i = (r_i - mean_g r) / (std_g r + eps),
      std the unbiased (n - 1) sample std within the group, as verl and TRL compute it.
    - ``grpo_no_std`` (Dr. GRPO, arXiv 2503.20783 Eq. 3): A_i = r_i - mean_g r.
    - ``batch_std`` (group mean, batch std; "Lite PPO", arXiv 2508.08221): A_i = (r_i - mean_g r)
      / (std over the whole batch of r + eps).

    Every response of a zero-variance group (all rewards equal, incl. a group of one) gets
    A = 0 exactly; the mean and variance are computed in two passes in float64.

    Args:
        rewards: ``(B,)`` rewards (any real dtype).
        group_index: ``(B,)`` int prompt ids (any integers; responses of one prompt share one).
        adv_estimator: one of :data:`ADV_METHODS` (the trainer's ``adv_estimator`` key).
        eps: added to the std (> 0).

    Raises:
        ValueError: unknown estimator (lists the valid ones), NaN/Inf rewards, shape mismatch,
            eps <= 0.
        TypeError: non-tensor inputs or non-integer ``group_index``.
    """
    check_choice("adv_estimator", adv_estimator, ADV_METHODS)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    r = rewards.to(torch.float64)
    ids, n = _dense_groups(r, group_index)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    count = _group_sum(torch.ones_like(r), ids, n)
    mean = _group_sum(r, ids, n) / count
    adv = ADV_ESTIMATOR_REGISTRY[adv_estimator](GroupedRewards(r, ids, n, count, r - mean[ids], eps))
    adv = torch.where(zero_variance_groups(r, group_index), 0.0, adv)
    return adv.to(torch.float32)


@register_adv_estimator("grpo")
def _grpo(g: GroupedRewards) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), unbiased (n - 1) group std (DeepSeekMath §4.1.2)."""
    var = _group_sum(g.centred**2, g.ids, g.num_groups) / (g.count - 1).clamp(min=1)
    return g.centred / (var.sqrt()[g.ids] + g.eps)


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
