"""echotrain losses registered in verl's registries give echotrain's values and gradients.

verl is an optional test dependency (``pip install --no-deps verl==0.9.1`` plus the packages of
requirements-extras.txt); without it these tests skip with the import error as the reason.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from echotrain.integrations.verl import (
    DUAL_CLIP_LOSSES,
    ADV_ESTIMATORS,
    POLICY_LOSS_NAMES,
    balanced_advantage_scale,
    make_verl_policy_loss,
    register_with_verl,
    verl_core_algos,
)
from echotrain.rl import PolicyLossConfig, compute_advantages, compute_policy_loss

try:
    verl_algos = verl_core_algos()
except ImportError as exc:  # the message names the cause and how to install verl
    pytest.skip(f"verl adapter tests: {exc}", allow_module_level=True)
from verl.workers.config import ActorConfig  # noqa: E402  (verl imports: checked above)

BAND = {"batch_clip_low": 0.01, "batch_clip_high": 0.01}  # narrow: ECHO's batch clip fires below
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register_with_verl(BAND)


def _actor(low=0.2, high=0.28, c=3.0, **info):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low,
                       clip_ratio_high=high, clip_ratio_c=c, global_batch_info=dict(info))


def _batch(seed, B=12, T=7, drift=-0.05, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
    old = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    log_prob = old + drift + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, log_prob, adv, mask


def _value_grad(fn, old, log_prob, adv, mask):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, adv, mask)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_registration_names(registered):
    assert registered == list(POLICY_LOSS_NAMES) + list(ADV_ESTIMATORS)
    for name in POLICY_LOSS_NAMES:
        assert verl_algos.get_policy_loss_fn(name) is verl_algos.POLICY_LOSS_REGISTRY[name]
    assert verl_algos.get_adv_estimator_fn("echotrain_grpo_balanced") is not None
    register_with_verl(BAND)  # idempotent: no "already registered" error


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("verl_name", list(POLICY_LOSS_NAMES))
def test_registered_loss_equals_compute_policy_loss(verl_name, agg):
    """Whole step in one call: same value and gradient as echotrain's compute_policy_loss."""
    loss_mode = POLICY_LOSS_NAMES[verl_name]
    fn = verl_algos.get_policy_loss_fn(verl_name)
    old, log_prob, adv, mask = _batch(1)
    c = 3.0 if loss_mode in DUAL_CLIP_LOSSES else None  # verl's gspo has no dual-clip
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c, **BAND)
    v1, g1, m1 = _value_grad(lambda o, lp, a, m: fn(o, lp, a, m, loss_agg_mode=agg, config=_actor()), old, log_prob,
                             adv, mask)
    v2, g2, m2 = _value_grad(lambda o, lp, a, m: compute_policy_loss(loss_mode, o, lp, a, m, agg, cfg), old,
                             log_prob, adv, mask)
    torch.testing.assert_close(v1, v2, **TOL)
    torch.testing.assert_close(g1, g2, **TOL)
    assert m1 == pytest.approx({f"actor/{k}": v for k, v in m2.items()} | (
        {"actor/echo/R_token_share": 1.0} if loss_mode == "echo" else {}))
    if loss_mode == "echo":
        assert m2["echo/batch_clipped"] == 1.0  # the narrow band fires: the kappa gradient is exercised
        assert m1["actor/echo/R_token_share"] == 1.0


