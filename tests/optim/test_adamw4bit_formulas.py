"""Issue 9 case 8: AdamW4bit formulas pinned directly (the float32 size threshold, the 4-bit
Factor row/column statistics, and the bias corrections of the float32 small-tensor path)."""

from __future__ import annotations

import pytest
import torch

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit


def _opt(params, **kw):
    kw.setdefault("compile", False)
    return AdamW4bit(params, **kw)


def test_float32_state_threshold_is_4096_inclusive():
    a, b = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4097))
    c = torch.nn.Parameter(torch.zeros(64, 64))  # 4096 elements as a matrix
    opt = _opt([a, b, c])
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[a]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[c]) == {"step", "exp_avg", "exp_avg_sq"}
    assert "exp_avg_codes" in opt.state[b] and "exp_avg" not in opt.state[b]


def test_small_tensor_path_equals_torch_adamw_with_bias_corrections():
    # <= 4096 elements: plain float32 AdamW, bias corrections 1 - b1^t and sqrt(1 - b2^t) each step
    torch.manual_seed(0)
    w0 = torch.randn(3, 50)
    grads = [torch.randn(3, 50) * s for s in (1.0, 0.01, 5.0, 0.3)]
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    o = _opt([ours], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    r = torch.optim.AdamW([ref], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        o.step()
        r.step()
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=2e-6)
    # and by hand at t = 1: m = 0.2 g, v = 0.1 g^2, m_hat = g, v_hat = g^2 -> step lr * g/(|g| + eps)
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = _opt([p], lr=0.1, betas=(0.8, 0.9), eps=0.0, weight_decay=0.0)
    p.grad = torch.tensor([0.5, -4.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, -1.9]), rtol=0, atol=1e-7)


def test_factor_row_and_column_statistics_and_update():
    # 4-bit Factor (Adafactor eq. 4-5): row_t = b2 row + (1-b2) mean_j g^2, col_t = b2 col + (1-b2)
    # mean_i g^2; v = (row / mean(row)) col^T. At t = 1 m = (1 - b1) g exactly (m starts at 0).
    torch.manual_seed(1)
    shape = (64, 128)
    w0 = torch.randn(shape)
    g1 = torch.randn(shape) * torch.linspace(0.1, 3.0, 64)[:, None]  # rows of different scale
    g2 = torch.randn(shape) * torch.linspace(2.0, 0.5, 128)[None, :]
    w = torch.nn.Parameter(w0.clone())
    b1, b2, lr, eps = 0.9, 0.99, 1e-2, 1e-8
    opt = _opt([w], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, factor_second_moment=True, chunk_numel=None)
    w.grad = g1.clone()
    opt.step()
    st = opt.state[w]
    row1 = (1 - b2) * (g1 * g1).mean(dim=1)
    col1 = (1 - b2) * (g1 * g1).mean(dim=0)
    torch.testing.assert_close(st["exp_avg_sq_row"], row1, rtol=1e-6, atol=0)
    torch.testing.assert_close(st["exp_avg_sq_col"], col1, rtol=1e-6, atol=0)
    v1 = (row1 / row1.mean())[:, None] * col1[None, :]
    expected_w1 = w0 - lr / (1 - b1) * ((1 - b1) * g1) / (v1.sqrt() / (1 - b2) ** 0.5 + eps)
    torch.testing.assert_close(w.detach(), expected_w1, rtol=1e-5, atol=1e-6)
    # the column statistic is per column, not its mean (a mutation that survived before)
    assert col1.std() / col1.mean() > 0.05
    w.grad = g2.clone()
    opt.step()
    row2 = b2 * row1 + (1 - b2) * (g2 * g2).mean(dim=1)
    col2 = b2 * col1 + (1 - b2) * (g2 * g2).mean(dim=0)
    torch.testing.assert_close(st["exp_avg_sq_row"], row2, rtol=1e-6, atol=0)
    torch.testing.assert_close(st["exp_avg_sq_col"], col2, rtol=1e-6, atol=0)
    # step 2 with the dequantized m of step 1 and v2 from the statistics
    m1 = quant.dequantize_blockwise(*quant.quantize_blockwise((1 - b1) * g1, quant.DE_MAP_4BIT),
                                    quant.DE_MAP_4BIT, shape)
    m2 = b1 * m1 + (1 - b1) * g2
    v2 = (row2 / row2.mean())[:, None] * col2[None, :]
    expected_w2 = expected_w1 - lr / (1 - b1**2) * m2 / (v2.sqrt() / (1 - b2**2) ** 0.5 + eps)
    close = (w.detach() - expected_w2).abs() <= 1e-5 + 1e-4 * expected_w2.abs()
    assert close.float().mean() > 0.999  # m's 4-bit codes may differ at float-rounding near-ties
