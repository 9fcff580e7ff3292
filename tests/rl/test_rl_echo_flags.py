"""ECHO's open design choices as flags: ``echo_pessimistic``, ``echo_token_clip`` (ppo / none /
truncate) with ``echo_token_cap``, for both ``batch_ratio`` kinds (design/objectives.md §4).

Values are hand-computed (the issue-12 case) or closed-form gradients; exactness over random
micro-batch splits follows tests/rl/test_rl_stepwise.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from echotrain.rl import AGG_MODES, PolicyLossConfig, compute_policy_loss, compute_step_stats, split_micro_batches

BAND = dict(batch_clip_low=0.01, batch_clip_high=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28)


def _uniform_case(adv: float, rho: float, T: int = 4):
    """One response of T tokens, every advantage ``adv``, every ratio ``rho`` (so R = rho, geo and arith)."""
    old = torch.full((1, T), -1.0, dtype=torch.float64)
    log_prob = (old + math.log(rho)).requires_grad_(True)
    return old, log_prob, torch.full((1, T), adv, dtype=torch.float64), torch.ones(1, T, dtype=torch.bool)


def _loss_and_grad(loss_mode, cfg, old, log_prob, adv, mask, agg="token-mean"):
    log_prob = log_prob.detach().clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(loss_mode, old, log_prob, adv, mask, agg, cfg)
    loss.backward()
    return float(loss.detach()), log_prob.grad, metrics


# The issue-12 case: A = -1, rho = 1.1 on 4 tokens, band 0.01 -> R = 1.1, kappa = 1.01 / 1.1.
# Vanilla (token clip inactive: 1.1 < 1.28): loss = 1.1, d loss / d log_prob_t = rho / N = 1.1 / 4 = 0.275.
# ECHO without pessimism: loss = kappa * rho = 1.01, gradient exactly 0 (kappa * rho = R_bar * rho / R is
# constant when every rho moves together). With pessimism the unrescaled branch (1.1 >= 1.01) is chosen:
# vanilla's loss and gradient. Truncate with c = 1.05: l(rho) = min(1.1, 1.05) = 1.05, gradient c / N = 0.2625.
ISSUE_CASES = [
    # (loss_mode, overrides, loss, grad per token)
    ("vanilla", {}, 1.1, 0.275),
    ("echo", {}, 1.01, 0.0),
    ("echo", dict(echo_pessimistic=True), 1.1, 0.275),
    ("echo", dict(echo_token_clip="none"), 1.01, 0.0),
    ("echo", dict(echo_token_clip="none", echo_pessimistic=True), 1.1, 0.275),
    ("echo", dict(echo_token_clip="truncate"), 1.01, 0.0),
    ("echo", dict(echo_token_clip="truncate", echo_pessimistic=True), 1.1, 0.275),
    ("echo", dict(echo_token_clip="truncate", echo_token_cap=1.05), 1.01, 0.0),
    ("echo", dict(echo_token_clip="truncate", echo_token_cap=1.05, echo_pessimistic=True), 1.05, 0.2625),
    ("echo", dict(detach_kappa=True, echo_pessimistic=True), 1.1, 0.275),
    # detached kappa, no pessimism: uniform rescaling, gradient kappa * rho / N = 1.01 / 4
    ("echo", dict(detach_kappa=True), 1.01, 0.2525),
]


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
@pytest.mark.parametrize("loss_mode,overrides,loss_ref,grad_ref", ISSUE_CASES)
def test_issue_case_every_advantage_minus_one_every_ratio_1_1(loss_mode, overrides, loss_ref, grad_ref, batch_ratio):
    cfg = {**BAND, "batch_ratio": batch_ratio, **overrides}
    loss, grad, metrics = _loss_and_grad(loss_mode, cfg, *_uniform_case(-1.0, 1.1))
    assert loss == pytest.approx(loss_ref, abs=1e-12)
    torch.testing.assert_close(grad, torch.full_like(grad, grad_ref), rtol=0, atol=1e-12)
    if loss_mode == "echo":
        assert metrics["echo/batch_clipped"] == 1.0
        assert metrics["echo/R_batch"] == pytest.approx(1.1, abs=1e-12)
        if overrides.get("echo_pessimistic"):
            assert metrics["pg_echo_unscaled_frac"] == 1.0


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
@pytest.mark.parametrize("token_clip", ["ppo", "none", "truncate"])
@pytest.mark.parametrize(
    "adv,rho,loss_pess,grad_pess",
    [
        # R above the band, A > 0: kappa < 1 lowers the surrogate -> rescaled branch, loss -1.01, gradient 0
        (1.0, 1.1, -1.01, 0.0),
        # R below the band, A > 0: kappa = 0.99 / 0.9 > 1 would raise it -> unrescaled: loss -0.9, grad -0.9 / 4
        (1.0, 0.9, -0.9, -0.225),
        # R below the band, A < 0: kappa > 1 lowers it -> rescaled: loss 0.99, gradient 0
        (-1.0, 0.9, 0.99, 0.0),
    ],
)
def test_pessimism_takes_the_lower_surrogate(adv, rho, loss_pess, grad_pess, token_clip, batch_ratio):
    cfg = {**BAND, "batch_ratio": batch_ratio, "echo_token_clip": token_clip, "echo_pessimistic": True}
    loss, grad, _ = _loss_and_grad("echo", cfg, *_uniform_case(adv, rho))
    assert loss == pytest.approx(loss_pess, abs=1e-12)
    torch.testing.assert_close(grad, torch.full_like(grad, grad_pess), rtol=0, atol=1e-12)


def _closed_form(batch, cfg: PolicyLossConfig):
    """Token-mean loss and d loss / d log_prob for echo_token_clip in {none, truncate}, by hand.

    m(x) = x (none) or min(x, c) (truncate): the surrogate of a token is A m(x) and its gradient
    A m(x) d log x. With u_t = pessimistic and A m(rho) <= A m(kappa rho) (the unrescaled branch):
    J = (1/N) sum_t A_t m(x_t), x_t = rho_t if u_t else kappa rho_t, and
    dJ/dlog pi_s = (1/N) A_s m(x_s) + (1/N) sum_{t: not u_t} A_t m(kappa rho_t) * dlog kappa/dlog pi_s,
    dlog kappa/dlog pi_s = -dlog R/dlog pi_s = -1/N (geo) or -rho_s / (N R) (arith), when R clips.
    """
    mask = batch["response_mask"]
    rho = torch.exp(batch["log_prob"].detach() - batch["old_log_prob"])[mask]
    A = batch["advantages"][mask]
    N = rho.numel()
    R = torch.exp(torch.log(rho).mean()) if cfg.batch_ratio == "geo" else rho.mean()
    R_bar = R.clamp(1 - cfg.batch_clip_low, 1 + cfg.batch_clip_high)
    clipped = bool(R_bar != R)
    kappa = R_bar / R

    def m(x):
        return x if cfg.echo_token_clip == "none" else torch.clamp(x, max=cfg.echo_token_cap)

    u = (A * m(rho) <= A * m(kappa * rho)) if (cfg.echo_pessimistic and clipped) else torch.zeros_like(A, dtype=bool)
    val = torch.where(u, A * m(rho), A * m(kappa * rho))
    J = val.sum() / N
    dlogk = (-torch.ones_like(rho) / N if cfg.batch_ratio == "geo" else -rho / (N * R)) if clipped else 0 * rho
    if cfg.detach_kappa:
        dlogk = 0 * rho
    grad = val / N + (torch.where(u, 0, A * m(kappa * rho)).sum() / N) * dlogk
    full = torch.zeros_like(batch["log_prob"], dtype=torch.float64)
    full[mask] = -grad
    return -float(J), full, u


@pytest.mark.parametrize("batch_ratio", ["geo", "arith"])
@pytest.mark.parametrize("token_clip", ["none", "truncate"])
@pytest.mark.parametrize("pessimistic", [False, True])
@pytest.mark.parametrize("drift", [-0.1, 0.0, 0.1], ids=["below", "inband", "above"])
def test_closed_form_gradient_for_mixed_batches(batch_factory, drift, pessimistic, token_clip, batch_ratio):
    band = 0.01 if drift else 0.5  # drift 0: a wide band keeps R inside (kappa = 1, no kappa gradient)
    cfg = PolicyLossConfig(batch_clip_low=band, batch_clip_high=band, batch_ratio=batch_ratio,
                           echo_token_clip=token_clip, echo_pessimistic=pessimistic, echo_token_cap=1.1)
    batch = batch_factory(seed=5, B=8, T=6, group_size=4, drift=drift, noise=0.2)
    loss, grad, metrics = _loss_and_grad("echo", cfg, batch["old_log_prob"], batch["log_prob"], batch["advantages"],
                                         batch["response_mask"])
    ref_loss, ref_grad, u = _closed_form(batch, cfg)
    assert metrics["echo/batch_clipped"] == float(drift != 0)
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    if pessimistic and drift:  # the case really mixes both branches
        assert 0 < float(u.double().mean()) < 1
        assert metrics["pg_echo_unscaled_frac"] == pytest.approx(float(u.double().mean()))
    if token_clip == "truncate":
        assert metrics["pg_echo_truncfrac"] > 0  # some rho~ exceed the cap 1.1


def test_truncate_gradient_never_vanishes_unlike_the_ppo_clip():
    # A > 0, rho = 1.5 inside a wide batch band: PPO clip (1.28) gives gradient 0, truncate at c = 1.2 gives c A / N
    old, log_prob, adv, mask = _uniform_case(1.0, 1.5, T=2)
    cfg = dict(batch_clip_low=0.9, batch_clip_high=0.9)
    loss, grad, m = _loss_and_grad("echo", {**cfg, "clip_ratio_high": 0.28}, old, log_prob, adv, mask)
    assert loss == pytest.approx(-1.28) and float(grad.abs().max()) == 0.0 and m["pg_clipfrac_high"] == 1.0
    loss, grad, m = _loss_and_grad("echo", {**cfg, "echo_token_clip": "truncate", "echo_token_cap": 1.2}, old, log_prob,
                                   adv, mask)
    assert loss == pytest.approx(-1.2, abs=1e-12)
    torch.testing.assert_close(grad, torch.full_like(grad, -0.6), rtol=0, atol=1e-12)
    assert m["pg_clipfrac"] == 0.0 and m["pg_echo_truncfrac"] == 1.0
    loss, grad, m = _loss_and_grad("echo", {**cfg, "echo_token_clip": "none"}, old, log_prob, adv, mask)
    assert loss == pytest.approx(-1.5, abs=1e-12)
    torch.testing.assert_close(grad, torch.full_like(grad, -0.75), rtol=0, atol=1e-12)


def test_defaults_are_todays_echo(batch_factory):
    """The flags' defaults (ppo, not pessimistic) give exactly the ECHO loss and gradient of before."""
    assert (PolicyLossConfig().echo_token_clip, PolicyLossConfig().echo_pessimistic) == ("ppo", False)
    batch = batch_factory(seed=2, B=8, T=6, drift=-0.1, noise=0.2)
    a = _loss_and_grad("echo", {}, batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"])
    b = _loss_and_grad("echo", dict(echo_token_cap=1.5), batch["old_log_prob"], batch["log_prob"],
                       batch["advantages"], batch["response_mask"])  # cap unused by "ppo"
    assert a[0] == b[0] and torch.equal(a[1], b[1])


FLAG_GRID = list(itertools.product(["geo", "arith"], ["ppo", "none", "truncate"], [False, True]))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("batch_ratio,token_clip,pessimistic", FLAG_GRID,
                         ids=[f"{r}-{c}-{'pess' if p else 'sym'}" for r, c, p in FLAG_GRID])
def test_random_micro_batch_splits_are_exact_for_every_flag(batch_factory, batch_ratio, token_clip, pessimistic, agg,
                                                            dtype, tol):
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, norm_constant=9.0, batch_ratio=batch_ratio,
               echo_token_clip=token_clip, echo_pessimistic=pessimistic, echo_token_cap=1.1, clip_ratio_c=1.5)
    batch = batch_factory(seed=3, B=12, T=6, group_size=4, drift=-0.1, noise=0.2, dtype=dtype)
    log_prob = batch["log_prob"].detach().clone().requires_grad_(True)
    ref_loss, ref_m = compute_policy_loss("echo", batch["old_log_prob"], log_prob, batch["advantages"],
                                          batch["response_mask"], agg, cfg, group_index=batch["group_index"])
    ref_loss.backward()
    assert ref_m["echo/batch_clipped"] == 1.0
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        cuts = sorted(torch.randint(0, 13, (3,), generator=g).tolist())
        mbs = split_micro_batches(batch, [b - a for a, b in zip([0] + cuts, cuts + [12])])
        step = compute_step_stats(mbs, loss_mode="echo", loss_agg_mode=agg, config=cfg)
        total, grads = 0.0, []
        for mb in mbs:
            lp = mb["log_prob"].detach().clone().requires_grad_(True)
            loss, _ = compute_policy_loss("echo", mb["old_log_prob"], lp, mb["advantages"], mb["response_mask"], agg,
                                          cfg, group_index=mb["group_index"], step=step)
            loss.backward()
            total += float(loss.detach())
            grads.append(lp.grad)
        assert total == pytest.approx(float(ref_loss.detach()), abs=tol)
        torch.testing.assert_close(torch.cat(grads), log_prob.grad, rtol=0, atol=tol)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(echo_token_clip="clip"), "echo_token_clip='clip' is unknown; valid: \\['none', 'ppo', 'truncate'\\]"),
        (dict(echo_token_cap=0.5), "echo_token_cap must be a finite float >= 1"),
        (dict(echo_token_cap=float("inf")), "echo_token_cap must be a finite float >= 1"),
        (dict(echo_pessimistic="yes"), "echo_pessimistic must be a bool"),
    ],
)
def test_bad_flag_values_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**overrides)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("token_clip", ["ppo", "none", "truncate"])
def test_pessimistic_loss_bounds_both_branches(batch_factory, seed, agg, token_clip):
    """Per token l_pess = max(l(rho), l(kappa rho)) and the aggregation weights are >= 0, so the
    pessimistic loss is >= the symmetric ECHO loss and >= the unrescaled one (vanilla for ppo)."""
    batch = batch_factory(seed=seed, B=8, T=6, drift=[-0.1, 0.1][seed % 2], noise=0.3)
    args = (batch["old_log_prob"], batch["log_prob"].detach(), batch["advantages"], batch["response_mask"], agg)
    base = dict(norm_constant=9.0, echo_token_clip=token_clip, echo_token_cap=1.2)
    kw = dict(group_index=batch["group_index"])
    pess, m = compute_policy_loss("echo", *args, {**base, "echo_pessimistic": True}, **kw)
    sym, _ = compute_policy_loss("echo", *args, base, **kw)
    unscaled, _ = compute_policy_loss("echo", *args, {**base, "batch_clip_low": 0.99, "batch_clip_high": 100.0}, **kw)
    assert m["echo/batch_clipped"] == 1.0
    assert float(pess) >= max(float(sym), float(unscaled)) - 1e-12
    assert float(pess) > float(sym) and 0 < m["pg_echo_unscaled_frac"] < 1  # both branches are taken somewhere
    if token_clip == "ppo":
        vanilla, _ = compute_policy_loss("vanilla", *args, {"norm_constant": 9.0}, **kw)
        assert float(unscaled) == pytest.approx(float(vanilla), abs=1e-12)