def test_echo_value_matches_hand_formula():
    """echotrain_echo on a 1x2 batch: R = exp(mean log rho) clipped to 1.01, token clip 0.2/0.28."""
    fn = verl_algos.get_policy_loss_fn("echotrain_echo")
    old = torch.zeros(1, 2, dtype=torch.float64)
    log_prob = torch.log(torch.tensor([[1.1, 1.3]], dtype=torch.float64))
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, m = fn(old, log_prob, adv, mask, loss_agg_mode="token-mean", config=_actor())
    R = (1.1 * 1.3) ** 0.5
    kappa = 1.01 / R
    expected = -(min(kappa * 1.1, 1.28) + min(kappa * 1.3, 1.28)) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert m["actor/echo/R_batch"] == pytest.approx(R)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_vanilla_matches_verl_vanilla_with_global_batch_info(agg):
    """Micro-batched with verl's global counts: echotrain_vanilla == verl's vanilla, per micro-batch."""
    old, log_prob, adv, mask = _batch(2)
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0], loss_scale_factor=9)
    ours = verl_algos.get_policy_loss_fn("echotrain_vanilla")
    for rows in (slice(0, 5), slice(5, 12)):
        args = (old[rows], log_prob[rows], adv[rows], mask[rows])
        v1, g1, _ = _value_grad(lambda *a: ours(*a, loss_agg_mode=agg, config=_actor(**info)), *args)
        v2, g2, _ = _value_grad(lambda *a: verl_algos.compute_policy_loss_vanilla(
            *a, loss_agg_mode=agg, config=_actor(**info)), *args)
        torch.testing.assert_close(v1, v2, rtol=1e-7, atol=1e-12)  # verl divides by (len + 1e-8)
        torch.testing.assert_close(g1, g2, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("verl_name", ["echotrain_vanilla", "echotrain_gspo"])
def test_micro_batches_and_ranks_sum_to_the_whole_step(verl_name, agg):
    """Micro-batches (gradients summed) and 2 emulated DP ranks (gradients averaged) give the
    single-call gradient: the rescaling by local / global count * dp_size is exact."""
    fn = verl_algos.get_policy_loss_fn(verl_name)
    old, log_prob, adv, mask = _batch(3)
    _, g_full, _ = _value_grad(lambda *a: fn(*a, loss_agg_mode=agg, config=_actor()), old, log_prob, adv, mask)
    info = dict(batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    for dp_size, shards in ((1, [slice(0, 4), slice(4, 9), slice(9, 12)]), (2, [slice(0, 7), slice(7, 12)])):
        lp = log_prob.clone().requires_grad_(True)
        for rows in shards:
            loss, _ = fn(old[rows], lp[rows], adv[rows], mask[rows], loss_agg_mode=agg,
                         config=_actor(dp_size=dp_size, **info))
            (loss / dp_size).backward()  # DDP averages the ranks' gradients
        torch.testing.assert_close(lp.grad, g_full, **TOL)


def test_echo_micro_batch_R_is_local_and_flagged():
    """ECHO through verl sees one micro-batch: R is the micro-batch's, and the token-share metric says so."""
    fn = verl_algos.get_policy_loss_fn("echotrain_echo")
    old, log_prob, adv, mask = _batch(4)
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    _, m = fn(old[:5], log_prob[:5], adv[:5], mask[:5], loss_agg_mode="token-mean", config=_actor(**info))
    log_ratio = (log_prob[:5] - old[:5])[mask[:5].bool()]
    assert m["actor/echo/R_batch"] == pytest.approx(float(log_ratio.mean().exp()))
    assert m["actor/echo/R_token_share"] == pytest.approx(float(mask[:5].sum() / mask.sum()))


def test_balanced_via_advantage_scaling_equals_balanced_aggregation():
    """verl route to BA: echotrain_grpo_balanced advantages + seq-mean-token-sum == echotrain's
    compute_policy_loss(..., 'balanced') on the unscaled advantages (value and gradient)."""
    G, n_groups, T = 4, 3, 6
    g = torch.Generator().manual_seed(5)
    B = G * n_groups
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0], dtype=torch.float64)  # group 1: zero variance
    uids = np.array([f"prompt-{i // G}" for i in range(B)], dtype=object)
    group_index = torch.arange(B) // G
    old = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    log_prob = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)

    est = verl_algos.get_adv_estimator_fn("echotrain_grpo_balanced")
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    token_rewards[torch.arange(B), lengths - 1] = rewards
    scaled, returns = est(token_level_rewards=token_rewards, response_mask=mask, index=uids, config=None)
    assert scaled.shape == (B, T) and torch.equal(scaled, returns)

    adv = compute_advantages(rewards.float(), group_index).double()
    adv_tok = adv[:, None] * mask
    loss_fn = verl_algos.get_policy_loss_fn("echotrain_vanilla")
    v1, g1, _ = _value_grad(lambda o, lp, a, m: loss_fn(o, lp, a, m, loss_agg_mode="seq-mean-token-sum",
                                                         config=_actor()), old, log_prob, scaled.double(), mask)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    v2, g2, _ = _value_grad(lambda o, lp, a, m: compute_policy_loss("vanilla", o, lp, a, m, "balanced", cfg,
                                                                     group_index=group_index),
                            old, log_prob, adv_tok, mask)
    torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-9)  # advantages pass through float32
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-9)


