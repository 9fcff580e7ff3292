"""Policy losses with hand-computed values and closed-form gradients."""

from __future__ import annotations

import math
import re

import pytest
import torch

from echotrain.rl import AGG_MODES, POLICY_LOSSES, PolicyLossConfig, compute_policy_loss


def _tokens(log_ratios, advs, mask=None, dtype=torch.float64):
    """One sequence per token: (B, 1) tensors with the given log-ratios and advantages."""
    lr = torch.tensor(log_ratios, dtype=dtype)[:, None]
    old = torch.full_like(lr, -1.0)
    lp = (old + lr).requires_grad_(True)
    adv = torch.tensor(advs, dtype=dtype)[:, None]
    mask = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask)[:, None]
    return old, lp, adv, mask


# ---------------------------------------------------------------- vanilla / dual-clip


def test_vanilla_hand_values_and_dual_clip_only_on_negative_advantages():
    rho = [1.5, 0.5, 0.5, 5.0, 5.0]
    A = [1.0, 1.0, -1.0, -1.0, 1.0]
    old, lp, adv, mask = _tokens([math.log(r) for r in rho], A)
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    # l = max(-A rho, -A clip(rho, 0.8, 1.28))
    expected = torch.tensor([-1.28, -0.5, 0.8, 5.0, -1.28], dtype=torch.float64)
    loss, _ = compute_policy_loss("vanilla", old, lp, adv, mask, "seq-mean-token-sum", cfg)
    assert loss.item() == pytest.approx(float(expected.mean()))
    # dual-clip c = 3: only the A < 0, rho = 5 token changes (5 -> 3); the A > 0, rho = 5 one does not
    loss_c, m = compute_policy_loss("vanilla", old, lp, adv, mask, "seq-mean-token-sum", {**cfg, "clip_ratio_c": 3.0})
    expected[3] = 3.0
    assert loss_c.item() == pytest.approx(float(expected.mean()))
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    loss_c.backward()
    # gradient d l / d log pi = -A rho on unclipped tokens, 0 on clipped / capped ones
    expected_grad = torch.tensor([0.0, -0.5, 0.0, 0.0, 0.0], dtype=torch.float64)[:, None] / 5
    torch.testing.assert_close(lp.grad, expected_grad)


def test_clipfrac_respects_advantage_sign_and_counts_valid_tokens_only():
    rho = [1.5, 1.5, 0.5, 0.5, 1.0, 9.0]
    A = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    mask = [True, True, True, True, True, False]  # the masked token would count as "high"
    old, lp, adv, mask_t = _tokens([math.log(r) for r in rho], A, mask)
    _, m = compute_policy_loss("vanilla", old, lp, adv, mask_t, "token-mean", dict(clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert m["pg_clipfrac_high"] == pytest.approx(1 / 5)  # rho 1.5 with A > 0 only
    assert m["pg_clipfrac_low"] == pytest.approx(1 / 5)  # rho 0.5 with A < 0 only
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in rho[:5]) / 5)


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_metrics_never_change_the_loss(loss_mode, monkeypatch):
    """The loss and its gradient are the same bits whether the metrics are computed or not (the
    metrics run under no_grad on the same tensors and must neither modify nor feed them)."""
    import echotrain.rl.objectives as objectives

    old, lp, adv, mask, _ = _ragged(noise=0.3)
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, batch_clip_low=0.05, batch_clip_high=0.05)

    def run():
        x = lp.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(loss_mode, old, x, adv, mask, "token-mean", cfg)
        loss.backward()
        return loss.detach(), x.grad, metrics

    loss_a, grad_a, metrics = run()
    if "pg_clipfrac" in metrics:  # a loss with the clip metrics: the clip flags they read are in use
        assert metrics["pg_clipfrac"] > 0
    monkeypatch.setattr(objectives, "clip_metrics", lambda *a, **k: {})
    loss_b, grad_b, _ = run()
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)


def test_vanilla_loss_and_gradient_hand_values_with_metrics():
    # log-ratios 0.1 / -0.1, A = +1 / -1, band [0.8, 1.28]: both unclipped.
    old, lp, adv, mask = _tokens([0.1, -0.1], [1.0, -1.0])
    loss, m = compute_policy_loss("vanilla", old, lp, adv, mask, "token-mean", dict(clip_ratio_low=0.2, clip_ratio_high=0.28))
    loss.backward()
    r1, r2 = math.exp(0.1), math.exp(-0.1)
    assert loss.item() == pytest.approx((-r1 + r2) / 2, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[-r1 / 2], [r2 / 2]], dtype=torch.float64))
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == pytest.approx(0.0, abs=1e-15)


