"""The losses of echotrain.rl.losses side by side with verl 0.9.1's own functions.

Same loss value and gradient on random float64 batches with ragged and empty rows, every
aggregation mode verl supports for the loss, log-ratios from small to extreme (|log rho| up to
15, inside both clamps), and the documented differences checked as such.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from echotrain.integrations.verl import verl_core_algos

try:
    verl_algos = verl_core_algos()
except ImportError as exc:
    pytest.skip(f"verl parity tests: {exc}", allow_module_level=True)
from verl.workers.config import ActorConfig, PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

from echotrain.rl import compute_policy_loss  # noqa: E402

VERL_AGGS = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
C = 11.0
# verl divides seq-mean-token-mean by length + 1e-8: each sequence's mean is off by up to 1e-8
# relative, and where the per-sequence terms cancel (advantages of both signs) the total's relative
# error grows (up to ~8e-7 seen over 300 random batches), so the bound is absolute: 1e-8 x terms <= 1
TOL = dict(rtol=1e-7, atol=1e-8)


def _verl_config(low=0.2, high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05, **policy_loss):
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=clip_ratio_c, tau_pos=tau_pos, tau_neg=tau_neg,
        policy_loss=VerlPolicyLossConfig(**policy_loss), global_batch_info={"loss_scale_factor": C},
    )


def _random(seed, B=16, T=9, noise=0.4, extreme=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0  # a full row and an empty (masked) row
    mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.01
    log_prob = old + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    if extreme:  # a few tokens with |log rho| up to 15 (inside verl's and our +-20 clamp)
        spikes = torch.rand(B, T, generator=g) < 0.15
        log_prob = torch.where(spikes, old + 15 * (2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1), log_prob)
        log_prob = log_prob.clamp(max=-1e-3)  # a log-prob stays < 0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, log_prob, adv, mask


def _both(loss_mode, verl_name, agg, ours_cfg, verl_cfg, old, log_prob, adv, mask, verl_agg=None):
    lp1 = log_prob.clone().requires_grad_(True)
    ours, m_ours = compute_policy_loss(loss_mode, old, lp1, adv, mask.bool(), agg, {**ours_cfg, "norm_constant": C})
    ours.backward()
    lp2 = log_prob.clone().requires_grad_(True)
    ref, m_ref = verl_algos.get_policy_loss_fn(verl_name)(old, lp2, adv, mask, loss_agg_mode=verl_agg or agg,
                                                          config=verl_cfg)
    ref.backward()
    return (ours, lp1.grad, m_ours), (ref, lp2.grad, m_ref)


def _assert_same(a, b):
    (ours, g_ours, _), (ref, g_ref, _) = a, b
    torch.testing.assert_close(ours, ref.to(ours.dtype), **TOL)
    torch.testing.assert_close(g_ours, g_ref, **TOL)


# loss_mode -> (our config, verl config kwargs)
CASES = {
    "cispo": (dict(clip_ratio_low=0.2, clip_ratio_high=0.28), dict(low=0.2, high=0.28)),
    "gpg": ({}, {}),
    "dro": (dict(dro_beta=0.3), dict(dro_beta=0.3)),
    "dppo_tv": (dict(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=3.0), dict(low=0.05, high=0.08)),
    "dppo_kl": (dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=3.0), dict(low=0.02, high=0.03)),
}


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("agg", VERL_AGGS)
@pytest.mark.parametrize("loss_mode", sorted(CASES))
def test_token_losses_match_verl(loss_mode, agg, extreme):
    ours_cfg, verl_kw = CASES[loss_mode]
    old, log_prob, adv, mask = _random(zlib.crc32(loss_mode.encode()) % 1000, noise=0.6, extreme=extreme)
    a, b = _both(loss_mode, loss_mode, agg, ours_cfg, _verl_config(**verl_kw), old, log_prob, adv, mask)
    _assert_same(a, b)
    m_ours, m_ref = a[2], b[2]
    if "actor/pg_clipfrac" in m_ref:
        assert m_ours["pg_clipfrac"] == pytest.approx(m_ref["actor/pg_clipfrac"], abs=1e-7)
        assert 0 < m_ours["pg_clipfrac"] < 1  # the clip / mask fires: the comparison is not vacuous
    if "actor/ppo_kl" in m_ref:
        assert m_ours["ppo_kl"] == pytest.approx(m_ref["actor/ppo_kl"], abs=1e-7)


@pytest.mark.parametrize("extreme", [False, True])
def test_cispo_without_lower_clip_is_trls_upper_cap(extreme):
    """cispo_lower_clip=False: the weight is min(rho, 1 + eps_high); it equals verl's two-sided form
    with eps_low = 1 (floor 0), since rho > 0."""
    old, log_prob, adv, mask = _random(21, noise=0.6, extreme=extreme)
    a, b = _both("cispo", "cispo", "token-mean", dict(clip_ratio_high=4.0, cispo_lower_clip=False),
                 _verl_config(low=1.0, high=4.0), old, log_prob, adv, mask)
    _assert_same(a, b)


@pytest.mark.parametrize("extreme", [False, True])
def test_sapo_matches_verl_in_its_only_mode(extreme):
    """verl's sapo always aggregates seq-mean-token-mean (it ignores loss_agg_mode); ours honours the
    argument, so the comparison is in that mode, with verl asked for any other."""
    old, log_prob, adv, mask = _random(3, noise=0.6, extreme=extreme)
    cfg = dict(tau_pos=1.0, tau_neg=1.05)
    for verl_agg in ("seq-mean-token-mean", "token-mean"):
        _assert_same(*_both("sapo", "sapo", "seq-mean-token-mean", cfg, _verl_config(), old, log_prob, adv, mask,
                            verl_agg=verl_agg))
    _assert_same(*_both("sapo", "sapo", "seq-mean-token-mean", dict(tau_pos=2.0, tau_neg=5.0),
                        _verl_config(tau_pos=2.0, tau_neg=5.0), old, log_prob, adv, mask))


@pytest.mark.parametrize("extreme", [False, True])
def test_geo_mean_matches_verl_up_to_its_empty_rows(extreme):
    """verl's geo_mean takes torch.mean over all B rows (an empty row counts with loss 0) and ignores
    loss_agg_mode; ours (seq-mean-token-mean) leaves empty rows out: verl = ours * N_nonempty / B."""
    old, log_prob, adv, mask = _random(4, noise=0.5, extreme=extreme)
    (ours, g_ours, m_ours), (ref, g_ref, m_ref) = _both(
        "geo_mean", "geo_mean", "seq-mean-token-mean", dict(clip_ratio_low=0.4, clip_ratio_high=0.4),
        _verl_config(low=0.4, high=0.4), old, log_prob, adv, mask)
    share = float(mask.any(-1).sum()) / mask.shape[0]
    assert share < 1  # there is an empty row
    torch.testing.assert_close(ours * share, ref, **TOL)
    torch.testing.assert_close(g_ours * share, g_ref, **TOL)
    # without empty rows: identical
    full = mask.any(-1)
    (o2, g2, _), (r2, gr2, _) = _both("geo_mean", "geo_mean", "seq-mean-token-mean",
                                      dict(clip_ratio_low=0.4, clip_ratio_high=0.4), _verl_config(low=0.4, high=0.4),
                                      old[full], log_prob[full], adv[full], mask[full])
    torch.testing.assert_close(o2, r2, **TOL)
    torch.testing.assert_close(g2, gr2, **TOL)


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_kl_cov_matches_verl(agg):
    """The top-k covariance tokens (k = 10% here so several are chosen) and the penalty: same tokens,
    loss and gradient as verl (on one call the step is the call's input)."""
    old, log_prob, adv, mask = _random(5, noise=0.5)
    a, b = _both("kl_cov", "kl_cov", agg, dict(kl_cov_ratio=0.1, ppo_kl_coef=0.7),
                 _verl_config(kl_cov_ratio=0.1, ppo_kl_coef=0.7), old, log_prob, adv, mask)
    _assert_same(a, b)
    assert a[2]["pg_covfrac"] == pytest.approx(int(0.1 * mask.sum()) / float(mask.sum()))


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_clip_cov_matches_verl_when_every_candidate_is_drawn(agg):
    """verl draws its n tokens with torch.randperm, ours with a hash of the data (exact under
    micro-batches); with n >= the number of candidates both take every candidate, so the loss and
    gradient must agree exactly. The band [-0.05, 0.4] makes some tokens candidates, not all."""
    old, log_prob, adv, mask = _random(6, noise=0.3)
    settings = dict(clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.4)
    a, b = _both("clip_cov", "clip_cov", agg, dict(clip_ratio_low=0.2, clip_ratio_high=0.28, **settings),
                 _verl_config(**settings), old, log_prob, adv, mask)
    _assert_same(a, b)
    assert 0 < a[2]["pg_covfrac"] < 1 and a[2]["pg_covfrac"] == pytest.approx(b[2]["actor/pg_clipfrac"], abs=1e-7)


def test_clip_cov_draws_verls_number_of_tokens():
    """With n < candidates, ours draws exactly n = max(1, int(r N)) tokens, as verl's randperm does."""
    old, log_prob, adv, mask = _random(7, B=64, T=32, noise=0.3)
    settings = dict(clip_cov_ratio=0.02, clip_cov_lb=-0.05, clip_cov_ub=0.4)
    (_, _, m_ours), (_, _, m_ref) = _both("clip_cov", "clip_cov", "token-mean", dict(clip_ratio_low=0.2,
                                          clip_ratio_high=0.28, **settings), _verl_config(**settings),
                                          old, log_prob, adv, mask)
    n = max(1, int(0.02 * float(mask.sum())))
    assert m_ours["pg_covfrac"] * float(mask.sum()) == pytest.approx(n)
    assert m_ref["actor/pg_clipfrac"] * float(mask.sum()) == pytest.approx(n, abs=1e-4)
