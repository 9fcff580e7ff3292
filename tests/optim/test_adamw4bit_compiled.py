"""The torch.compile'd update equals the eager one (slow: compiling takes ~10-30 s per shape
on a shared CPU; the eager update, tested by default, runs the same function)."""

from __future__ import annotations

import pytest
import torch

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "factor"), [((48, 200), False), ((48, 200), True), ((9000,), False)])
def test_compiled_update_equals_eager(shape, factor):
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    runs = {}
    for compiled in (False, True):
        w = torch.nn.Parameter(w0.clone())
        opt = AdamW4bit([w], lr=1e-2, factor_second_moment=factor, compile=compiled)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        assert opt.compile is compiled  # no silent fallback
        runs[compiled] = (w.detach(), opt.state[w])
    (w_e, s_e), (w_c, s_c) = runs[False], runs[True]
    torch.testing.assert_close(w_c, w_e, rtol=1e-5, atol=1e-6)
    # codes may differ only where float rounding moves a value across a midpoint
    assert (s_c["exp_avg_codes"] != s_e["exp_avg_codes"]).float().mean() < 1e-3
    torch.testing.assert_close(s_c["exp_avg_scale"], s_e["exp_avg_scale"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_compiled_de_quantizer_and_dequantizer_are_exact():
    """The compiled forms (sign-bit midpoint counts, piecewise-linear values) equal the
    reference nearest rounding and the float32 map bit for bit, at and next to every midpoint."""
    points = torch.tensor(list(quant._DE_MIDPOINTS) + list(quant.DE_MAP_4BIT) + [1e-38, 0.0], dtype=torch.float32)
    near = torch.cat([points, torch.nextafter(points, torch.tensor(2.0)), torch.nextafter(points, torch.tensor(-2.0))])
    torch.manual_seed(4)
    x = torch.cat([near, -near, torch.tensor([-0.0]), torch.rand(100_000) * 2 - 1])
    codes = torch.compile(quant.quantize_de, fullgraph=True, dynamic=False)(x)
    assert torch.equal(codes, quant.quantize_de(x))  # the eager compares
    # and the general rule, except the exact ties x = -midpoint (which go up here, down there)
    tie = torch.isin(x, -torch.tensor(quant._DE_MIDPOINTS, dtype=torch.float32))
    assert int(tie.sum()) == 8
    assert torch.equal(codes[~tie], quant.quantize_nearest(x, quant.DE_MAP_4BIT)[~tie])
    table = torch.arange(16, dtype=torch.float32).repeat(64)  # long enough for the vector loop
    values = torch.compile(quant._de_value, fullgraph=True, dynamic=False)(table)
    assert torch.equal(values, quant.map_tensor(quant.DE_MAP_4BIT).repeat(64))


def test_capped_instruction_set_compiles_without_the_fx_graph_cache(monkeypatch):
    """With ATEN_CPU_CAPABILITY set, the compiled update does not use inductor's FX graph cache (torch 2.13
    reuses a graph compiled without the cap and it computes a wrong update: the slow test below); without it,
    the round-to-nearest update keeps its options and the stochastic one compiles with none."""
    from echotrain.optim import adamw4bit

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert adamw4bit._compile_options(False) == adamw4bit._INDUCTOR_OPTIONS
    assert adamw4bit._compile_options(True) is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert adamw4bit._compile_options(False) == {**adamw4bit._INDUCTOR_OPTIONS, "fx_graph_cache": False}
    assert adamw4bit._compile_options(True) == {"fx_graph_cache": False}
    # and the optimizer compiles with them
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    w = torch.nn.Parameter(torch.randn(64, 80))
    w.grad = torch.randn(64, 80)
    AdamW4bit([w], compile=True).step()
    assert seen == [{**adamw4bit._INDUCTOR_OPTIONS, "fx_graph_cache": False}]


_CAPPED_SCRIPT = """
import torch
from echotrain.optim.adamw4bit import AdamW4bit
out = []
for compiled in (True, False):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 200) * 0.02)
    opt = AdamW4bit([w], lr=1e-3, compile=compiled)
    for s in range(3):
        w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(s)) * 1e-3
        opt.step()
    out.append(w.detach())
    if compiled:
        widened = opt._widen(w.device)
print(widened)
print(float((out[0] - out[1]).abs().max()))
"""


@pytest.mark.slow
def test_compiled_update_is_right_after_a_cache_written_without_the_cap(tmp_path):
    """One process compiles the update at the host's instruction set into a fresh inductor cache, a second one
    with ATEN_CPU_CAPABILITY=avx2 compiles it again beside that cache: its update equals the eager one (on the
    code before the fix the second process reused the first one's graph and was off by ~10 on this shape).
    Only meaningful on a host above AVX2."""
    import os
    import subprocess
    import sys

    if not torch.cpu._is_avx512_supported():  # (the host, whatever a cap set earlier in this process)
        pytest.skip("the host runs AVX2 kernels already: no second instruction set to cache under")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for cap in (None, "avx2"):
        run_env = env if cap is None else {**env, "ATEN_CPU_CAPABILITY": cap}
        res = subprocess.run([sys.executable, "-c", _CAPPED_SCRIPT], env=run_env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        lines = res.stdout.strip().splitlines()
        assert lines[-2] == str(cap == "avx2"), (cap, res.stdout)  # the AVX2 kernels read int32 codes
        assert float(lines[-1]) < 1e-6, (cap, res.stdout)


def _spy_compile(monkeypatch):
    """torch.compile replaced by the identity (the eager function runs), recording each call's keywords."""
    from echotrain.optim import adamw4bit

    calls = []

    def fake_compile(fn, **kw):
        def run(*args, **kwargs):
            calls.append(kwargs)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    return adamw4bit, calls


@pytest.mark.parametrize(("shape", "factor", "rounding"), [((48, 200), False, "nearest"), ((48, 200), True, "nearest"),
                                                         ((9000,), False, "nearest"), ((9000,), True, "nearest"),
                                                         ((48, 200), False, "stochastic")])
def test_widened_codes_give_the_same_update_bit_for_bit(monkeypatch, shape, factor, rounding):
    """widen_codes=True hands the update int32 copies of the packed m and v codes (none of v for Factor); the
    parameters and every state tensor equal the uint8 run's exactly after 3 steps (rank-1, block-wise and
    Factor v; stochastic m), and the uint8 codes are what is written."""
    _, calls = _spy_compile(monkeypatch)
    torch.manual_seed(0)
    w0, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
    runs = {}
    for widen in (False, True):
        calls.clear()
        w = torch.nn.Parameter(w0.clone())
        opt = AdamW4bit([w], lr=1e-2, factor_second_moment=factor, compile=True, widen_codes=widen, m_rounding=rounding)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        runs[widen] = (w.detach(), opt.state[w])
        assert len(calls) == 3
        for kw in calls:
            assert ("m_codes_in" in kw) is widen
        if widen:
            state = opt.state[w]
            assert calls[-1]["m_codes_in"].dtype == torch.int32
            assert calls[-1]["m_codes_in"].shape == state["exp_avg_codes"].shape
            assert (calls[-1]["v_codes_in"] is None) is (factor and len(shape) > 1)
    (w_u, s_u), (w_i, s_i) = runs[False], runs[True]
    assert torch.equal(w_u, w_i)
    assert s_u.keys() == s_i.keys()
    for key in s_u:
        assert s_u[key].dtype == s_i[key].dtype and torch.equal(s_u[key], s_i[key]), key


def test_widened_codes_are_read_instead_of_the_packed_ones():
    """m_codes_in / v_codes_in are what the update reads: codes of another m and v give that state's update."""
    from echotrain.optim.adamw4bit import adamw4bit_tensor_update_

    torch.manual_seed(1)
    p, g = torch.randn(4, 64), torch.randn(4, 64)
    codes = [torch.randint(0, 256, (128,), dtype=torch.uint8) for _ in range(4)]
    m_scale, v_scale = torch.rand(2) + 0.5, torch.rand(68) + 0.5
    hp = (1.0, 1e-2, 0.9, 0.999, 1e-8, 0.0)

    def run(m_codes, v_codes, **widened):
        q, state = p.clone(), [m_codes.clone(), m_scale.clone(), v_codes.clone(), v_scale.clone()]
        adamw4bit_tensor_update_(q, g, state[0], state[1], state[2], state[3], None, None, *hp, v_kind="rank1",
                                 block_size=128, **widened)
        return q, state

    want = run(codes[2], codes[3])
    got = run(codes[0], codes[1], m_codes_in=codes[2].int(), v_codes_in=codes[3].int())
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)


def test_widen_codes_default_follows_inductors_vector_isa(monkeypatch):
    """None (default): int32 codes when inductor vectorises CPU kernels for AVX2 (its VecAVX2), uint8 ones for
    AVX-512 / AMX and on other devices; an explicit True / False wins; anything else is refused."""
    from torch._inductor import cpu_vec_isa

    adamw4bit, calls = _spy_compile(monkeypatch)
    cpu = torch.device("cpu")
    for isa, want in ((cpu_vec_isa.VecAVX2(), True), (cpu_vec_isa.VecAVX512(), False), (cpu_vec_isa.VecAMX(), False)):
        monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda isa=isa: isa)
        assert adamw4bit._narrow_uint8_loads(cpu) is want
        for widen, expect in ((None, want), (True, True), (False, False)):
            calls.clear()
            w = torch.nn.Parameter(torch.randn(64, 80))
            w.grad = torch.randn(64, 80)
            AdamW4bit([w], compile=True, widen_codes=widen).step()
            assert [("m_codes_in" in kw) for kw in calls] == [expect], (isa, widen)
    assert adamw4bit._narrow_uint8_loads(torch.device("meta")) is False
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.VecAVX2())
    assert adamw4bit._narrow_uint8_loads(torch.device("cuda")) is False  # (no GPU needed: decided by the type)
    w = torch.nn.Parameter(torch.randn(64, 80))
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match="widen_codes must be True, False or None"):
            AdamW4bit([w], widen_codes=bad)
    # the default is decided per device type, from the parameter's own device
    opt = AdamW4bit([w])
    assert opt._widen(cpu) is True and opt._widen(torch.device("meta")) is False and opt._widen(cpu) is True
    assert opt._widen_auto == {"cpu": True, "meta": False}
    seen = []
    monkeypatch.setattr(AdamW4bit, "_widen", lambda self, device: seen.append(device) or False)
    m = torch.nn.Parameter(torch.randn(64, 80, device="meta"))
    m.grad = torch.randn(64, 80, device="meta")
    AdamW4bit([m], compile=True, check_finite=False).step()
    assert seen == [torch.device("meta")]
