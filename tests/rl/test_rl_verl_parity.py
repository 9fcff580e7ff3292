"""Side by side with verl's own core_algos (same loss value, same gradient).

verl is an optional test dependency: ``pip install --no-deps verl==0.9.1`` plus the packages of
requirements-extras.txt. Without it these tests skip with the import error as the reason.
"""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.integrations.verl import verl_core_algos

try:
    verl_algos = verl_core_algos()
except ImportError as exc:  # the message names the cause and how to install verl
    pytest.skip(f"verl parity tests: {exc}", allow_module_level=True)
from verl.workers.config import ActorConfig  # noqa: E402  (verl imports: checked above)

from echotrain.rl import agg_loss, compute_policy_loss, compute_step_stats, kl_penalty, split_micro_batches

VERL_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
C = 11.0  # seq-mean-token-sum-norm constant (verl: global_batch_info["loss_scale_factor"])
# verl divides seq-mean-token-mean by (length + 1e-8): a relative difference of up to 1e-8.
TOL = dict(rtol=1e-7, atol=1e-12)


def _actor_config(low, high, clip_ratio_c=3.0, **batch_info):
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=clip_ratio_c, global_batch_info={"loss_scale_factor": C, **batch_info},
    )


def _random(seed, B=16, T=9, drift=0.0, noise=0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)  # verl's float masks
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    log_prob = old + drift + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, log_prob, adv, mask


def _ours_and_verl(loss_mode, verl_fn, agg, cfg_ours, cfg_verl, old, log_prob, adv, mask):
    lp1 = log_prob.clone().requires_grad_(True)
    ours, m_ours = compute_policy_loss(loss_mode, old, lp1, adv, mask, agg, cfg_ours)
    ours.backward()
    lp2 = log_prob.clone().requires_grad_(True)
    ref, m_ref = verl_fn(old, lp2, adv, mask, loss_agg_mode=agg, config=cfg_verl)
    ref.backward()
    return (ours, lp1.grad, m_ours), (ref, lp2.grad, m_ref)


@pytest.mark.parametrize("agg", VERL_AGGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_vanilla_matches_verl(agg, seed):
    old, log_prob, adv, mask = _random(seed, noise=1.0)  # noise 1.0: clip and dual-clip both fire
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_constant=C)
    (ours, g_ours, m_ours), (ref, g_ref, m_ref) = _ours_and_verl(
        "vanilla", verl_algos.compute_policy_loss_vanilla, agg, cfg, _actor_config(0.2, 0.28), old, log_prob, adv, mask
    )
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(g_ours, g_ref, **TOL)
    assert m_ours["pg_clipfrac"] == pytest.approx(m_ref["actor/pg_clipfrac"], abs=1e-8)  # verl masked_mean: + 1e-8
    assert m_ours["pg_clipfrac_lower"] == pytest.approx(m_ref["actor/pg_clipfrac_lower"], abs=1e-8)  # verl masked_mean: + 1e-8
    assert m_ours["ppo_kl"] == pytest.approx(m_ref["actor/ppo_kl"], abs=1e-8)  # verl masked_mean: + 1e-8
    assert 0 < m_ours["pg_clipfrac"] < 1 and m_ours["pg_clipfrac_lower"] > 0  # the comparison is not vacuous


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("loss_mode", ["gspo", "gspo_token"])
def test_gspo_matches_verl(loss_mode, agg):
    old, log_prob, adv, mask = _random(2, drift=0.0, noise=0.05)
    cfg = dict(clip_ratio_low=3e-3, clip_ratio_high=4e-3)  # some sequences clip, some do not
    (ours, g_ours, m_ours), (ref, g_ref, m_ref) = _ours_and_verl(
        loss_mode, verl_algos.compute_policy_loss_gspo, agg, cfg, _actor_config(3e-3, 4e-3), old, log_prob, adv, mask
    )
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(g_ours, g_ref, **TOL)
    assert m_ours["pg_clipfrac"] == pytest.approx(m_ref["actor/pg_clipfrac"], abs=1e-8)  # verl masked_mean: + 1e-8
    assert 0 < m_ours["pg_clipfrac"] < 1


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_agg_loss_matches_verl_including_empty_rows(agg):
    g = torch.Generator().manual_seed(4)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([5, 0, 2, 1, 0, 4])[:, None]).to(torch.float64)
    ours = agg_loss(loss_mat, mask, agg, norm_constant=C)
    ref = verl_algos.agg_loss(loss_mat, mask, agg, loss_scale_factor=C)
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_global_normalisers_match_verls_global_batch_info(agg):
    """Micro-batches with the step's counts: ours (step stats) == verl (batch_num_tokens / global_batch_size)."""
    old, log_prob, adv, mask = _random(5, noise=0.3)
    batch = {"old_log_prob": old, "log_prob": log_prob, "advantages": adv, "response_mask": mask}
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_constant=C)
    mbs = split_micro_batches(batch, [5, 0, 7, 4])
    step = compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode=agg, config=cfg)
    info = {"batch_num_tokens": step.num_tokens, "global_batch_size": step.num_seqs, "dp_size": 1}
    vcfg = _actor_config(0.2, 0.28, **info)
    for mb in mbs:
        ours, _ = compute_policy_loss("vanilla", mb["old_log_prob"], mb["log_prob"], mb["advantages"],
                                      mb["response_mask"], agg, cfg, step=step)
        ref, _ = verl_algos.compute_policy_loss_vanilla(mb["old_log_prob"], mb["log_prob"], mb["advantages"],
                                                        mb["response_mask"], loss_agg_mode=agg, config=vcfg)
        torch.testing.assert_close(ours, ref.to(ours.dtype), **TOL)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_verl(est):
    g = torch.Generator().manual_seed(6)
    lp = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    ref_lp = lp + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(lp, ref_lp, est), verl_algos.kl_penalty(lp, ref_lp, est))


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gspo_token_matches_verl_with_per_token_advantages(agg):
    """verl's "gspo" is the GSPO-token form: it must agree with ours for any A_{i,t}."""
    old, log_prob, _, mask = _random(3, noise=0.05)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * mask
    cfg = dict(clip_ratio_low=3e-3, clip_ratio_high=4e-3)
    (ours, g_ours, _), (ref, g_ref, _) = _ours_and_verl(
        "gspo_token", verl_algos.compute_policy_loss_gspo, agg, cfg, _actor_config(3e-3, 4e-3), old, log_prob, adv, mask
    )
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(g_ours, g_ref, **TOL)


