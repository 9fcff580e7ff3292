"""Which uniforms the stochastic rounding of AdamW4bit's m uses (review of issue 14).

The docstrings promise: element k of a padded piece uses ``quant.hash_uniform(k, seed)`` with one
seed per (optimizer seed, param group, parameter index, piece, step), so that streams never
repeat across parameters, pieces or steps, and a resumed run (or a later version of the library)
draws the same ones.
"""

from __future__ import annotations

import torch

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit, _mix


def test_hash_uniform_pinned_values():
    # the uniforms are part of a checkpoint's future: a change of the mix changes every resumed run
    u = quant.hash_uniform(torch.arange(4, dtype=torch.int64), 0)
    v = quant.hash_uniform(torch.arange(4, dtype=torch.int64), 12345)
    # an independent transcription of the documented rounds (x -> xorshift16, *0x7FEB352D, xorshift15,
    # *0x2C1B3C6D, xorshift16, top 24 bits)
    def ref(i, s):
        x = (i + s * 0x9E3779B9) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 16
        return (x >> 8) / 2**24
    assert u.tolist() == [ref(i, 0) for i in range(4)]
    assert v.tolist() == [ref(i, 12345) for i in range(4)]
    assert u.tolist() == [0.0, 0.2790684103965759, 0.5581368803977966, 0.53226238489151]


def test_neighbouring_seeds_are_not_shifted_streams():
    idx = torch.arange(4096, dtype=torch.int64)
    a, b = quant.hash_uniform(idx, 5), quant.hash_uniform(idx, 6)
    for shift in (1, 2, 3):
        assert not torch.equal(a[shift:], b[:-shift]) and not torch.equal(b[shift:], a[:-shift])
    assert len(set(a.tolist()) & set(b.tolist())) < 10  # 24-bit values: almost no collisions


def test_one_step_codes_equal_the_documented_reference():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(16, 64))
    g = torch.randn(16, 64)
    p.grad = g.clone()
    opt = AdamW4bit([p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, compile=False, min_quantize_numel=0,
                    m_rounding="stochastic", seed=7)
    opt.step()
    st = opt.state[p]
    m = (0.1 * g).reshape(-1)  # m after one step from 0: (1 - beta1) g
    blocks = m.view(-1, quant.BLOCK_SIZE)
    scale = blocks.abs().amax(dim=1)
    x = (blocks / scale[:, None]).reshape(-1)
    u = quant.hash_uniform(torch.arange(m.numel(), dtype=torch.int64), _mix(7, 0, 0, 0, 1))
    codes = quant.quantize_de_stochastic(x, u).long()
    half = m.numel() // 2
    torch.testing.assert_close(st["exp_avg_scale"], scale)
    assert torch.equal(st["exp_avg_codes"].long(), codes[:half] * 16 + codes[half:])


def _two_equal_params(**kw):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 128))
    b = torch.nn.Parameter(a.detach().clone())
    opt = AdamW4bit([a, b], lr=1e-2, compile=False, m_rounding="stochastic", **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(64, 128, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
    return a, b, opt


def test_parameters_with_equal_gradients_get_independent_rounding():
    a, b, opt = _two_equal_params()
    assert not torch.equal(opt.state[a]["exp_avg_codes"], opt.state[b]["exp_avg_codes"])


def test_pieces_of_one_parameter_get_independent_rounding():
    torch.manual_seed(0)
    row = torch.randn(1, 128)
    p = torch.nn.Parameter(row.repeat(64, 1))  # 4 pieces of 16 rows, all equal
    opt = AdamW4bit([p], lr=1e-2, compile=False, m_rounding="stochastic", chunk_numel=16 * 128)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        p.grad = torch.randn(1, 128, generator=g).repeat(64, 1)
        opt.step()
    piece = opt.state[p]["exp_avg_codes"].view(4, -1)
    assert not torch.equal(piece[0], piece[1]) and not torch.equal(piece[1], piece[2])