def test_balanced_scale_hand_values():
    """One group of 4: lengths 1, 3, 2, 2; advantage signs +, +, -, 0. k=2, m=1, G=4, T+=4, T-=2:
    weights k/(G T+) = 1/8 and m/(G T-) = 1/8 per token, s = N w = 4/8 for +/- and 0 for A=0."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 0.5, -1.0, 0.0])
    s = balanced_advantage_scale(adv, mask, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(s, torch.tensor([0.5, 0.5, 0.5, 0.0]))


def test_errors_are_clear():
    fn = verl_algos.get_policy_loss_fn("echotrain_vanilla")
    old, log_prob, adv, mask = _batch(6)
    with pytest.raises(ValueError, match="balanced"):
        fn(old, log_prob, adv, mask, loss_agg_mode="balanced", config=_actor())
    with pytest.raises(ValueError, match="token-max"):
        fn(old, log_prob, adv, mask, loss_agg_mode="token-max", config=_actor())
    with pytest.raises(ValueError, match="loss_scale_factor"):
        fn(old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", config=_actor())
    with pytest.raises(ValueError, match="rollout_correction='token_is': in verl the correction is verl's own"):
        make_verl_policy_loss("vanilla", {"rollout_correction": "token_is"})
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fn(old, log_prob, adv, mask, loss_agg_mode="token-mean", config=_actor(dp_size=2))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        fn(old, log_prob, adv, mask, config=_actor(c=0.5))
    with pytest.raises(ValueError, match="valid"):
        make_verl_policy_loss("ppo")


def test_plugin_module_registers_in_a_fresh_verl_process():
    """The documented route for Ray workers: VERL_USE_EXTERNAL_MODULES imports our plugin on `import verl`."""
    import os
    import subprocess
    import sys

    code = ("import verl.trainer.ppo.core_algos as c; "
            "print(sorted(k for k in c.POLICY_LOSS_REGISTRY if k.startswith('echotrain')), "
            "'echotrain_grpo_balanced' in c.ADV_ESTIMATOR_REGISTRY)")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="echotrain.integrations.verl_plugin", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(sorted(POLICY_LOSS_NAMES)) + " True"


# ---------------------------------------------------------------- issue 9 case 11: verl's own losses vs ours


def test_plugin_gspo_has_no_dual_clip_like_verls_gspo():
    """Old log-probs -2, new 0, A = -1, 4 tokens, token-mean: s = e^2 > clip_ratio_c = 3, but verl's
    gspo has no dual-clip: loss e^2 = 7.389, gradient e^2 / 4 = 1.847 per token, clipfrac_lower 0."""
    old = torch.full((1, 4), -2.0, dtype=torch.float64)
    log_prob = torch.zeros(1, 4, dtype=torch.float64)
    adv = -torch.ones(1, 4, dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    call = lambda f: _value_grad(lambda *a: f(*a, loss_agg_mode="token-mean", config=_actor()),  # noqa: E731
                                 old, log_prob, adv, mask)
    v_ref, g_ref, _ = call(verl_algos.compute_policy_loss_gspo)
    assert float(v_ref) == pytest.approx(math.exp(2), rel=1e-12)
    torch.testing.assert_close(g_ref, torch.full((1, 4), math.exp(2) / 4, dtype=torch.float64))
    for name in ("echotrain_gspo", "echotrain_gspo_token"):
        v, g, m = call(verl_algos.get_policy_loss_fn(name))
        torch.testing.assert_close(v, v_ref, **TOL)
        torch.testing.assert_close(g, g_ref, **TOL)
        assert m["actor/pg_clipfrac_lower"] == 0.0
    # vanilla (token level) does take verl's dual-clip, as verl's vanilla does: loss capped at 3
    v, g, m = call(verl_algos.get_policy_loss_fn("echotrain_vanilla"))
    v_vanilla, g_vanilla, _ = call(verl_algos.compute_policy_loss_vanilla)
    assert float(v) == pytest.approx(3.0) and float(v_vanilla) == pytest.approx(3.0)
    assert g.eq(0).all() and g_vanilla.eq(0).all() and m["actor/pg_clipfrac_lower"] == 1.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("case", ["extreme", "dual_clip", "asymmetric"])
@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_plugin_vanilla_equals_verl_vanilla_everywhere(case, agg, dp_size):
    """echotrain_vanilla == verl's vanilla per rank: log-ratios of +-30 (both clamp at 20), dual-clip
    active, asymmetric clips, 1 / 2 / 4 data-parallel ranks with verl's global counts."""
    old, log_prob, adv, mask = _batch(7, B=16, noise=1.0)
    low, high = (0.2, 0.28) if case != "asymmetric" else (0.05, 0.6)
    if case == "extreme":
        log_prob = log_prob.clone()
        log_prob[0, 0], log_prob[1, 0] = old[0, 0] + 30, old[1, 0] - 30
        adv = adv.clone()
        adv[0, 0], adv[1, 0] = -1.0, 1.0
    info = dict(dp_size=dp_size, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    cfg = _actor(low, high, 3.0, **info)
    lp1 = log_prob.clone().requires_grad_(True)
    lp2 = log_prob.clone().requires_grad_(True)
    fired = 0.0
    for rows in torch.arange(16).chunk(dp_size):
        a = (old[rows], lp1[rows], adv[rows], mask[rows])
        v1, m1 = verl_algos.get_policy_loss_fn("echotrain_vanilla")(*a, loss_agg_mode=agg, config=cfg)
        v2, m2 = verl_algos.compute_policy_loss_vanilla(old[rows], lp2[rows], adv[rows], mask[rows],
                                                        loss_agg_mode=agg, config=cfg)
        torch.testing.assert_close(v1, v2, rtol=1e-7, atol=1e-12)
        assert m1["actor/pg_clipfrac_lower"] == pytest.approx(m2["actor/pg_clipfrac_lower"], abs=1e-8)
        fired += m1["actor/pg_clipfrac_lower"]
        (v1 / dp_size).backward()
        (v2 / dp_size).backward()
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-7, atol=1e-12)
    assert fired > 0  # dual-clip active somewhere: the comparison is not vacuous


