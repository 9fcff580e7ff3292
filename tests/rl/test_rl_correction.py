"""Rollout corrections (echotrain.rl.correction): hand-computed weights, closed-form gradients,
exactness under micro-batches and simulated ranks for every registered correction x every
registered loss x every aggregation mode (by enumeration), and bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.rl import AGG_MODES, POLICY_LOSSES, PolicyLossConfig, compute_policy_loss, compute_step_stats
from echotrain.rl.config import CAP_LOG_TOLERANCE, RS_STATISTICS
from echotrain.rl.correction import (
    CORRECTION_METRICS,
    ROLLOUT_CORRECTIONS,
    Correction,
    apply_rollout_correction,
    parse_rollout_correction,
    register_rollout_correction,
    rejection_statistic,
    rollout_mismatch_metrics,
)
from echotrain.rl.stepwise import shard_batch, split_micro_batches

# Thresholds under which every correction fires on the batches below (asserted per case).
FIRING = dict(rollout_is_threshold=1.5, rollout_is_threshold_lower=0.7, rollout_rs_threshold=1.6,
              behav_imp_weight_cap=1.5, offpolicy_mask_delta=0.02, norm_constant=9.0, clip_ratio_high=0.28)


def _batch(seed=3, B=12, T=6, mismatch=0.35):
    """Ragged rows (one empty), mixed-sign group advantages, rollout_log_prob = old + noise."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    roll = old + mismatch * torch.randn(B, T, generator=g, dtype=torch.float64)
    log_prob = old - 0.1 + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    group_index = torch.arange(B) // 4
    adv = torch.tensor([1.0, 0.0, -1.0, 0.5] * (B // 4), dtype=torch.float64)
    return {"old_log_prob": old, "log_prob": log_prob, "rollout_log_prob": roll,
            "advantages": adv.unsqueeze(-1).expand(B, T).clone(), "response_mask": mask, "group_index": group_index}


def _loss_grad(loss_mode, agg, cfg, mbs, step=None):
    total, grads, metrics = 0.0, [], {}
    for mb in mbs:
        lp = mb["log_prob"].detach().clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(loss_mode, mb["old_log_prob"], lp, mb["advantages"], mb["response_mask"],
                                            agg, cfg, group_index=mb["group_index"], step=step,
                                            rollout_log_prob=mb["rollout_log_prob"])
        loss.backward()
        total += float(loss.detach())
        grads.append(lp.grad)
    return total, torch.cat(grads), metrics


# --------------------------------------------------------------------------- hand-computed values


def test_token_is_seq_is_and_masks_by_hand():
    # log(pi_old / mu) per token of one sequence: log 3, log 0.5, 0  -> w = 3, 0.5, 1
    old = torch.zeros(1, 3, dtype=torch.float64)
    roll = -torch.log(torch.tensor([[3.0, 0.5, 1.0]], dtype=torch.float64))
    adv, mask = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)

    def weights(name, **kw):
        return apply_rollout_correction(old, roll, adv, mask, dict(rollout_correction=name, **kw)).rollout_is_weights

    torch.testing.assert_close(weights("token_is", rollout_is_threshold=2.0), torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("token_is", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.8),
                               torch.tensor([[2.0, 0.8, 1.0]], dtype=torch.float64))
    # sequence ratio 3 * 0.5 * 1 = 1.5: below C = 2 -> kept as is on every token; C = 1.2 -> truncated
    torch.testing.assert_close(weights("seq_is", rollout_is_threshold=2.0), torch.full((1, 3), 1.5, dtype=torch.float64))
    torch.testing.assert_close(weights("seq_is", rollout_is_threshold=1.2), torch.full((1, 3), 1.2, dtype=torch.float64))
    # IcePop band [0.6, 2]: 3 and 0.5 are masked, 1 kept with its weight
    torch.testing.assert_close(weights("token_mask", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.6),
                               torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("seq_mask", rollout_is_threshold=1.2), torch.zeros(1, 3, dtype=torch.float64))
    torch.testing.assert_close(weights("decoupled"), torch.tensor([[3.0, 0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("decoupled", behav_imp_weight_cap=2.0), torch.tensor([[0.0, 0.5, 1.0]], dtype=torch.float64))
    # batch normalisation: token TIS weights 2, 0.5, 1 (mean 7/6) -> divided by 7/6
    out = apply_rollout_correction(old, roll, adv, mask, dict(rollout_correction="token_is", rollout_is_threshold=2.0,
                                                              rollout_is_batch_normalize=True))
    torch.testing.assert_close(out.rollout_is_weights, torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64) * 6 / 7)
    m = out.metrics
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx(7 / 6)
    assert m["rollout_corr/ess"] == pytest.approx((3.5 ** 2) / (3 * (4 + 0.25 + 1)))
    assert (m["rollout_corr/is_min"], m["rollout_corr/is_max"]) == (0.5, 2.0)
    assert m["rollout_corr/frac_high"] == pytest.approx(1 / 3) and m["rollout_corr/frac_low"] == 0.0
    # mismatch: rollout - old = -log 3, -log .5, 0
    d = [-math.log(3), -math.log(0.5), 0.0]
    assert m["rollout_corr/log_prob_abs_diff"] == pytest.approx(sum(map(abs, d)) / 3)
    assert m["rollout_corr/kl"] == pytest.approx(sum(d) / 3)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 3)
    # behaviour ESS of the untruncated weights 3, 0.5, 1 (the token_is weights above are truncated at 2)
    assert m["rollout_corr/behaviour_ess"] == pytest.approx(4.5 ** 2 / (3 * (9 + 0.25 + 1)))
    assert set(m) == set(CORRECTION_METRICS)


def test_rejection_statistics_by_hand():
    # two sequences, log(pi_old/mu): [0.1, 0.1] and [1.0, -0.2]; k3 = e^x - 1 - x
    old = torch.zeros(2, 2, dtype=torch.float64)
    lr = torch.tensor([[0.1, 0.1], [1.0, -0.2]], dtype=torch.float64)
    roll, adv, mask = -lr, torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool)
    k3 = torch.expm1(lr) - lr  # [[.00517, .00517], [.718, .0187]]

    def keep(rs, upper, lower=None):
        return apply_rollout_correction(old, roll, adv, mask, dict(rollout_correction="rejection", rollout_rs=rs,
                                                                   rollout_rs_threshold=upper,
                                                                   rollout_rs_threshold_lower=lower)).response_mask

    assert keep("token_k3", 0.1).tolist() == [[True, True], [False, True]]
    assert keep("seq_sum_k3", 0.1).tolist() == [[True, True], [False, False]]
    assert keep("seq_mean_k3", float(k3[1].mean()) + 1e-9).tolist() == [[True, True], [True, True]]
    assert keep("seq_max_k2", 0.4).tolist() == [[True, True], [False, False]]  # 0.5 * 1^2 = 0.5 > 0.4
    # k1 = log(mu / pi_old) = -lr; ratio bounds [1/2, 2] on exp(k1): token exp(-1) = 0.37 < 0.5 is rejected
    assert keep("token_k1", 2.0).tolist() == [[True, True], [False, True]]
    # seq_sum_k1: exp(-0.2) = 0.82 and exp(-0.8) = 0.45; lower 0.5 rejects the second sequence
    assert keep("seq_sum_k1", 2.0, 0.5).tolist() == [[True, True], [False, False]]


def test_offpolicy_mask_by_hand():
    # seq 0: A < 0 and mean log(mu/pi_old) = 0.3 > delta -> masked; seq 1: same KL, A > 0 -> kept;
    # seq 2: A < 0, KL 0.05 < delta -> kept
    old = torch.zeros(3, 2, dtype=torch.float64)
    roll = torch.tensor([[0.2, 0.4], [0.2, 0.4], [0.05, 0.05]], dtype=torch.float64)
    adv = torch.tensor([[-1.0], [1.0], [-1.0]], dtype=torch.float64).expand(3, 2)
    out = apply_rollout_correction(old, roll, adv, torch.ones(3, 2), dict(rollout_correction="offpolicy_mask",
                                                                          offpolicy_mask_delta=0.1))
    assert out.rollout_is_weights.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert out.response_mask.all()  # the masked sequence stays in the normalisers
    assert out.metrics["rollout_corr/zero_weight_frac"] == pytest.approx(1 / 3)


def test_decoupled_cap_ignores_float_noise_by_hand():
    """behav_imp_weight_cap compares log w with log(cap) + CAP_LOG_TOLERANCE (1e-3 nats): rounding
    of an on-policy token (log w = 5e-4) is kept with its weight, a real excess (2e-3) is masked."""
    assert CAP_LOG_TOLERANCE == 1e-3
    log_w = torch.tensor([[0.0, 5e-4, -5e-4, 2e-3, math.log(2.0)]], dtype=torch.float64)
    old, roll = log_w.clone(), torch.zeros_like(log_w)
    adv, mask = torch.ones_like(log_w), torch.ones_like(log_w, dtype=torch.bool)

    def run(cap):
        return apply_rollout_correction(old, roll, adv, mask, dict(rollout_correction="decoupled",
                                                                  behav_imp_weight_cap=cap))

    out = run(1.0)
    w = torch.exp(log_w)
    torch.testing.assert_close(out.rollout_is_weights, torch.tensor([[1.0, w[0, 1], w[0, 2], 0.0, 0.0]],
                                                                    dtype=torch.float64), rtol=0, atol=0)
    assert out.metrics["rollout_corr/frac_high"] == pytest.approx(2 / 5)
    # cap 2: log 2 itself, and log 2 + 5e-4, are kept; log 2 + 2e-3 is masked
    log_w2 = math.log(2.0) + torch.tensor([[0.0, 5e-4, 2e-3]], dtype=torch.float64)
    out2 = apply_rollout_correction(log_w2, torch.zeros_like(log_w2), torch.ones_like(log_w2),
                                    torch.ones_like(log_w2, dtype=torch.bool),
                                    dict(rollout_correction="decoupled", behav_imp_weight_cap=2.0))
    torch.testing.assert_close(out2.rollout_is_weights,
                               torch.tensor([[2.0, 2.0 * math.exp(5e-4), 0.0]], dtype=torch.float64))


def test_decoupled_ppo_gradient_is_the_behaviour_weight_times_the_surrogate_gradient():
    """Decoupled PPO, token-mean, ratio to pi_prox = 1 (clip inactive): dL/dlog_prob_t = -w_t A_t / N."""
    b = _batch(seed=5)
    mask = b["response_mask"]
    lp = b["old_log_prob"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss("vanilla", b["old_log_prob"], lp, b["advantages"], mask, "token-mean",
                                  dict(rollout_correction="decoupled"), rollout_log_prob=b["rollout_log_prob"])
    loss.backward()
    w = torch.exp(b["old_log_prob"] - b["rollout_log_prob"])
    expected = torch.where(mask, -w * b["advantages"] / mask.sum(), 0.0)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-14)


def test_rejection_removes_tokens_from_the_normalisers():
    b = _batch(seed=2)
    cfg = dict(rollout_correction="rejection", rollout_rs="token_k2", rollout_rs_threshold=0.02)
    out = apply_rollout_correction(b["old_log_prob"], b["rollout_log_prob"], b["advantages"], b["response_mask"], cfg)
    assert 0 < int((b["response_mask"] & ~out.response_mask).sum())
    loss, _ = compute_policy_loss("vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"],
                                  "token-mean", cfg, rollout_log_prob=b["rollout_log_prob"])
    plain, _ = compute_policy_loss("vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], out.response_mask,
                                   "token-mean")
    assert float(loss) == pytest.approx(float(plain), rel=1e-12)


