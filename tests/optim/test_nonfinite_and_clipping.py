"""Issue 9, cases 1-3: non-finite gradients leave every optimizer untouched; SAM clips unscaled
g_sam with a gradient scaler; SAM's norm follows the parameters' dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from echotrain.optim.adamw4bit import AdamW4bit
from echotrain.optim.finite import GRAD_ABS_LIMIT, first_nonfinite_grad
from echotrain.optim.sam import SAM
from echotrain.optim.late_sam import LateSAM


def _snapshot(params, opt):
    ps = [p.detach().clone() for p in params]
    st = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()}
    return ps, st


def _assert_unchanged(params, opt, snap):
    ps, st = snap
    for p, q in zip(params, ps):
        assert torch.equal(p.detach(), q)
    assert {id(p) for p in opt.state} == set(st)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, st[id(p)][k]) if torch.is_tensor(v) else v == st[id(p)][k], k


@pytest.mark.parametrize("numel", [8192, 100])  # 4-bit path and float32-state path (<= 4096)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -3e19])
def test_adamw4bit_bad_gradient_writes_nothing_and_names_the_parameter(numel, bad):
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(numel))
    b = nn.Parameter(torch.randn(numel // 2, 2))
    opt = AdamW4bit([{"params": [a]}, {"params": [b]}], lr=1e-2, compile=False)
    a.grad, b.grad = torch.randn(numel), torch.randn(numel // 2, 2)
    opt.step()
    snap = _snapshot([a, b], opt)
    a.grad, b.grad = torch.randn(numel), torch.randn(numel // 2, 2)
    b.grad[3, 1] = bad
    with pytest.raises(FloatingPointError, match=rf"param_groups\[1\] param 0 \(shape \({numel // 2}, 2\)\)"):
        opt.step()
    _assert_unchanged([a, b], opt, snap)
    # the caller skips the step and goes on: the next finite step works and is finite
    b.grad = torch.randn(numel // 2, 2)
    opt.step()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert float(opt.state[a]["step"]) == 2.0


def test_adamw4bit_skip_nonfinite_counts_and_skips():
    a = nn.Parameter(torch.ones(8192))
    opt = AdamW4bit([a], lr=1e-2, compile=False, skip_nonfinite=True)
    a.grad = torch.ones(8192)
    opt.step()
    snap = _snapshot([a], opt)
    a.grad[5] = float("nan")
    opt.step()
    _assert_unchanged([a], opt, snap)
    assert opt.skipped_steps == 1


def test_first_nonfinite_grad_threshold_and_order():
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.0, GRAD_ABS_LIMIT, -1.0])  # exactly at the limit: fine
    q.grad = torch.tensor([1.0, 2.0])
    groups = [{"params": [p]}, {"params": [q]}]
    assert first_nonfinite_grad(groups) is None
    q.grad[0] = float("-inf")
    assert first_nonfinite_grad(groups)[:2] == (1, 0)
    p.grad[0] = float("nan")
    assert first_nonfinite_grad(groups)[:2] == (0, 0)  # the first one in group order



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1, 17, 4097, 70001])
def test_first_nonfinite_grad_finds_a_bad_value_anywhere(dtype, numel):
    """The CPU path (one aminmax per gradient) sees NaN / +-Inf / a too large value at the
    first, a middle and the last position (vectorised body and scalar tail)."""
    ok = nn.Parameter(torch.zeros(5, dtype=dtype))
    ok.grad = torch.ones(5, dtype=dtype)
    p = nn.Parameter(torch.zeros(numel, dtype=dtype))
    groups = [{"params": [ok, p]}]
    bad_values = [float("nan"), float("inf"), float("-inf")] + ([-3e19, 3e19] if dtype != torch.float16 else [])
    for pos in sorted({0, numel // 2, numel - 1}):
        for bad in bad_values:
            p.grad = torch.randn(numel).to(dtype)
            assert first_nonfinite_grad(groups) is None
            p.grad[pos] = bad
            assert first_nonfinite_grad(groups)[:2] == (0, 1), (pos, bad)

def _linear(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2).to(dtype)
    x = torch.randn(8, 3, dtype=dtype)
    y = torch.randn(8, 2, dtype=dtype)
    return model, x, y


@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_sam_nan_in_second_pass_raises_with_weights_and_state_unchanged(base):
    model, x, y = _linear()
    opt = SAM(model.parameters(), base, rho=0.05, lr=0.1)
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        loss = ((model(x) - y) ** 2).mean()
        if calls["n"] == 4:  # second pass of the second step
            loss = loss * float("nan")
        loss.backward()
        return loss

    opt.step(closure)
    params = list(model.parameters())
    snap = _snapshot(params, opt)
    with pytest.raises(FloatingPointError, match=r"param_groups\[0\] param 0 \(shape \(2, 3\)\)"):
        opt.step(closure)
    _assert_unchanged(params, opt, snap)
    opt.step(closure)  # goes on
    assert all(torch.isfinite(p).all() for p in params)


def test_late_sam_before_switch_refuses_nan_gradient():
    model, x, y = _linear()
    opt = LateSAM(model.parameters(), "adamw", sam_start=10, lr=0.1)
    loss = ((model(x) - y) ** 2).mean() * float("nan")
    loss.backward()
    params = list(model.parameters())
    snap = _snapshot(params, opt)
    with pytest.raises(FloatingPointError, match="LateSAM"):
        opt.step()
    _assert_unchanged(params, opt, snap)


def _scaler(scale):
    try:
        return torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    except Exception as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"no CPU GradScaler: {err}")


def test_sam_max_grad_norm_with_scaler_equals_fp32_sam():
    # Tiny linear model, SGD base, rho 0.05, clip 0.1: scaler at 1024 must give fp32 SAM's result.
    model, x, y = _linear(1)
    ref = copy.deepcopy(model)

    def make_closure(m, scaler=None):
        def closure():
            loss = ((m(x) - y) ** 2).mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
            return loss
        return closure

    # fp32 reference by hand: g at w; e = rho g/||g||; g_sam at w + e clipped to 0.1; w -= lr g_sam
    with torch.no_grad():
        w = [p.detach().clone() for p in ref.parameters()]
    loss = ((ref(x) - y) ** 2).mean()
    g = torch.autograd.grad(loss, list(ref.parameters()))
    gn = torch.sqrt(sum((t.double() ** 2).sum() for t in g))
    with torch.no_grad():
        for p, t in zip(ref.parameters(), g):
            p.add_(0.05 * t / (gn.float() + 1e-12))
    loss2 = ((ref(x) - y) ** 2).mean()
    g2 = torch.autograd.grad(loss2, list(ref.parameters()))
    n2 = torch.sqrt(sum((t ** 2).sum() for t in g2))
    assert n2 > 0.5  # the clip is active (g_sam norm ~1.1)
    expected = [wi - 0.1 * t * (0.1 / (n2 + 1e-6)) for wi, t in zip(w, g2)]

    plain = copy.deepcopy(model)
    opt_plain = SAM(plain.parameters(), "sgd", rho=0.05, lr=0.1, max_grad_norm=0.1)
    opt_plain.step(make_closure(plain))
    scaled = copy.deepcopy(model)
    scaler = _scaler(1024.0)
    opt_s = SAM(scaled.parameters(), "sgd", rho=0.05, lr=0.1, max_grad_norm=0.1)
    opt_s.step(make_closure(scaled, scaler), grad_scaler=scaler)
    scaler.update()
    assert scaler.get_scale() == 1024.0
    for p, q, e in zip(plain.parameters(), scaled.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=1e-7)


def test_sam_max_grad_norm_scaler_inf_in_first_pass():
    model, x, y = _linear(2)
    w0 = [p.detach().clone() for p in model.parameters()]
    scaler = _scaler(1024.0)
    opt = SAM(model.parameters(), "sgd", rho=0.05, lr=0.1, max_grad_norm=0.1)
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        loss = ((model(x) - y) ** 2).mean() * float("inf")
        scaler.scale(loss).backward()
        return loss

    opt.step(closure, grad_scaler=scaler)
    scaler.update()
    assert calls["n"] == 1  # no perturbation, no second pass
    for p, w in zip(model.parameters(), w0):
        assert torch.equal(p.detach(), w)
    assert scaler.get_scale() == 512.0  # reduced once


def test_sam_rejects_bad_max_grad_norm():
    with pytest.raises(ValueError, match="max_grad_norm"):
        SAM([nn.Parameter(torch.zeros(2))], "sgd", lr=0.1, max_grad_norm=-1.0)


def test_sam_float64_step_is_float64_exact():
    # ||g|| in float64: e = rho g / ||g||, w = w - lr g(w + e) to ~1e-16 (float32 norm: ~5e-10 off)
    torch.manual_seed(3)
    a = torch.randn(7, dtype=torch.float64)
    w = nn.Parameter(torch.randn(7, dtype=torch.float64) * 1.3)
    w0 = w.detach().clone()
    opt = SAM([w], "sgd", rho=0.05, lr=0.1)

    def grad(v):  # loss = 0.5 sum a v^2 + sum sin(v)  ->  g = a v + cos(v)
        return a * v + torch.cos(v)

    def closure():
        loss = (0.5 * a * w**2).sum() + torch.sin(w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    g = grad(w0)
    e = 0.05 * g / (torch.sqrt((g * g).sum()) + 1e-12)
    expected = w0 - 0.1 * grad(w0 + e)
    assert opt.grad_norm().dtype == torch.float64
    assert (w.detach() - expected).abs().max().item() < 1e-15


def test_sam_mixed_dtypes_norm_is_float64():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    q = nn.Parameter(torch.zeros(1))
    opt = SAM([p, q], "sgd", rho=0.05, lr=0.1)
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    q.grad = torch.tensor([12.0])
    n = opt.grad_norm()
    assert n.dtype == torch.float64 and n.item() == 13.0