# ---------------------------------------------------------------- GSPO


def _ragged(seed=0, B=5, T=6, noise=0.2):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 1, 0, 4])[:B]
    mask = torch.arange(T) < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    lp = old + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, 1.0, -1.5], dtype=torch.float64)[:B, None].expand(B, T).clone()
    return old, lp, adv, mask, lengths


WIDE = dict(clip_ratio_low=0.999, clip_ratio_high=100.0)  # no token/sequence clipping


def test_gspo_sequence_ratio_is_exp_of_masked_mean_log_ratio():
    old, lp, adv, mask, lengths = _ragged()
    x = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss("gspo", old, x, adv, mask, "seq-mean-token-mean", WIDE)
    loss.backward()
    s, n = [], 0
    expected_grad = torch.zeros_like(lp)
    nonempty = [i for i in range(5) if lengths[i] > 0]
    for i in nonempty:
        L = int(lengths[i])
        s_i = math.exp(float((lp[i, :L] - old[i, :L]).mean()))
        s.append(-s_i * float(adv[i, 0]))
        expected_grad[i, :L] = -s_i * float(adv[i, 0]) / L / len(nonempty)
    assert loss.item() == pytest.approx(sum(s) / len(nonempty), rel=1e-12)
    torch.testing.assert_close(x.grad, expected_grad)


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_masked_positions_change_neither_loss_nor_gradient(loss_mode, agg):
    old, lp, adv, mask, _ = _ragged()
    gid = torch.tensor([0, 0, 1, 1, 1])
    out = []
    for garbage in (0.0, 3.0, -50.0):
        x = torch.where(mask, lp, lp + garbage).requires_grad_(True)
        o = torch.where(mask, old, old - garbage)
        loss, _ = compute_policy_loss(loss_mode, o, x, adv, mask, agg, dict(clip_ratio_low=0.2, clip_ratio_high=0.28, norm_constant=6.0),
                                 group_index=gid)
        loss.backward()
        assert torch.all(x.grad[~mask] == 0)
        out.append((loss.detach(), x.grad))
    for loss, grad in out[1:]:
        torch.testing.assert_close(loss, out[0][0])
        torch.testing.assert_close(grad, out[0][1])


def test_gspo_token_has_gspo_value_and_gradient_for_sequence_advantages():
    old, lp, adv, mask, _ = _ragged(seed=1)
    res = {}
    for mode in ("gspo", "gspo_token"):
        x = lp.clone().requires_grad_(True)
        loss, _ = compute_policy_loss(mode, old, x, adv, mask, "seq-mean-token-mean", WIDE)
        loss.backward()
        res[mode] = (loss.detach(), x.grad)
    torch.testing.assert_close(res["gspo"][0], res["gspo_token"][0])
    torch.testing.assert_close(res["gspo"][1], res["gspo_token"][1])


@pytest.mark.parametrize("loss_mode", ["gspo", "gspo_token"])
def test_gspo_clipped_sequence_gets_no_gradient(loss_mode):
    """A sequence whose s_i is outside the band on its advantage's side (s > 1 + eps_high with
    A > 0, s < 1 - eps_low with A < 0) gets exactly 0 gradient on every token; the others get
    the unclipped GSPO gradient -s_i A_i / (|o_i| n) per token (seq-mean-token-mean)."""
    old, lp, adv, mask, lengths = _ragged(noise=0.5)
    x = lp.clone().requires_grad_(True)
    cfg = dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    loss, m = compute_policy_loss(loss_mode, old, x, adv, mask, "seq-mean-token-mean", cfg)
    loss.backward()
    nonempty = [i for i in range(5) if lengths[i] > 0]
    clipped = []
    for i in nonempty:
        L, A = int(lengths[i]), float(adv[i, 0])
        s_i = math.exp(float((lp[i, :L] - old[i, :L]).mean()))
        is_clipped = (A > 0 and s_i > 1 + 4e-4) or (A < 0 and s_i < 1 - 3e-4)
        clipped.append(is_clipped)
        expected = 0.0 if is_clipped else -s_i * A / L / len(nonempty)
        torch.testing.assert_close(x.grad[i, :L], torch.full((L,), expected, dtype=torch.float64))
    assert any(clipped) and not all(clipped)  # both kinds are present
    assert torch.all(x.grad[~mask] == 0)
    assert m["pg_clipfrac"] > 0


# ---------------------------------------------------------------- ECHO