# ---------------------------------------------------------------- documented differences (design §8)


def test_expected_difference_k3_output_is_not_clipped_at_10():
    """verl clips k3's output to [-10, 10] (zero gradient beyond); ours does not: x = 5 gives
    e^5 - 6 = 142.41 (gradient 1 - e^5 w.r.t. log pi), verl 10 (gradient 0). Below 10 they agree."""
    ref_lp = torch.tensor([[5.0, 1.0]], dtype=torch.float64)
    lp1 = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    lp2 = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ours, theirs = kl_penalty(lp1, ref_lp, "k3"), verl_algos.kl_penalty(lp2, ref_lp, "k3")
    ours.sum().backward()
    theirs.sum().backward()
    assert ours[0, 0].item() == pytest.approx(math.exp(5) - 6, rel=1e-12) and theirs[0, 0].item() == 10.0
    assert lp1.grad[0, 0].item() == pytest.approx(1 - math.exp(5), rel=1e-12) and lp2.grad[0, 0].item() == 0.0
    torch.testing.assert_close(ours[0, 1], theirs[0, 1])  # e - 2 = 0.718 < 10: same
    torch.testing.assert_close(lp1.grad[0, 1], lp2.grad[0, 1])


def test_expected_difference_k2_input_is_clamped_at_20():
    """Ours clamps x = ref - log pi at +-20 before the square (value 200, zero gradient beyond);
    verl does not (x = 30: 450, gradient -30). Inside +-20 they agree."""
    ref_lp = torch.tensor([[30.0, -3.0]], dtype=torch.float64)
    lp1 = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    lp2 = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ours, theirs = kl_penalty(lp1, ref_lp, "k2"), verl_algos.kl_penalty(lp2, ref_lp, "k2")
    ours.sum().backward()
    theirs.sum().backward()
    assert ours[0, 0].item() == 200.0 and theirs[0, 0].item() == 450.0
    assert lp1.grad[0, 0].item() == 0.0 and lp2.grad[0, 0].item() == -30.0
    torch.testing.assert_close(ours[0, 1], theirs[0, 1])
    torch.testing.assert_close(lp1.grad[0, 1], lp2.grad[0, 1])


@pytest.mark.parametrize("loss_mode", ["gspo", "gspo_token"])
def test_expected_difference_gspo_log_ratio_clamp(loss_mode):
    """Ours clamps each token's log-ratio at +-20 before the sequence mean; verl's gspo clamps
    the sequence mean from above at 10 (and not below). One sequence, A = -1, seq-mean-token-mean:

    - tokens [30, 0, 0, 0]: ours e^(20/4) = 148.41, verl e^(30/4) = 1808.04;
    - tokens [12, 12, 12, 12]: ours e^12, verl e^10;
    - tokens [-30, -30, 0, 0] with A = +1: ours -e^-10, verl -e^-15;
    - tokens [2, 1, 0, -1]: both e^0.5 (inside both clamps: identical value and gradient).
    """
    cases = [([30.0, 0, 0, 0], -1.0, math.exp(5), math.exp(7.5)),
             ([12.0] * 4, -1.0, math.exp(12), math.exp(10)),
             ([-30.0, -30.0, 0, 0], 1.0, -math.exp(-10), -math.exp(-15)),
             ([2.0, 1.0, 0.0, -1.0], -1.0, math.exp(0.5), math.exp(0.5))]
    mask = torch.ones(1, 4, dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    for row, a, v_ours, v_verl in cases:
        adv = torch.full((1, 4), a, dtype=torch.float64)
        lp = torch.tensor([row], dtype=torch.float64)
        (ours, g_ours, _), (ref, g_ref, _) = _ours_and_verl(
            loss_mode, verl_algos.compute_policy_loss_gspo, "seq-mean-token-mean", dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
            _actor_config(0.2, 0.28), old, lp, adv, mask)
        # (verl divides seq-mean-token-mean by length + 1e-8: relative 2.5e-9)
        assert ours.item() == pytest.approx(v_ours, rel=1e-12) and ref.item() == pytest.approx(v_verl, rel=1e-7)
        if v_ours == v_verl:
            torch.testing.assert_close(g_ours, g_ref, **TOL)
