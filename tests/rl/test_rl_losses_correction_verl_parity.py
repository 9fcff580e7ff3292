"""Every registered policy loss x every rollout correction, side by side with verl 0.9.1's loss
given the same correction weights and mask (``rollout_is_weights=``, the corrected ``response_mask``).

Enumerated from the registries: a loss registered later must be listed in :data:`VERL_COUNTERPARTS`
or, with the reason, in :data:`NO_VERL_COUNTERPART` (``test_every_loss_is_listed``), and every
correction (alone, and each token-level one chained with ``rejection``) runs against it. The
correction's own weights and masks are compared with verl's ``rollout_corr_helper`` in
tests/rl/test_rl_correction_verl_parity.py; here the question is how each loss applies them:
verl multiplies each token's loss by its weight, except ``geo_mean``, which takes one weight per
response, the geometric mean exp(mean_t log(c_t + 1e-10)) (ours by default:
``geo_mean_correction="geometric"``). verl is an optional test dependency (skips without it).
"""

from __future__ import annotations

import inspect
import zlib

import pytest
import torch

from echotrain.integrations.verl import verl_core_algos

try:
    verl_algos = verl_core_algos()
except ImportError as exc:
    pytest.skip(f"verl parity tests: {exc}", allow_module_level=True)
from verl.workers.config import ActorConfig, PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

from echotrain.rl import POLICY_LOSSES, compute_policy_loss  # noqa: E402
from echotrain.rl.correction import ROLLOUT_CORRECTIONS, apply_rollout_correction  # noqa: E402

C = 11.0
# verl divides seq-mean-token-mean by length + 1e-8 (and geo_mean's means by count + 1e-8)
TOL = dict(rtol=1e-7, atol=1e-8)

