"""Advantages, KL estimators, DAPO shaping and presets, with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.rl import (
    PRESETS,
    compute_advantages,
    compute_policy_loss,
    get_preset,
    kl_penalty,
    overlong_reward_penalty,
    truncated_response_mask,
    zero_variance_groups,
)

# ---------------------------------------------------------------- advantages


def test_grpo_hand_values_on_interleaved_groups():
    # groups interleaved on purpose: the per-group axis must follow group_index, not position
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    gid = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    # group 0: [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3); group 1: [0, 1, 1, 0] same stats
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, -a, a, a, -a])
    torch.testing.assert_close(compute_advantages(rewards, gid), expected)
    assert compute_advantages(rewards, gid).dtype == torch.float32
    torch.testing.assert_close(compute_advantages(rewards, gid, "grpo_no_std"), expected * (0.5 / a))


def test_grpo_per_group_not_per_batch():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    gid = torch.tensor([5, 5, 5, 9, 9, 9])
    adv = compute_advantages(rewards, gid, eps=1e-12)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 1.0]))  # unbiased std 1 and 10


def test_all_equal_rewards_give_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 3.0], dtype=torch.float64)  # 0.1*3/3 != 0.1 in fp
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])  # group 2 has one response
    for method in ("grpo", "grpo_no_std", "batch_std"):
        adv = compute_advantages(rewards, gid, method)
        assert torch.equal(adv, torch.zeros(8)), method
    assert zero_variance_groups(rewards, gid).all()


def test_batch_std_scales_group_centred_rewards_by_batch_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1])
    std = float(rewards.std())
    torch.testing.assert_close(compute_advantages(rewards, gid, "batch_std"), torch.tensor([0.5, -0.5, 0, 0]) / (std + 1e-6))


def test_zero_variance_flags_and_errors():
    rewards = torch.tensor([1, 1, 0, 1, 0, 0])
    gid = torch.tensor([0, 0, 1, 1, 2, 2])
    assert zero_variance_groups(rewards, gid).tolist() == [True, True, False, False, True, True]
    with pytest.raises(ValueError,
                       match=r"adv_estimator='loo' is unknown; valid: \['batch_std', 'gdpo', 'gpg', 'grpo', "):
        compute_advantages(rewards.float(), gid, "loo")
    with pytest.raises(ValueError, match="rewards has 1 NaN/Inf"):
        compute_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_index has shape"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))


# ---------------------------------------------------------------- KL


def test_kl_hand_values_and_gradients():
    lp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-0.5])  # x = ref - lp = 0.5
    x = 0.5
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-x)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(x * x / 2)
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.item() == pytest.approx(math.exp(x) - x - 1)
    k3.backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(x))  # (1 - pi_ref / pi)


@pytest.mark.parametrize("x", [-100.0, 100.0])
def test_k3_finite_value_and_gradient_for_extreme_log_ratio_fp32(x):
    lp = torch.tensor([0.0, -1.0], dtype=torch.float32, requires_grad=True)
    ref = lp.detach() + torch.tensor([x, 0.3])
    k3 = kl_penalty(lp, ref, "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(lp.grad).all()
    assert k3[0].item() == pytest.approx(math.exp(max(min(x, 20), -20)) - max(min(x, 20), -20) - 1, rel=1e-6)
    assert lp.grad[1].item() == pytest.approx(1 - math.exp(0.3), rel=1e-6)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_non_finite_padding_gets_zero_gradient(est, garbage):
    """k2 used to send 0 * inf = NaN back to a NaN/Inf log-prob at padding (then into the logits)."""
    from echotrain.rl import agg_loss

    lp = torch.tensor([[-1.0, garbage]], requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0]])
    loss = agg_loss(kl_penalty(lp, ref, est), torch.tensor([[1, 0]]), "token-mean")
    loss.backward()
    expected = {"k1": 1.0, "k2": -0.5, "k3": 1 - math.exp(0.5)}[est]  # d/dlp at x = 0.5
    assert lp.grad[0, 0].item() == pytest.approx(expected) and lp.grad[0, 1].item() == 0.0


def test_kl_errors():
    with pytest.raises(ValueError, match=r"kl_penalty='k4' is unknown; valid: \['k1', 'k2', 'k3'\]"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="ref_log_prob has shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3))


# ---------------------------------------------------------------- DAPO shaping


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([0, 10, 16, 17, 19, 20, 21, 500])
    out = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_len=4)
    torch.testing.assert_close(out, torch.tensor([0, 0, 0, -0.25, -0.75, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="overlong_buffer_len must be in"):
        overlong_reward_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match="response_length must be >= 0"):  # NaN gave a NaN reward
        overlong_reward_penalty(torch.tensor([3.0, float("nan")]), 20, 4)


def test_truncated_responses_are_masked_out():
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = truncated_response_mask(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4, 0, 4]


# ---------------------------------------------------------------- presets


def test_presets_bundle_the_papers_settings():
    assert {"grpo", "dapo", "dr_grpo", "gspo", "echo", "cispo", "sapo", "gmpo"} <= set(PRESETS)  # the papers' recipes
    dapo = get_preset("dapo")
    assert (dapo.adv_estimator, dapo.loss_mode, dapo.loss_agg_mode) == ("grpo", "vanilla", "token-mean")
    assert (dapo.config.clip_ratio_low, dapo.config.clip_ratio_high) == (0.2, 0.28) and dapo.dynamic_sampling
    assert get_preset("dr_grpo").adv_estimator == "grpo_no_std"
    assert get_preset("gspo").config.clip_ratio_high == 4e-4
    assert get_preset("echo").loss_mode == "echo"
    with pytest.raises(ValueError, match="preset='ppo' is unknown"):
        get_preset("ppo")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs(name):
    p = get_preset(name, norm_constant=8) if name == "dr_grpo" else get_preset(name)
    old = torch.zeros(4, 8) - 1
    lp = (old + 0.01).requires_grad_(True)
    adv = compute_advantages(torch.tensor([1.0, 0, 1, 0]), torch.tensor([0, 0, 1, 1]), p.adv_estimator)
    loss, m = compute_policy_loss(p.loss_mode, old, lp, adv, torch.ones(4, 8), p.loss_agg_mode, p.config)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and "ppo_kl" in m


def test_grpo_eps_is_added_to_the_std_outside_the_square_root():
    # rewards [0, 1]: mean 0.5, centred +-0.5, unbiased std sqrt(((0.5)^2 + (0.5)^2) / (2 - 1)) = sqrt(0.5).
    # eps = 0.5 large enough for its placement to matter:
    #   (r - mean) / (std + eps)        = +-0.5 / (0.70711 + 0.5) = +-(sqrt(2) - 1) = +-0.41421  (ours)
    #   (r - mean) / sqrt(var + eps)    = +-0.5 / sqrt(1.0)       = +-0.5
    #   population std (n): 0.5 / (0.5 + 0.5)                    = +-0.5
    adv = compute_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), "grpo", eps=0.5)
    expected = 0.5 / (math.sqrt(0.5) + 0.5)
    assert expected == pytest.approx(math.sqrt(2) - 1, rel=1e-15)
    torch.testing.assert_close(adv, torch.tensor([-expected, expected]), rtol=1e-6, atol=0)
    # three responses [0, 0, 1]: mean 1/3, unbiased std sqrt((2 (1/3)^2 + (2/3)^2) / 2) = sqrt(1/3)
    adv3 = compute_advantages(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), "grpo", eps=0.5)
    s = math.sqrt(1 / 3) + 0.5
    torch.testing.assert_close(adv3, torch.tensor([-1 / 3 / s, -1 / 3 / s, 2 / 3 / s]), rtol=1e-6, atol=0)