def test_expected_difference_gspo_token_clamp():
    """Documented difference (design §8): our token log-ratios are clamped at +-20 before the
    sequence mean; verl's gspo clamps the mean from above at 10. One token at +30 of 4 (others 0),
    A = -1: ours e^(20/4) = 148.4, verl's e^(30/4) = 1808; a sequence of 4 tokens at +12: ours e^12,
    verl's e^10. Below both clamps they agree."""
    ours = verl_algos.get_policy_loss_fn("echotrain_gspo_token")
    mask = torch.ones(1, 4, dtype=torch.float64)
    adv = -torch.ones(1, 4, dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    for row, v_ours, v_verl in (([30.0, 0, 0, 0], math.exp(5), math.exp(7.5)), ([12.0] * 4, math.exp(12), math.exp(10)),
                                ([2.0, 1.0, 0.0, -1.0], math.exp(0.5), math.exp(0.5))):
        lp = torch.tensor([row], dtype=torch.float64)
        a, _ = ours(old, lp, adv, mask, loss_agg_mode="token-mean", config=_actor())
        b, _ = verl_algos.compute_policy_loss_gspo(old, lp, adv, mask, loss_agg_mode="token-mean", config=_actor())
        assert float(a) == pytest.approx(v_ours, rel=1e-12) and float(b) == pytest.approx(v_verl, rel=1e-12)


def test_expected_difference_seq_mean_token_sum_norm_without_loss_scale_factor():
    """verl divides by the padded width when loss_scale_factor is unset; the plugin refuses."""
    old, log_prob, adv, mask = _batch(8)
    v, _ = verl_algos.compute_policy_loss_vanilla(old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-sum-norm",
                                                  config=_actor())
    ref = verl_algos.compute_policy_loss_vanilla(old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-sum-norm",
                                                 config=_actor(loss_scale_factor=mask.shape[1]))[0]
    torch.testing.assert_close(v, ref)  # verl: the padded width 7
    with pytest.raises(ValueError, match="loss_scale_factor"):
        verl_algos.get_policy_loss_fn("echotrain_vanilla")(old, log_prob, adv, mask,
                                                           loss_agg_mode="seq-mean-token-sum-norm", config=_actor())


def test_expected_difference_echo_R_is_per_micro_batch():
    """Through verl, ECHO's R is each micro-batch's: two micro-batches sum to a different loss
    than the whole step in one call (R differs between them); one call is exact."""
    fn = verl_algos.get_policy_loss_fn("echotrain_echo")
    old, log_prob, adv, mask = _batch(9, drift=0.0, noise=0.01)
    log_prob = log_prob + torch.where(torch.arange(12)[:, None] < 6, 0.05, -0.05) * mask  # R > 1 | R < 1
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    whole, m = fn(old, log_prob, adv, mask, loss_agg_mode="token-mean", config=_actor(**info))
    exact, _ = compute_policy_loss("echo", old, log_prob, adv, mask, "token-mean",
                                   PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, **BAND))
    torch.testing.assert_close(whole, exact, **TOL)
    assert m["actor/echo/R_token_share"] == 1.0
    parts = [fn(old[r], log_prob[r], adv[r], mask[r], loss_agg_mode="token-mean", config=_actor(**info))
             for r in (slice(0, 6), slice(6, 12))]
    assert parts[0][1]["actor/echo/R_batch"] > 1.01 > 0.99 > parts[1][1]["actor/echo/R_batch"]
    assert abs(float(parts[0][0] + parts[1][0]) - float(whole)) > 1e-3


