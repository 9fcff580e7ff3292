"""The torch.compile'd update equals the eager one (slow: compiling takes ~10-30 s per shape
on a shared CPU; the eager update, tested by default, runs the same function)."""

from __future__ import annotations

import pytest
import torch

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