def _echo_batch(drift, seed=2, noise=0.2):
    old, lp, adv, mask, _ = _ragged(seed=seed, noise=noise)
    return old, lp + drift * mask, adv, mask


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_echo_equals_vanilla_token_mean_inside_the_band(batch_ratio, on_policy):
    old, lp, adv, mask = _echo_batch(0.0)
    if on_policy:
        lp = old.clone()
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, batch_ratio=batch_ratio, batch_clip_low=0.5, batch_clip_high=0.5)
    res = {}
    for mode in ("echo", "vanilla"):
        x = lp.clone().requires_grad_(True)
        loss, m = compute_policy_loss(mode, old, x, adv, mask, "token-mean", cfg)
        loss.backward()
        res[mode] = (loss.detach(), x.grad, m)
    assert res["echo"][2]["echo/batch_clipped"] == 0.0 and res["echo"][2]["echo/kappa"] == 1.0
    if on_policy:
        assert res["echo"][2]["echo/R_batch"] == 1.0
    else:
        assert res["echo"][2]["pg_clipfrac"] > 0  # the token clip is active and identical
    torch.testing.assert_close(res["echo"][0], res["vanilla"][0], rtol=0, atol=0)
    torch.testing.assert_close(res["echo"][1], res["vanilla"][1], rtol=0, atol=0)


@pytest.mark.parametrize("drift,bound", [(-0.1, 0.98), (0.1, 1.02)])
@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
def test_echo_clipped_gradient_matches_closed_form_with_baseline(batch_ratio, drift, bound):
    """Token clip off, token-mean, R clipped at ``bound``: dJ/dlog pi = (kappa/N)(rho A - baseline).

    arith: baseline = rho * b with b = L/R (L = mean rho A, R = mean rho) -- design page.
    geo:   baseline = L (d log R / d log rho = 1/N for every token).
    """
    old, lp, adv, mask = _echo_batch(drift)
    cfg = dict(**WIDE, batch_ratio=batch_ratio, batch_clip_low=0.02, batch_clip_high=0.02)
    x = lp.clone().requires_grad_(True)
    loss, m = compute_policy_loss("echo", old, x, adv, mask, "token-mean", cfg)
    loss.backward()
    rho = torch.exp(lp - old)[mask]
    A = adv[mask]
    N = rho.numel()
    R = rho.mean() if batch_ratio == "arith" else torch.exp((lp - old)[mask].mean())
    kappa = bound / R
    assert m["echo/batch_clipped"] == 1.0
    assert m["echo/R_batch"] == pytest.approx(float(R)) and m["echo/kappa"] == pytest.approx(float(kappa))
    L = (rho * A).mean()
    if batch_ratio == "arith":
        dJ = kappa / N * rho * (A - L / R)
    else:
        dJ = kappa / N * (rho * A - L)
    assert loss.item() == pytest.approx(-float(kappa * L), rel=1e-12)
    torch.testing.assert_close(x.grad[mask], -dJ, rtol=1e-10, atol=1e-14)
    assert torch.all(x.grad[~mask] == 0)
    # detach_kappa: a uniform rescaling of the token gradient, no baseline
    y = lp.clone().requires_grad_(True)
    loss_d, _ = compute_policy_loss("echo", old, y, adv, mask, "token-mean", {**cfg, "detach_kappa": True})
    loss_d.backward()
    torch.testing.assert_close(y.grad[mask], -kappa / N * rho * A, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
def test_echo_preserves_ratios_between_tokens_and_hits_the_bound(echo_token_ratios, batch_ratio):
    old, lp, adv, mask = _echo_batch(-0.3)
    cfg = PolicyLossConfig(batch_ratio=batch_ratio, batch_clip_low=0.05)
    rho_t, R, kappa, clipped = echo_token_ratios(lp, old, mask, cfg)
    rho = torch.exp(lp - old)
    assert clipped and float(R) < 0.95
    torch.testing.assert_close((rho_t / rho)[mask], torch.full_like(rho[mask], float(kappa)))
    mean = rho_t[mask].mean() if batch_ratio == "arith" else torch.exp(torch.log(rho_t[mask]).mean())
    assert float(mean) == pytest.approx(0.95, rel=1e-12)  # the batch mean of rho~ is R_bar


# ---------------------------------------------------------------- validation


def _valid():
    old, lp, adv, mask, _ = _ragged()
    return old, lp, adv, mask


def test_unknown_loss_mode_lists_valid_ones():
    with pytest.raises(ValueError, match=re.escape(f"loss_mode='ppo' is unknown; valid: {sorted(POLICY_LOSSES)}")):
        compute_policy_loss("ppo", *_valid())
    assert {"vanilla", "gspo", "gspo_token", "echo"} <= set(POLICY_LOSSES)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda o, l, a, m: (o, l[:, :3], a, m), "old_log_prob has shape"),
        (lambda o, l, a, m: (o, l, a[:3], m), "advantages has shape"),
        (lambda o, l, a, m: (o, torch.where(m, l.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"), dtype=l.dtype)), l), a, m), "log_prob has 1 NaN/Inf"),
        (lambda o, l, a, m: (o.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("-inf"), dtype=o.dtype)), l, a, m), "old_log_prob has 1 NaN/Inf"),
        (lambda o, l, a, m: (o, l, a.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"), dtype=a.dtype)), m), "advantages has 1 NaN/Inf"),
        (lambda o, l, a, m: (o, l, a, m.double() * 2), "response_mask must be boolean or hold only 0/1"),
        (lambda o, l, a, m: (o, l, a, m.double() * 0.5), "response_mask must be boolean or hold only 0/1"),
        (lambda o, l, a, m: (o, l.tolist(), a, m), "log_prob must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compute_policy_loss("vanilla", *mutate(*_valid()))


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_inf_log_probs_at_padding_are_fine(loss_mode):
    """-inf log-probs at padding give the same loss, gradient and metrics as finite padding, and
    exactly 0 gradient there."""
    old, lp, adv, mask = _valid()
    out = []
    for pad in (None, float("-inf")):
        x = (lp if pad is None else torch.where(mask, lp, pad)).clone().requires_grad_(True)
        o = old if pad is None else torch.where(mask, old, pad)
        loss, m = compute_policy_loss(loss_mode, o, x, adv, mask)
        loss.backward()
        assert torch.all(x.grad[~mask] == 0)
        out.append((loss.detach(), x.grad, m))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=0)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=0)
    assert out[1][2] == out[0][2]


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c must be > 1"),
        ({"clip_ratio_c": 0.5}, "clip_ratio_c must be > 1"),
        ({"batch_ratio": "harmonic"}, r"batch_ratio='harmonic' is unknown; valid: \['arith', 'geo'\]"),
        ({"clip_ratio": 0.2}, r"unknown PolicyLossConfig key\(s\) \['clip_ratio'\]"),
        ({"clip_ratio_low": -0.1}, "clip_ratio_low must be a finite float >= 0"),
        ({"ba_scope": "global"}, "ba_scope='global' is unknown"),
        ({"log_ratio_clamp": float("inf")}, "log_ratio_clamp must be finite and > 0"),  # was accepted
    ],
)
def test_bad_config_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        compute_policy_loss("vanilla", *_valid(), "token-mean", cfg)
    if "clip_ratio_c" in cfg:
        with pytest.raises(ValueError, match=match):
            PolicyLossConfig(**cfg)