def test_no_correction_is_bit_identical_to_the_plain_loss():
    b = _batch()
    for loss_mode in POLICY_LOSSES:
        for agg in AGG_MODES:
            cfg = dict(norm_constant=9.0)
            args = (b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"], agg)
            plain, _ = compute_policy_loss(loss_mode, *args, cfg, group_index=b["group_index"])
            cfg_none, _ = compute_policy_loss(loss_mode, *args, dict(cfg, rollout_correction=None),
                                              group_index=b["group_index"], rollout_log_prob=b["rollout_log_prob"])
            assert torch.equal(plain, cfg_none)


# --------------------------------------------------------------------------- exactness, by enumeration


def _correction_cases():
    """Every registered correction alone (batch-normalised), plus one chain of all of them."""
    names = list(ROLLOUT_CORRECTIONS)
    return [(n, dict(FIRING, rollout_correction=n, rollout_is_batch_normalize=True)) for n in names] + [
        ("chain", dict(FIRING, rollout_correction=",".join(names), rollout_is_batch_normalize=True))]


def _fires(name, metrics):
    if name == "rejection":
        return metrics["rollout_corr/rejected_frac"] > 0
    return metrics["rollout_corr/frac_high"] + metrics["rollout_corr/frac_low"] > 0 or name == "decoupled"


#: token-mean and balanced (the step-global group statistics) in the default run; the other modes slow.
_AGGS = [a if a in ("token-mean", "balanced") else pytest.param(a, marks=pytest.mark.slow) for a in AGG_MODES]


@pytest.mark.parametrize("agg", _AGGS)
@pytest.mark.parametrize("loss_mode", list(POLICY_LOSSES))
@pytest.mark.parametrize("name,cfg", _correction_cases(), ids=[c[0] for c in _correction_cases()])
def test_random_micro_batch_splits_match_one_batch(name, cfg, loss_mode, agg):
    b = _batch()
    ref_loss, ref_grad, ref_metrics = _loss_grad(loss_mode, agg, cfg, [b])
    assert _fires(name, ref_metrics), f"{name} does not fire on the test batch: the case would prove nothing"
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        cuts = sorted(torch.randint(0, 13, (3,), generator=g).tolist())
        mbs = split_micro_batches(b, [y - x for x, y in zip([0] + cuts, cuts + [12])])
        step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)
        total, grad, metrics = _loss_grad(loss_mode, agg, cfg, mbs, step)
        assert total == pytest.approx(ref_loss, abs=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)
        for k in CORRECTION_METRICS:  # step values, whatever the split
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-10, abs=1e-12), k