def test_echo_flags_pass_through_to_the_loss_config():
    from echotrain.integrations.verl import _loss_config

    base = PolicyLossConfig(echo_pessimistic=True, echo_token_clip="truncate", echo_token_cap=1.5, **BAND)
    cfg = _loss_config(_actor(low=0.1, high=0.3), base, "echo")
    assert (cfg.echo_pessimistic, cfg.echo_token_clip, cfg.echo_token_cap) == (True, "truncate", 1.5)
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.batch_clip_low) == (0.1, 0.3, 0.01)


def test_fallbacks_come_from_the_registered_config():
    """A verl config without clip keys falls back to the registered PolicyLossConfig (not a
    restated 0.2 / 3.0); verl's keys win where set; dual-clip never reaches the GSPO forms."""
    base = PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=4.0, **BAND)
    old, log_prob, adv, mask = _batch(3)
    for mode, c in (("vanilla", 4.0), ("gspo", None)):
        fn = make_verl_policy_loss(mode, base)
        bare = fn(old, log_prob, adv, mask, config={})[0]
        want = compute_policy_loss(mode, old, log_prob, adv, mask.bool(), "token-mean",
                                   dataclasses.replace(base, clip_ratio_c=c))[0]
        assert float(bare) == float(want)
    fn = make_verl_policy_loss("vanilla", base)
    mine = fn(old, log_prob, adv, mask, config={"clip_ratio": 0.2, "clip_ratio_c": 3.0})[0]
    want = compute_policy_loss("vanilla", old, log_prob, adv, mask.bool(), "token-mean",
                               dataclasses.replace(base, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0))[0]
    assert float(mine) == float(want)


def test_balanced_estimator_takes_the_ba_flags_from_the_config():
    """ba_scope=batch pools the groups: two groups of 2 (+,- and +,0), lengths 1,1 / 2,2. Pooled:
    k=2 positive responses over T+=3 tokens, m=1 over T-=1, G=4 -> w = 2/(4*3), 1/(4*1) per token."""
    mask = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 1.0, 0.0])
    gid = torch.tensor([0, 0, 1, 1])
    per_group = balanced_advantage_scale(adv, mask, gid)
    pooled = balanced_advantage_scale(adv, mask, gid, {"ba_scope": "batch"})
    assert not torch.equal(per_group, pooled)
    torch.testing.assert_close(pooled, 4 * torch.tensor([2 / 12, 1 / 4, 2 / 12, 0.0]))


def test_verl_rollout_is_weights_reach_every_echotrain_loss():
    """verl's rollout correction weights multiply each token's loss: weights of 2 double the loss."""
    from echotrain.rl import POLICY_LOSSES

    old, log_prob, adv, mask = _batch(6)
    for name in POLICY_LOSSES:
        fn = make_verl_policy_loss(name)
        plain, _ = fn(old, log_prob, adv, mask, config=None)
        doubled, _ = fn(old, log_prob, adv, mask, config=None, rollout_is_weights=torch.full_like(old, 2.0))
        assert float(doubled) == pytest.approx(2 * float(plain), rel=1e-6), name