def test_balanced_needs_group_ids_and_integer_ids():
    with pytest.raises(ValueError, match="needs advantages and group_index"):
        compute_policy_loss("vanilla", *_valid(), "balanced")
    with pytest.raises(TypeError, match="group_index must be an integer tensor"):
        compute_policy_loss("vanilla", *_valid(), "balanced", group_index=torch.zeros(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_low_precision_inputs_work_and_keep_their_dtype(loss_mode, agg, dtype):
    old, lp, adv, mask, _ = _ragged(noise=0.3)
    old, lp, adv = old.to(dtype), (lp - 0.1).to(dtype).requires_grad_(True), adv.to(dtype)
    cfg = dict(clip_ratio_c=3.0, norm_constant=6.0)
    loss, m = compute_policy_loss(loss_mode, old, lp, adv, mask, agg, cfg, group_index=torch.tensor([0, 0, 1, 1, 1]))
    loss.backward()
    assert loss.dtype == dtype and lp.grad.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    ref, _ = compute_policy_loss(loss_mode, old.double(), lp.detach().double(), adv.double(), mask, agg, cfg,
                                 group_index=torch.tensor([0, 0, 1, 1, 1]))
    # bfloat16 carries 8 significant bits (unit roundoff 2^-8): the value must be within 2^-7 of
    # the float64 value of the same (rounded) inputs, relative to the size of the summed terms
    # (max(1, |loss|, |loss with |A||): the sum modes add terms that cancel); float32 to 1e-6.
    size, _ = compute_policy_loss(loss_mode, old.double(), lp.detach().double(), adv.double().abs(), mask, agg, cfg,
                                  group_index=torch.tensor([0, 0, 1, 1, 1]))
    tol = (2**-7 if dtype == torch.bfloat16 else 1e-6) * max(1.0, abs(ref.item()), abs(size.item()))
    assert abs(loss.item() - ref.item()) <= tol


# ---------------------------------------------------------------- review regressions


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "balanced"])
@pytest.mark.parametrize(
    "loss_mode,extra",
    [(m, {}) for m in POLICY_LOSSES if m != "echo"] + [("echo", {"batch_ratio": "geo"}), ("echo", {"batch_ratio": "arith"})],
)
def test_non_finite_padding_reaches_neither_loss_nor_any_gradient(loss_mode, extra, agg, garbage):
    """NaN/Inf at padding of log_prob, old_log_prob and advantages: same loss and gradient as
    clean padding, and exactly 0 gradient at padding (a NaN there would reach the logits).
    Before the fix: ECHO with the batch clip active gave NaN gradients on *valid* tokens
    (0 * NaN through kappa), GSPO too for Inf advantages, vanilla NaN at padding."""
    old, lp, adv, mask = _echo_batch(-0.1)  # R ~ 0.9: the default batch band clips
    cfg = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, **extra}
    gid = torch.tensor([0, 0, 1, 1, 1])
    out = []
    for g in (0.0, garbage):
        dirty = (lambda t: torch.where(mask, t, g)) if g != 0.0 else (lambda t: t.clone())
        x = dirty(lp).detach().requires_grad_(True)
        loss, m = compute_policy_loss(loss_mode, dirty(old), x, dirty(adv), mask, agg, cfg, group_index=gid)
        loss.backward()
        out.append((loss.detach(), x.grad, m))
    if loss_mode == "echo":
        assert out[0][2]["echo/batch_clipped"] == 1.0
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=0)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=0)
    assert torch.all(out[1][1][~mask] == 0)
    assert out[1][2] == out[0][2]  # every metric the loss returns (ppo_kl, clip fractions, ...) unchanged


