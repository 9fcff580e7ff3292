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
        assert float(res.stdout.strip().splitlines()[-1]) < 1e-6, (cap, res.stdout)
