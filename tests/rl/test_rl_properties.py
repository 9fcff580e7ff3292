"""Property-based tests (hypothesis) for the invariants of echotrain.rl."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echotrain.rl import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_weights,
    compute_advantages,
    compute_policy_loss,
    compute_step_stats,
    kl_penalty,
    split_micro_batches,
    zero_variance_groups,
)

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def batches(draw, min_b=1):
    B = draw(st.integers(min_b, 10))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    drift = draw(st.sampled_from([0.0, -0.15, 0.15]))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    lp = old + drift + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    gid = torch.randint(0, 3, (B,), generator=g)
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    adv = compute_advantages(rewards, gid).double()
    return {"old_log_prob": old, "log_prob": lp, "advantages": adv, "response_mask": mask, "group_index": gid}


@SETTINGS
@given(
    batch=batches(),
    # every registered loss that declares itself exact under micro-batch splits
    loss_mode=st.sampled_from([m for m in POLICY_LOSSES if POLICY_LOSSES.info(m)["exact"] is True]),
    agg=st.sampled_from(AGG_MODES),
    batch_ratio=st.sampled_from(["geo", "arith"]),
    data=st.data(),
)
def test_micro_batch_accumulation_equals_single_batch(batch, loss_mode, agg, batch_ratio, data):
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, norm_constant=7.0, batch_ratio=batch_ratio, batch_clip_low=0.05)
    B = batch["old_log_prob"].shape[0]
    x = batch["log_prob"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(loss_mode, batch["old_log_prob"], x, batch["advantages"], batch["response_mask"], agg, cfg,
                                  group_index=batch["group_index"])
    loss.backward()
    cuts = sorted(data.draw(st.lists(st.integers(0, B), max_size=3)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [B])]
    mbs = split_micro_batches(batch, sizes)
    step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)
    total, grads = 0.0, []
    for mb in mbs:
        y = mb["log_prob"].clone().requires_grad_(True)
        l_mb, _ = compute_policy_loss(loss_mode, mb["old_log_prob"], y, mb["advantages"], mb["response_mask"], agg, cfg,
                                      group_index=mb["group_index"], step=step)
        l_mb.backward()
        total += l_mb.item()
        grads.append(y.grad)
    assert abs(total - loss.item()) <= 1e-9
    torch.testing.assert_close(torch.cat(grads), x.grad, rtol=0, atol=1e-9)


@SETTINGS
@given(batch=batches(), a=st.floats(0.1, 10), b=st.floats(-5, 5))
def test_grpo_advantages_centred_per_group_and_affine_invariant(batch, a, b):
    gid = batch["group_index"]
    rewards = torch.rand(gid.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(int(gid.sum())))
    adv = compute_advantages(rewards, gid, "grpo", eps=1e-12).double()
    for g in gid.unique():
        assert abs(float(adv[gid == g].sum())) < 1e-5
    adv2 = compute_advantages(a * rewards + b, gid, "grpo", eps=1e-12).double()
    torch.testing.assert_close(adv, adv2, rtol=1e-4, atol=1e-4)
    flat = zero_variance_groups(rewards.round(), gid)
    assert torch.all(compute_advantages(rewards.round(), gid)[flat] == 0)


@SETTINGS
@given(batch=batches(), agg=st.sampled_from(AGG_MODES))
def test_token_weights_are_normalised(batch, agg):
    mask, adv, gid = batch["response_mask"], batch["advantages"], batch["group_index"]
    w = agg_weights(mask, agg, advantages=adv, group_index=gid, norm_constant=1.0)
    per_token = w[:, None] * mask
    lengths = mask.sum(-1)
    if agg in ("token-mean", "seq-mean-token-mean"):
        expected = 1.0 if bool((lengths > 0).any()) else 0.0
        assert abs(float(per_token.sum()) - expected) < 1e-12
    elif agg == "balanced":
        n_groups = len(gid.unique())
        sign = torch.sign(adv) * (lengths > 0)
        for g in gid.unique():
            sel = gid == g
            G = int(sel.sum())
            for s in (1, -1):
                sub = sel & (sign == s)
                expected = int(sub.sum()) / (G * n_groups) if int(lengths[sub].sum()) > 0 else 0.0
                assert abs(float(per_token[sub].sum()) - expected) < 1e-12


@SETTINGS
@given(batch=batches(), batch_ratio=st.sampled_from(["geo", "arith"]), band=st.floats(0.001, 0.3))
def test_echo_rescaled_ratios_keep_token_ratios_and_stay_in_band(echo_token_ratios, batch, batch_ratio, band):
    mask = batch["response_mask"]
    cfg = PolicyLossConfig(batch_ratio=batch_ratio, batch_clip_low=band, batch_clip_high=band)
    rho_t, R, kappa, clipped = echo_token_ratios(batch["log_prob"], batch["old_log_prob"], mask, cfg)
    rho = torch.exp(batch["log_prob"] - batch["old_log_prob"])
    torch.testing.assert_close(rho_t[mask], (kappa * rho)[mask])  # padding holds kappa (rho := 1 there)
    if mask.any():
        m = rho_t[mask].mean() if batch_ratio == "arith" else torch.exp(torch.log(rho_t[mask]).mean())
        assert 1 - band - 1e-9 <= float(m) <= 1 + band + 1e-9
        assert clipped == (not (1 - band <= float(R) <= 1 + band))


@SETTINGS
@given(x=st.floats(-1e4, 1e4), est=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_finite_and_k2_k3_nonnegative_fp32(x, est):
    lp = torch.tensor([0.0], requires_grad=True)
    kl = kl_penalty(lp, torch.tensor([x]), est)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    if est != "k1":
        assert kl.item() >= 0


@SETTINGS
@given(
    log_ratio=st.lists(st.floats(-3, 3), min_size=1, max_size=20),
    data=st.data(),
    c=st.floats(1.01, 10),
)
def test_dual_clip_only_caps_negative_advantages(log_ratio, data, c):
    from echotrain.rl.objectives import ppo_clip_loss

    n = len(log_ratio)
    adv = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n)), dtype=torch.float64)
    rho = torch.tensor(log_ratio, dtype=torch.float64).exp()
    plain, f_plain = ppo_clip_loss(rho, adv, 0.2, 0.28)
    dual, f_dual = ppo_clip_loss(rho, adv, 0.2, 0.28, c)
    assert torch.equal(plain[adv >= 0], dual[adv >= 0])
    neg = adv < 0
    assert torch.all(dual[neg] <= -adv[neg] * c + 1e-12)
    assert torch.equal(dual[neg], torch.minimum(plain[neg], -adv[neg] * c))
    assert not bool((f_plain["high"] & (adv <= 0)).any()) and not bool((f_plain["low"] & (adv >= 0)).any())
    assert torch.equal(f_dual["dual"], neg & (plain > -adv * c))


@SETTINGS
@given(batch=batches(), loss_mode=st.sampled_from(list(POLICY_LOSSES)), garbage=st.floats(-30, 30))
def test_padding_values_never_matter(batch, loss_mode, garbage):
    mask = batch["response_mask"]
    res = []
    for g in (0.0, garbage):
        x = torch.where(mask, batch["log_prob"], batch["log_prob"] + g).requires_grad_(True)
        adv = torch.where(mask, batch["advantages"][:, None].expand_as(mask), g)
        loss, m = compute_policy_loss(loss_mode, batch["old_log_prob"], x, adv, mask, "seq-mean-token-mean")
        loss.backward()
        res.append((loss.item(), x.grad[mask], m))
    assert res[0][0] == res[1][0] and res[0][2] == res[1][2]  # loss and every metric the loss returns
    assert torch.equal(res[0][1], res[1][1])