def test_non_finite_padding_in_micro_batched_echo_step():
    """The pre-pass sum S of ECHO's kappa gradient must ignore padding too (was NaN)."""
    from echotrain.rl import compute_step_stats, split_micro_batches

    old, lp, adv, mask = _echo_batch(-0.1)
    cfg = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    x = lp.clone().requires_grad_(True)
    ref, _ = compute_policy_loss("echo", old, x, adv, mask, "token-mean", cfg)
    ref.backward()
    nan = float("nan")
    batch = {"old_log_prob": torch.where(mask, old, nan), "log_prob": torch.where(mask, lp, nan),
             "advantages": torch.where(mask, adv, float("inf")), "response_mask": mask}
    mbs = split_micro_batches(batch, [2, 3])
    step = compute_step_stats(mbs, loss_mode="echo", loss_agg_mode="token-mean", config=cfg)
    assert step.loss_stats.clipped and math.isfinite(step.loss_stats.grad_sum) and step.loss_stats.grad_sum != 0
    grads = []
    for mb in mbs:
        y = mb["log_prob"].clone().requires_grad_(True)
        loss, _ = compute_policy_loss("echo", mb["old_log_prob"], y, mb["advantages"], mb["response_mask"],
                                      "token-mean", cfg, step=step)
        loss.backward()
        grads.append(y.grad)
    torch.testing.assert_close(torch.cat(grads), x.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
def test_echo_batch_ratio_is_not_rounded_to_bfloat16(batch_ratio):
    """bf16 spacing near 1 is 2^-8..2^-7, coarser than the default band 0.01: R must be summed
    in float64, or the clip decision and kappa are wrong. Before the fix, on this batch geo R
    came out 0.98828 with kappa 1.0078 (exact, from the same bf16 values: 0.98913, kappa
    1.00088), and arith R clipped at 0.98828 although the exact 0.99041 is inside the band."""
    g = torch.Generator().manual_seed(0)
    B, T = 64, 32
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g)
    lp = old - 0.01 + 0.05 * torch.randn(B, T, generator=g)
    old, lp, adv = old.bfloat16(), lp.bfloat16(), adv.bfloat16()
    cfg = {"batch_ratio": batch_ratio}
    loss, m = compute_policy_loss("echo", old, lp.clone().requires_grad_(True), adv, mask, "token-mean", cfg)
    _, m64 = compute_policy_loss("echo", old.double(), lp.double(), adv.double(), mask, "token-mean", cfg)
    assert loss.dtype == torch.bfloat16
    # what is left is the per-token bf16 rounding of log rho (and of rho for arith): ~1e-5 / 3e-4
    assert m["echo/R_batch"] == pytest.approx(m64["echo/R_batch"], rel=1e-3)
    assert m["echo/batch_clipped"] == m64["echo/batch_clipped"] == (1.0 if batch_ratio == "geo" else 0.0)
    assert m["echo/kappa"] == pytest.approx(m64["echo/kappa"], rel=1e-4)