@pytest.mark.parametrize("loss_mode", list(POLICY_LOSSES))
@pytest.mark.parametrize("name,cfg", _correction_cases(), ids=[c[0] for c in _correction_cases()])
def test_two_simulated_ranks_match_one_batch(name, cfg, loss_mode, run_ranks):
    b, agg, world = _batch(), "seq-mean-token-mean", 2
    _, ref_grad, _ = _loss_grad(loss_mode, agg, cfg, [b])
    grads = {}

    def work(rank, reducer):
        mbs = split_micro_batches(shard_batch(b, rank, world), 2)
        step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg,
                                  reduce_fn=reducer.for_rank(rank), dp_size=1)
        grads[rank] = _loss_grad(loss_mode, agg, cfg, mbs, step)[1]

    run_ranks(world, work)
    torch.testing.assert_close(torch.cat([grads[0], grads[1]]), ref_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("rollout_rs", RS_STATISTICS)
def test_every_rejection_statistic_is_exact_under_micro_batches(rollout_rs):
    b = _batch(seed=4)
    # thresholds at the statistic's quartiles, so that some tokens are rejected and some kept
    lr = (b["old_log_prob"] - b["rollout_log_prob"]).clamp(-20, 20)
    stat, is_k1 = rejection_statistic(torch.where(b["response_mask"], lr, 0), b["response_mask"], rollout_rs)
    q = torch.quantile(stat[b["response_mask"]], torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist()
    bounds = dict(rollout_rs_threshold=math.exp(q[1]), rollout_rs_threshold_lower=math.exp(q[0])) if is_k1 else \
        dict(rollout_rs_threshold=q[1])
    cfg = dict(rollout_correction="rejection", rollout_rs=rollout_rs, **bounds)
    ref_loss, ref_grad, m = _loss_grad("vanilla", "token-mean", cfg, [b])
    assert 0 < m["rollout_corr/rejected_frac"] < 1
    mbs = split_micro_batches(b, [5, 0, 7])
    step = compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode="token-mean", config=cfg)
    total, grad, _ = _loss_grad("vanilla", "token-mean", cfg, mbs, step)
    assert total == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_a_newly_registered_correction_joins_the_enumerations():
    @register_rollout_correction("_test_halve", level="token")
    def halve(x, cfg):
        return Correction(weights=torch.full_like(x.log_ratio, 0.5), high=torch.ones_like(x.response_mask))

    try:
        assert "_test_halve" in [c[0] for c in _correction_cases()]
        PolicyLossConfig(rollout_correction="_test_halve")  # the setting's check reads the live registry
        b = _batch()
        half, _, _ = _loss_grad("vanilla", "token-mean", dict(rollout_correction="_test_halve"), [b])
        full, _ = compute_policy_loss("vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"])
        assert half == pytest.approx(0.5 * float(full), rel=1e-12)
    finally:
        ROLLOUT_CORRECTIONS.unregister("_test_halve")


