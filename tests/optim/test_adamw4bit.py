"""Tests of AdamW4bit (echotrain.optim.adamw4bit) with real values."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit
from echotrain.optim.registry import build_optimizer


def _opt(params, **kw):
    kw.setdefault("compile", False)
    return AdamW4bit(params, **kw)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


# ------------------------------------------------------------------------------ weight decay


@pytest.mark.parametrize("numel", [100, 8192])  # the float32-state path and the 4-bit path
def test_one_decoupled_decay_step(numel):
    p = torch.nn.Parameter(torch.ones(numel))
    q = torch.nn.Parameter(torch.ones(numel))
    opt = _opt([{"params": [p], "weight_decay": 0.1}, {"params": [q], "weight_decay": 0.0}], lr=0.1)
    p.grad = torch.zeros(numel)
    q.grad = torch.zeros(numel)
    opt.step()
    assert torch.equal(p.detach(), torch.full((numel,), 0.99))  # 1 * (1 - 0.1 * 0.1)
    assert torch.equal(q.detach(), torch.ones(numel))  # wd = 0: untouched


def test_lambda_lr_halving_applies_to_all_groups():
    a = torch.nn.Parameter(torch.ones(8192))
    b = torch.nn.Parameter(torch.ones(10))
    opt = _opt([{"params": [a], "lr": 0.2}, {"params": [b], "lr": 0.1}], weight_decay=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    expected_a, expected_b = torch.ones(8192), torch.ones(10)
    for k in range(3):
        assert [g["lr"] for g in opt.param_groups] == [0.2 * 0.5**k, 0.1 * 0.5**k]
        a.grad, b.grad = torch.zeros(8192), torch.zeros(10)
        opt.step()
        sched.step()
        expected_a *= 1 - 0.2 * 0.5**k * 0.5
        expected_b *= 1 - 0.1 * 0.5**k * 0.5
    torch.testing.assert_close(a.detach(), expected_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.detach(), expected_b, rtol=1e-6, atol=0)


def test_tensor_lr_gives_the_same_step_as_float_lr():
    torch.manual_seed(0)
    w0 = torch.randn(64, 96)
    g = torch.randn(64, 96)
    out = []
    for lr in (0.01, torch.tensor(0.01)):
        w = torch.nn.Parameter(w0.clone())
        opt = _opt([w], lr=lr)
        w.grad = g.clone()
        opt.step()
        out.append(w.detach())
    assert torch.equal(out[0], out[1])


# ------------------------------------------------------------------------------ one step vs the pure quantizers


def _reference_steps(w0, grads, lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.01):
    """AdamW with m and v fake-quantized by the public quant functions after every step."""
    b1, b2 = betas
    w = w0.clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * (g * g)
        denom = v.sqrt() / (1 - b2**t) ** 0.5 + eps
        w = w * (1 - lr * wd) - (lr / (1 - b1**t)) * (m / denom)
        m = quant.dequantize_blockwise(*quant.quantize_blockwise(m, quant.DE_MAP_4BIT), quant.DE_MAP_4BIT, m.shape)
        if w.dim() >= 2:
            v = quant.dequantize_rank1(*quant.quantize_rank1(v, quant.LINEAR_MAP_4BIT), quant.LINEAR_MAP_4BIT, v.shape)
        else:
            v = quant.dequantize_blockwise(*quant.quantize_blockwise(v, quant.LINEAR_MAP_4BIT), quant.LINEAR_MAP_4BIT, v.shape)
    return w, m, v


@pytest.mark.parametrize("shape", [(64, 100), (8, 20, 30), (5000,)])
def test_steps_equal_adamw_with_the_pure_quantizers(shape):
    torch.manual_seed(1)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape) * s for s in (1.0, 0.1, 3.0)]
    w = torch.nn.Parameter(w0.clone())
    opt = _opt([w], lr=0.01)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    ref_w, ref_m, _ = _reference_steps(w0, grads)
    torch.testing.assert_close(w.detach(), ref_w, rtol=1e-5, atol=1e-6)
    state = opt.state[w]
    m = quant.dequantize_blockwise(state["exp_avg_codes"].clone(), state["exp_avg_scale"], quant.DE_MAP_4BIT, shape)
    assert (m != ref_m).float().mean() < 1e-3  # codes agree except for float-rounding near-ties
    expected_v_key = {3: "exp_avg_sq_scale", 2: "exp_avg_sq_scale", 1: "exp_avg_sq_scale"}[len(shape)]
    n_scale = sum(shape) if len(shape) >= 2 else quant.num_blocks(w0.numel())
    assert state[expected_v_key].numel() == n_scale


def test_size_one_dims_are_dropped_for_rank1():
    w = torch.nn.Parameter(torch.randn(1, 5000))  # a row vector: B128 like a 1-D tensor
    opt = _opt([w])
    w.grad = torch.randn(1, 5000)
    opt.step()
    assert opt.state[w]["exp_avg_sq_scale"].numel() == quant.num_blocks(5000)


# ------------------------------------------------------------------------------ zero gradients


@pytest.mark.parametrize("factor", [False, True])
def test_zero_gradient_coordinates_stay_bit_identical(factor):
    """500 steps; coordinates whose gradient is always 0 share B128 blocks, rows and columns
    with coordinates that train. wd = 0 (decoupled decay moves every parameter, see below)."""
    torch.manual_seed(3)
    w0 = torch.randn(64, 128)
    frozen = torch.zeros(64, 128, dtype=torch.bool)
    frozen[3, 5] = frozen[3, 77] = frozen[40, 5] = frozen[63, 127] = True
    target = torch.randn(64, 128)
    results = {}
    for name in ("4bit", "fp32"):
        w = torch.nn.Parameter(w0.clone())
        if name == "4bit":
            opt = _opt([w], lr=1e-2, weight_decay=0.0, factor_second_moment=factor)
        else:
            opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.0)
        for _ in range(500):
            w.grad = torch.where(frozen, 0.0, (w.detach() - target) + 0.1 * torch.randn(64, 128))
            opt.step()
        results[name] = w.detach()
        if name == "4bit" and not factor:
            st = opt.state[w]
            v = quant.dequantize_rank1(st["exp_avg_sq_codes"], st["exp_avg_sq_scale"], quant.LINEAR_MAP_4BIT, (64, 128))
            m = quant.dequantize_blockwise(st["exp_avg_codes"], st["exp_avg_scale"], quant.DE_MAP_4BIT, (64, 128))
            assert (v[frozen] > 0).all()  # the zero-free map: v is not 0 here ...
            assert (m[frozen] == 0).all()  # ... but m is exactly 0, so the update is exactly 0
    for name, w in results.items():
        assert torch.equal(w[frozen], w0[frozen]), name
        assert (w[~frozen] != w0[~frozen]).all(), name  # the neighbours trained
        assert ((w - target)[~frozen].abs().mean() < 0.3), name


def test_zero_gradient_coordinates_only_decay_like_fp32_adamw():
    torch.manual_seed(4)
    w0 = torch.randn(64, 128)
    frozen = torch.zeros(64, 128, dtype=torch.bool)
    frozen[7, :3] = True
    out = []
    for make in (lambda ps: _opt(ps, lr=1e-2, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)):
        w = torch.nn.Parameter(w0.clone())
        opt = make([w])
        for _ in range(50):
            w.grad = torch.where(frozen, 0.0, torch.randn(64, 128))
            opt.step()
        out.append(w.detach()[frozen])
    assert torch.equal(out[0], out[1])  # both are w0 * (1 - lr wd)^50, step by step in float32
    assert not torch.equal(out[0], w0[frozen])


# ------------------------------------------------------------------------------ state, save and load


@pytest.mark.parametrize("chunk", [None, 2**18])
def test_state_bytes_per_parameter(chunk):
    w = torch.nn.Parameter(torch.zeros(1024, 1024))
    pieces = 1 if chunk is None else 4  # 4 pieces of 256 x 1024
    rank1 = 4 * pieces * (1024 // pieces + 1024) / 2**20  # float32 row and column maxima
    factor = 4 * pieces * (1024 // pieces + 1024) / 2**20  # float32 row and column statistics
    for is_factor, expected in ((False, 0.5 + 4 / 128 + 0.5 + rank1), (True, 0.5 + 4 / 128 + factor)):
        opt = _opt([w], factor_second_moment=is_factor, chunk_numel=chunk)
        w.grad = torch.randn(1024, 1024)
        opt.step()
        st = opt.state[w]
        assert st["exp_avg_codes"].dtype == torch.uint8
        assert (_state_bytes(opt) - 4) / w.numel() == pytest.approx(expected, rel=1e-12)  # - step
        assert _state_bytes(opt) / w.numel() <= (0.56 if is_factor else 1.07)


def _tiny_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 160), torch.nn.Tanh(), torch.nn.Linear(160, 4)).to(dtype)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [False, True])
def test_save_load_continue_is_bit_identical(dtype, factor):
    model = _tiny_model(dtype=dtype)
    resumed = copy.deepcopy(model)
    opt = _opt(model.parameters(), lr=1e-2, factor_second_moment=factor)
    _train(model, opt, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(model, opt, 5, seed=2)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2 = _opt(resumed.parameters(), lr=1e-2, factor_second_moment=factor)
    opt2.load_state_dict(ckpt["optim"])
    big = resumed[0].weight
    assert opt2.state[big]["exp_avg_scale"].dtype == torch.float32  # not cast to the param dtype
    assert opt2.state[big]["exp_avg_codes"].dtype == torch.uint8
    _train(resumed, opt2, 5, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert a.dtype == dtype and torch.equal(a, b)


def test_load_state_dict_keeps_saved_settings_and_rejects_corrupt_state():
    model = _tiny_model()
    opt = _opt(model.parameters())
    _train(model, opt, 1, seed=0)
    other = _opt(model.parameters(), factor_second_moment=True)
    other.load_state_dict(opt.state_dict())  # as torch.optim: the saved group settings win
    assert other.param_groups[0]["factor_second_moment"] is False
    bad = opt.state_dict()
    pid = next(i for i, s in bad["state"].items() if "exp_avg_scale" in s)
    bad["state"][pid]["exp_avg_scale"] = bad["state"][pid]["exp_avg_scale"].bfloat16()
    with pytest.raises(ValueError, match="exp_avg_scale"):
        _opt(model.parameters()).load_state_dict(bad)
    del bad["state"][pid]["exp_avg_scale"]
    with pytest.raises(ValueError, match="keys"):
        _opt(model.parameters()).load_state_dict(bad)


# ------------------------------------------------------------------------------ API and errors


def test_registry_zero_grad_and_skipped_params():
    model = _tiny_model()
    opt = build_optimizer("adamw4bit", model.parameters(), lr=1e-3, compile=False)
    assert isinstance(opt, AdamW4bit)
    before = [p.detach().clone() for p in model.parameters()]
    model[2].weight.grad = torch.ones_like(model[2].weight)  # only one param has a grad
    opt.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert changed == [False, False, True, False]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_bad_arguments_and_non_finite_gradients():
    p = torch.nn.Parameter(torch.zeros(8192))
    with pytest.raises(ValueError, match="lr"):
        AdamW4bit([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamW4bit([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="block_size"):
        AdamW4bit([p], block_size=127)
    with pytest.raises(ValueError, match=r"param_groups\[1\].*weight_decay"):
        AdamW4bit([{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": -1}])
    opt = _opt([p])
    p.grad = torch.zeros(8192)
    p.grad[17] = float("nan")
    with pytest.raises(FloatingPointError, match=r"param_groups\[0\] param 0"):
        opt.step()
    q = torch.nn.Parameter(torch.zeros(10, 10))
    q.grad = torch.zeros(10, 10).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        _opt([q]).step()


# ------------------------------------------------------------------------------ pieces (chunk_numel)


@pytest.mark.parametrize("factor", [False, True])
def test_pieces_equal_separate_parameters(factor):
    """chunk_numel splits a tensor into row pieces that are independent quantization units:
    the same as optimizing each piece as its own parameter, bit for bit."""
    torch.manual_seed(5)
    w0 = torch.randn(64, 128)
    grads = [torch.randn(64, 128) for _ in range(4)]
    whole = torch.nn.Parameter(w0.clone())
    parts = [torch.nn.Parameter(w0[i : i + 16].clone()) for i in range(0, 64, 16)]
    opt_whole = _opt([whole], chunk_numel=2048, factor_second_moment=factor, min_quantize_numel=1024)
    opt_parts = _opt(parts, chunk_numel=None, factor_second_moment=factor, min_quantize_numel=1024)
    for g in grads:
        whole.grad = g.clone()
        for k, part in enumerate(parts):
            part.grad = g[16 * k : 16 * k + 16].clone()
        opt_whole.step()
        opt_parts.step()
    assert torch.equal(whole.detach(), torch.cat([p.detach() for p in parts]))
    codes = torch.cat([opt_parts.state[p]["exp_avg_codes"] for p in parts])
    assert torch.equal(opt_whole.state[whole]["exp_avg_codes"], codes)


def test_single_row_pieces_and_non_contiguous_params():
    torch.manual_seed(6)
    w = torch.nn.Parameter(torch.randn(3, 5000))
    opt = _opt([w], chunk_numel=5000)  # three pieces of shape (1, 5000)
    w.grad = torch.randn(3, 5000)
    before = w.detach().clone()
    opt.step()
    assert opt.state[w]["exp_avg_sq_scale"].numel() == 3 * (1 + 5000)
    assert (w.detach() != before).float().mean() > 0.99
    base = torch.randn(96, 128)
    a = torch.nn.Parameter(base.t())  # non-contiguous (128, 96)
    b = torch.nn.Parameter(base.t().contiguous())
    g = torch.randn(128, 96)
    for q in (a, b):
        q.grad = g.clone()
        _opt([q], chunk_numel=4096).step()
    assert torch.equal(a.detach(), b.detach())


def test_compile_default_follows_the_environment(monkeypatch):
    from echotrain.optim import adamw4bit

    monkeypatch.setenv("ECHOTRAIN_OPTIM_COMPILE", "0")
    assert adamw4bit._compile_available(torch.device("cpu")) is False
    p = torch.nn.Parameter(torch.zeros(8192))
    opt = AdamW4bit([p])  # compile=None
    p.grad = torch.ones(8192)
    opt.step()
    assert opt.compile is False and opt._compiled is None
    monkeypatch.setenv("ECHOTRAIN_OPTIM_COMPILE", "1")
    assert adamw4bit._compile_available(torch.device("cpu")) is True


def test_deepcopy_and_pickle_keep_the_settings_and_step_alike():
    """copy.deepcopy / pickle of an AdamW4bit keep its own settings (torch's Optimizer pickles only defaults,
    state and param_groups: step() then failed on a missing attribute), and the copy steps as the original."""
    import copy
    import pickle

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 80))
    w.grad = torch.randn(64, 80)
    opt = AdamW4bit([w], compile=False, check_finite=False, skip_nonfinite=True, seed=7, widen_codes=True)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (clone.compile, clone.check_finite, clone.skip_nonfinite, clone.seed, clone.widen_codes) == (
            False, False, True, 7, True)
        (w2,) = clone.param_groups[0]["params"]
        w2.grad = w.grad.clone()
        clone.step()
        assert not torch.equal(w2, w)  # the copy moved its own parameter
    ref = copy.deepcopy(opt)
    opt.step()
    (w3,) = ref.param_groups[0]["params"]
    w3.grad = w.grad.clone()
    ref.step()
    assert torch.equal(w3, w)
