"""Input rules of the advantage estimators (rl/advantages.py) that the value tests do not reach: eps > 0, the
exact zero-variance test, mis-shaped ReMax baselines, NaN in the padding of the policy statistics, empty batches."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import compute_advantages
from echotrain.rl.advantages import compute_token_advantages, zero_variance_groups


def test_eps_must_be_positive():
    r, g = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps must be > 0"):
            compute_advantages(r, g, "grpo", eps=eps)


def test_zero_variance_is_exact_equality():
    """Rewards 1e-10 apart are a group with variance (no tolerance): not flagged, and GRPO gives them advantages."""
    r, g = torch.tensor([0.0, 1e-10, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    assert zero_variance_groups(r, g).tolist() == [False, False, True, True]
    adv = compute_advantages(r, g, "grpo")
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0


@pytest.mark.parametrize("shape", [(5,), (4, 1)])
def test_remax_baselines_of_another_shape_are_refused(shape):
    r, g = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages(r, g, "remax", reward_baselines=torch.zeros(shape))


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_nan_in_the_padding_of_the_policy_statistics_is_ignored(estimator):
    """NaN/Inf where response_mask is 0 (padding, environment tokens) are accepted and change nothing: the
    advantages equal those of the same statistics with zeros there; NaN on a valid token is refused."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    logp = -torch.rand(4, 4, generator=gen)
    s2 = torch.rand(4, 4, generator=gen) * 0.5 + 0.1
    r, g = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 0])
    clean = compute_token_advantages(r, g, mask, estimator, old_log_prob=logp * mask, sum_pi_squared=s2 * mask)
    dirty_logp = torch.where(mask > 0, logp, torch.tensor(float("nan")))
    dirty_s2 = torch.where(mask > 0, s2, torch.tensor(float("inf")))
    got = compute_token_advantages(r, g, mask, estimator, old_log_prob=dirty_logp, sum_pi_squared=dirty_s2)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], clean[1], rtol=0, atol=0)
    bad = logp.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_log_prob"):
        compute_token_advantages(r, g, mask, estimator, old_log_prob=bad, sum_pi_squared=s2)


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_an_empty_batch_keeps_the_masks_width(estimator):
    tok, seq = compute_token_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 7), estimator)
    assert tok.shape == (0, 7) and seq.shape == (0,) and tok.dtype == seq.dtype == torch.float32