# --------------------------------------------------------------------------- bad inputs and settings


def test_a_raw_signature_loss_without_the_weights_keyword_is_refused_clearly():
    @POLICY_LOSSES.register("_raw_vanilla", step_stats=None)
    def raw(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, *,
            group_index=None, step=None):
        return compute_policy_loss("vanilla", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)

    try:
        b = _batch()
        with pytest.raises(ValueError, match="loss_mode='_raw_vanilla' does not take rollout_is_weights"):
            compute_policy_loss("_raw_vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"],
                                "token-mean", dict(rollout_correction="token_is"), rollout_log_prob=b["rollout_log_prob"])
    finally:
        POLICY_LOSSES.unregister("_raw_vanilla")


def test_a_correction_without_rollout_log_prob_fails_naming_it():
    b = _batch()
    with pytest.raises(ValueError, match="rollout_correction='token_is' needs rollout_log_prob"):
        compute_policy_loss("vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"],
                            "token-mean", dict(rollout_correction="token_is"))
    mbs = split_micro_batches({k: v for k, v in b.items() if k != "rollout_log_prob"}, 6)
    with pytest.raises(ValueError, match="micro-batch 0 has no 'rollout_log_prob'"):
        compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode="token-mean", config=dict(rollout_correction="seq_is"))
    bad = b["rollout_log_prob"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_log_prob has 1 NaN"):
        apply_rollout_correction(b["old_log_prob"], bad, b["advantages"], b["response_mask"], dict(rollout_correction="seq_is"))


@pytest.mark.parametrize("settings,match", [
    (dict(rollout_correction="tis"), "rollout_correction is invalid"),
    (dict(rollout_correction="token_is,token_is"), "names a correction twice"),
    (dict(rollout_is_threshold=-1.0), "rollout_is_threshold must be a finite float > 0"),
    (dict(rollout_is_threshold_lower=0.0), "rollout_is_threshold_lower must be a finite float > 0"),
    (dict(rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0),
     r"rollout_is_threshold_lower=3.0 must be <= rollout_is_threshold=2.0 \(thresholds in the wrong order\)"),
    (dict(rollout_rs_threshold=1.5, rollout_rs_threshold_lower=2.0), "rollout_rs_threshold_lower=2.0 must be <="),
    (dict(rollout_rs="seq_max_k1"), "rollout_rs='seq_max_k1' is unknown"),
    (dict(behav_imp_weight_cap=0.5), "behav_imp_weight_cap must be a finite float >= 1"),
    (dict(offpolicy_mask_delta=-0.1), "offpolicy_mask_delta must be a finite float >= 0"),
])
def test_bad_settings_fail_naming_the_key(settings, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**settings)


def test_parse_and_mismatch_helpers():
    assert parse_rollout_correction(None) == parse_rollout_correction("none") == parse_rollout_correction("") == ()
    assert parse_rollout_correction("token_is, rejection") == ("token_is", "rejection")
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    roll = torch.tensor([[-1.5, -2.0, 5.0]])
    m = rollout_mismatch_metrics(old, roll, torch.tensor([[1, 1, 0]]))
    assert m["rollout_corr/log_prob_abs_diff"] == pytest.approx(0.25)
    assert m["rollout_corr/kl"] == pytest.approx(-0.25)
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(0.5) - 1 - 0.5) / 2)
    w = [math.exp(0.5), 1.0]  # pi_old / mu on the two valid tokens; the masked third is ignored
    assert m["rollout_corr/behaviour_ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    assert rollout_mismatch_metrics(old, old, torch.tensor([[1, 1, 0]]))["rollout_corr/behaviour_ess"] == 1.0
    assert rollout_mismatch_metrics(old, roll, torch.zeros(1, 3))["rollout_corr/behaviour_ess"] == 1.0


@pytest.mark.parametrize("settings", [
    {"rollout_correction": "token_mask", "rollout_is_threshold": 0.5},
    {"rollout_correction": "token_is", "rollout_is_threshold": 3.0, "rollout_is_threshold_lower": 1.5},
    {"rollout_correction": "rejection", "rollout_rs_threshold": 0.5},
])
def test_a_band_without_the_on_policy_ratio_is_refused(settings):
    """A band that excludes rho = 1 would cut or drop every token of an on-policy batch (a run
    training on nothing, silently): refused, naming the key."""
    from echotrain.rl import PolicyLossConfig

    with pytest.raises(ValueError, match="on-policy ratio 1 must stay inside"):
        PolicyLossConfig(**settings)
    PolicyLossConfig(rollout_correction="rejection", rollout_rs="token_k2", rollout_rs_threshold=0.5)  # k2: a divergence


def test_none_written_as_a_string_is_no_correction_for_the_integrations():
    from echotrain.integrations.verl import make_verl_policy_loss

    make_verl_policy_loss("vanilla", {"rollout_correction": "none"})  # was refused as if a correction were set