#: loss_mode -> (verl's loss name, what is compared, our settings, verl ActorConfig keywords)
VERL_COUNTERPARTS = {
    "vanilla": ("vanilla", "value+grad", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
                dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    "gspo_token": ("gspo", "value+grad", dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
                   dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    # verl's gspo is the GSPO-token form: the same value, but our gspo's gradient flows through s_i
    "gspo": ("gspo", "value", dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
             dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    "cispo": ("cispo", "value+grad", dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
              dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    "gpg": ("gpg", "value+grad", {}, {}),
    "dro": ("dro", "value+grad", dict(dro_beta=0.3), dict(policy_loss=dict(dro_beta=0.3))),
    "dppo_tv": ("dppo_tv", "value+grad", dict(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=3.0),
                dict(clip_ratio_low=0.05, clip_ratio_high=0.08)),
    "dppo_kl": ("dppo_kl", "value+grad", dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=3.0),
                dict(clip_ratio_low=0.02, clip_ratio_high=0.03)),
    "sapo": ("sapo", "value+grad", dict(tau_pos=1.0, tau_neg=1.05), dict(tau_pos=1.0, tau_neg=1.05)),
    "geo_mean": ("geo_mean", "value+grad", dict(clip_ratio_low=0.4, clip_ratio_high=0.4),
                 dict(clip_ratio_low=0.4, clip_ratio_high=0.4)),
    # every candidate drawn (ratio 1.0), so verl's random draw and our hash draw select the same tokens
    "clip_cov": ("clip_cov", "value+grad", dict(clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.4),
                 dict(policy_loss=dict(clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.4))),
    "kl_cov": ("kl_cov", "value+grad", dict(kl_cov_ratio=0.1, ppo_kl_coef=0.7),
               dict(policy_loss=dict(kl_cov_ratio=0.1, ppo_kl_coef=0.7))),
}
#: loss_mode -> why verl 0.9.1 has nothing to compare it with
NO_VERL_COUNTERPART = {
    "echo": "echotrain's ECHO (batch-ratio clip); verl has no such loss",
    "luspo": "TRL 1.16's loss_type; verl has no luspo",
    "vespo": "TRL 1.16's loss_type; verl has no vespo",
}

#: every correction's settings, chosen so that each truncates, masks or rejects some tokens
CORRECTION_SETTINGS = dict(rollout_is_threshold=1.5, rollout_is_threshold_lower=0.7, behav_imp_weight_cap=1.8,
                           rollout_rs_threshold=1.6, offpolicy_mask_delta=0.05)
_WEIGHTING_TOKEN_LEVEL = [n for n in ROLLOUT_CORRECTIONS if ROLLOUT_CORRECTIONS.info(n)["level"] == "token"
                          and n != "rejection"]
CHAINS = list(ROLLOUT_CORRECTIONS) + [f"{n},rejection" for n in _WEIGHTING_TOKEN_LEVEL]


def _batch(seed, B=12, T=8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0  # a full row and an empty row
    mask = torch.arange(T) < lengths[:, None]
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.01
    log_prob = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    roll = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, log_prob, roll, adv, mask


def _default_agg(loss_mode):
    return inspect.signature(POLICY_LOSSES[loss_mode]).parameters["loss_agg_mode"].default


def _ours(loss_mode, agg, cfg, old, log_prob, roll, adv, mask):
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(loss_mode, old, lp, adv, mask, agg, {**cfg, "norm_constant": C},
                                  rollout_log_prob=roll)
    loss.backward()
    return loss, lp.grad


def _verl(verl_name, agg, verl_kw, old, log_prob, adv, new_mask, weights):
    kw = dict(verl_kw)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_c=3.0,
                      policy_loss=VerlPolicyLossConfig(**kw.pop("policy_loss", {})),
                      global_batch_info={"loss_scale_factor": C}, **kw)
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = verl_algos.get_policy_loss_fn(verl_name)(old, lp, adv, new_mask.to(torch.float64), loss_agg_mode=agg,
                                                       config=cfg, rollout_is_weights=weights)
    loss.backward()
    return loss, lp.grad


def test_every_loss_is_listed():
    """A newly registered loss must say whether verl has it (and how to configure both) or why not."""
    unlisted = sorted(set(POLICY_LOSSES) - set(VERL_COUNTERPARTS) - set(NO_VERL_COUNTERPART))
    assert not unlisted, f"add {unlisted} to VERL_COUNTERPARTS or NO_VERL_COUNTERPART"
    assert not set(VERL_COUNTERPARTS) & set(NO_VERL_COUNTERPART)
    assert {"token_is", "token_mask", "decoupled"} <= set(_WEIGHTING_TOKEN_LEVEL)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "batch-normalized"])
@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
def test_loss_under_correction_matches_verl(loss_mode, chain, normalize):
    if loss_mode in NO_VERL_COUNTERPART:
        pytest.skip(f"no verl counterpart: {NO_VERL_COUNTERPART[loss_mode]}")
    verl_name, compared, ours_cfg, verl_kw = VERL_COUNTERPARTS[loss_mode]
    old, log_prob, roll, adv, mask = _batch(zlib.crc32(f"{loss_mode}/{chain}".encode()) % 1000)
    cfg = dict(ours_cfg, rollout_correction=chain, rollout_is_batch_normalize=normalize, **CORRECTION_SETTINGS)
    agg = _default_agg(loss_mode)
    corrected = apply_rollout_correction(old, roll, adv, mask, cfg)
    kept, weights = corrected.response_mask, corrected.rollout_is_weights
    assert (torch.where(kept, weights, 1.0) != 1.0).any() or chain == "rejection"  # the weights do something
    ours, g_ours = _ours(loss_mode, agg, cfg, old, log_prob, roll, adv, mask)
    ref, g_ref = _verl(verl_name, agg, verl_kw, old, log_prob, adv, kept, weights)
    if loss_mode == "geo_mean":
        # documented: verl's torch.mean counts every row (empty ones with loss 0): verl = ours x N_nonempty / B
        share = float(kept.any(-1).sum()) / kept.shape[0]
        assert share < 1
        ours, g_ours = ours * share, g_ours * share
    torch.testing.assert_close(ours, ref.to(ours.dtype), **TOL)
    if compared == "value+grad":
        torch.testing.assert_close(g_ours, g_ref, **TOL)


def _geo_mean(weights, setting, A=1.0):
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = old.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES["geo_mean"](old, lp, torch.full((1, 2), A, dtype=torch.float64),
                                        torch.ones(1, 2, dtype=torch.bool),
                                        config={"geo_mean_correction": setting},
                                        rollout_is_weights=torch.tensor([weights], dtype=torch.float64))
    loss.backward()
    return loss.item(), lp.grad


def test_geo_mean_correction_by_hand():
    """Two tokens, no drift, A = 1, token weights [1, 0] (a masked token).

    geometric (verl): w = exp((log(1 + 1e-10) + log(1e-10)) / 2) = 1e-5 (to 1e-15): loss -w,
    gradient -w / 2 per token. token: loss -(1 + 0) / 2 = -0.5, gradient (1 + 0) / 2 x -1/2 = -0.25
    per token (every token's loss is -J_i, whose gradient is J_i / |o| per token)."""
    w = ((1 + 1e-10) * 1e-10) ** 0.5
    value, grad = _geo_mean([1.0, 0.0], "geometric")
    assert value == pytest.approx(-w, rel=1e-12)
    torch.testing.assert_close(grad, torch.full((1, 2), -w / 2, dtype=torch.float64), rtol=1e-12, atol=0)
    value, grad = _geo_mean([1.0, 0.0], "token")
    assert value == -0.5
    torch.testing.assert_close(grad, torch.full((1, 2), -0.25, dtype=torch.float64), rtol=1e-12, atol=0)
    # weights (4, 1): geometric 2, arithmetic 2.5
    assert _geo_mean([4.0, 1.0], "geometric")[0] == pytest.approx(-2.0, rel=1e-9)
    assert _geo_mean([4.0, 1.0], "token")[0] == pytest.approx(-2.5, rel=1e-12)


def test_geo_mean_correction_is_a_declared_loss_setting():
    from echotrain.rl.config import LOSS_SETTINGS, as_policy_loss_config

    assert LOSS_SETTINGS.info("geo_mean_correction")["loss_mode"] == "geo_mean"
    assert as_policy_loss_config(None).geo_mean_correction == "geometric"
    with pytest.raises(ValueError, match="geo_mean_correction='arith' is unknown"):
        as_policy_loss_config({"geo_mean_correction": "arith"})
