"""Tests of the 4-bit quantizers (echotrain.optim.quant) with real values."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echotrain.optim import quant

SPEC_DE = [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
           0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]  # fmt: skip


def test_de_map_is_the_papers_16_values():
    assert list(quant.DE_MAP_4BIT) == SPEC_DE
    assert quant.DE_MAP_4BIT.count(0.0) == 1


def test_de_map_matches_torchao_dynamic_map():
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    theirs = torch.tensor(quant_utils.create_dynamic_map(True, 3, 4), dtype=torch.float32)
    # torchao builds the map in float32 arithmetic, so it agrees to float32 rounding
    assert torch.allclose(quant.map_tensor(quant.DE_MAP_4BIT), theirs, rtol=0, atol=1e-7)


def test_linear_map_is_zero_free_k_over_16():
    assert list(quant.LINEAR_MAP_4BIT) == [k / 16 for k in range(1, 17)]
    assert min(quant.LINEAR_MAP_4BIT) == 0.0625


def test_as_map_rejects_bad_maps():
    with pytest.raises(ValueError, match="16 values"):
        quant.as_map([0.0, 1.0])
    with pytest.raises(ValueError, match="increasing"):
        quant.as_map([1.0] * 16)


def test_rank1_scale_is_min_of_row_and_column_max():
    x = torch.tensor([[1.0, -5.0, 2.0], [0.5, 0.25, -3.0]])
    f = quant.rank1_factors(x)
    assert torch.equal(f[0], torch.tensor([5.0, 3.0]))  # row max |x|
    assert torch.equal(f[1], torch.tensor([1.0, 5.0, 3.0]))  # column max |x|
    s = quant.rank1_scale(f)
    expected = torch.tensor([[1.0, 5.0, 3.0], [1.0, 3.0, 3.0]])
    assert torch.equal(s, expected)


def test_rank1_scale_nd_rule():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5)
    s = quant.rank1_scale(quant.rank1_factors(x))
    a = x.abs()
    for i, j, k in itertools.product(range(3), range(4), range(5)):
        want = min(a[i].max(), a[:, j].max(), a[:, :, k].max())
        assert s[i, j, k] == want


def test_pack_layout_and_roundtrip():
    codes = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert quant.pack_4bit(codes).tolist() == [0x13, 0x24]
    odd = torch.tensor([15, 0, 7], dtype=torch.uint8)
    packed = quant.pack_4bit(odd)
    assert packed.numel() == 2
    assert torch.equal(quant.unpack_4bit(packed, 3), odd)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        quant.pack_4bit(torch.tensor([16]))
    with pytest.raises(ValueError, match="requested"):
        quant.unpack_4bit(packed, 5)


def _bound(normalised: torch.Tensor, qmap: tuple[float, ...]) -> torch.Tensor:
    """Half the gap between the two code values around each value (or the distance to the end
    code outside the map's range)."""
    q = torch.tensor(qmap)
    k = torch.searchsorted(q, normalised.contiguous()).clamp(1, 15)
    lo, hi = q[k - 1], q[k]
    half_gap = (hi - lo) / 2
    outside = torch.maximum(q[0] - normalised, normalised - q[-1]).clamp(min=0)
    return torch.where((normalised < q[0]) | (normalised > q[-1]), outside, half_gap)


def _tensor(data, shape):
    return torch.tensor(data, dtype=torch.float32).view(shape)


shapes = st.sampled_from([(70,), (3, 50), (5, 9), (2, 3, 7), (257,)])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), block=st.sampled_from([64, 128]), log_scale=st.integers(-8, 4))
def test_blockwise_de_normalised_in_range_and_error_bounded(shape, seed, block, log_scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0**log_scale
    x.view(-1)[:: max(1, x.numel() // 5)] = 0.0  # exact zeros too
    scale = quant.to_blocks(x.float(), block).abs().amax(dim=1)  # block-wise absmax (paper eq. 2)
    normalised = quant.to_blocks(x, block) / scale.clamp(min=1e-38)[:, None]
    assert normalised.abs().max() <= 1.0
    packed, s = quant.quantize_blockwise(x, quant.DE_MAP_4BIT, block)
    assert torch.equal(s, scale)
    y = quant.dequantize_blockwise(packed, s, quant.DE_MAP_4BIT, shape, block)
    assert not torch.isnan(y).any()
    err = (quant.to_blocks(y, block) - quant.to_blocks(x, block)).abs()
    bound = (_bound(normalised, quant.DE_MAP_4BIT) + 1e-6) * scale[:, None]  # + float32 rounding
    assert (err <= bound).all()
    # zeros stay exactly zero under the DE map (it has a 0 code)
    assert torch.all(y[x == 0] == 0)


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(3, 50), (5, 9), (2, 3, 7), (16, 16)]), seed=st.integers(0, 10_000), log_scale=st.integers(-12, 2))
def test_rank1_linear_normalised_in_range_and_error_bounded(shape, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) ** 4 * 10.0**log_scale  # v >= 0, heavy-tailed
    scale = quant.rank1_scale(quant.rank1_factors(x))
    normalised = x / scale.clamp(min=1e-38)
    assert normalised.min() >= 0 and normalised.max() <= 1.0
    packed, factors = quant.quantize_rank1(x, quant.LINEAR_MAP_4BIT)
    y = quant.dequantize_rank1(packed, factors, quant.LINEAR_MAP_4BIT, shape)
    err = (y - x).abs()
    bound = (_bound(normalised, quant.LINEAR_MAP_4BIT) + 1e-6) * scale  # + float32 rounding
    assert (err <= bound).all()
    assert (y > 0).all()  # no zero row/column here, so no v dequantizes to 0


def test_v_is_zero_only_where_its_row_or_column_is_zero():
    v = torch.tensor([[1e-30, 4.0, 0.0], [0.0, 0.0, 0.0], [2.0, 1e-20, 0.0], [0.0, 3.0, 0.0]])
    packed, factors = quant.quantize_rank1(v, quant.LINEAR_MAP_4BIT)
    y = quant.dequantize_rank1(packed, factors, quant.LINEAR_MAP_4BIT, v.shape)
    zero_row = (v == 0).all(dim=1, keepdim=True)
    zero_col = (v == 0).all(dim=0, keepdim=True)
    assert torch.equal(y == 0, zero_row | zero_col)
    # a truly-zero entry in a non-zero row and column dequantizes to scale/16, not 0
    assert y[3, 0] == quant.LINEAR_MAP_4BIT[0] * min(v[3].max(), v[:, 0].max())


def test_v_blockwise_is_zero_only_where_its_block_is_zero():
    v = torch.zeros(300)
    v[5] = 1e-12
    v[200:210] = 3.0
    v[210] = 1e-30
    packed, scale = quant.quantize_blockwise(v, quant.LINEAR_MAP_4BIT, 128)
    y = quant.dequantize_blockwise(packed, scale, quant.LINEAR_MAP_4BIT, v.shape, 128)
    # blocks 0 and 1 have a non-zero entry, block 2 (256..299) is all zero
    assert (y[:256] > 0).all()
    assert torch.equal(y[256:], torch.zeros(44))


@pytest.mark.parametrize("block", [64, 128])
def test_70_values_round_trip_without_nan(block):
    torch.manual_seed(1)
    x = torch.randn(70)
    packed, scale = quant.quantize_blockwise(x, quant.DE_MAP_4BIT, block)
    assert packed.numel() == quant.num_blocks(70, block) * block // 2
    y = quant.dequantize_blockwise(packed, scale, quant.DE_MAP_4BIT, (70,), block)
    assert y.shape == (70,) and torch.isfinite(y).all()
    assert (y - x).abs().max() <= 0.1125 * x.abs().max()  # half the largest DE gap (0.225)
    z = quant.dequantize_blockwise(*quant.quantize_blockwise(torch.zeros(70), quant.LINEAR_MAP_4BIT, block), quant.LINEAR_MAP_4BIT, (70,), block)
    assert torch.equal(z, torch.zeros(70))  # guarded zero scale: exact 0, no NaN


def test_fast_quantizers_equal_the_general_nearest_rounding():
    torch.manual_seed(2)
    x = torch.rand(100_000) * 2 - 1
    assert torch.equal(quant.quantize_de(x), quant.quantize_nearest(x, quant.DE_MAP_4BIT))
    u = torch.rand(100_000)
    # the closed form the optimizer uses for the zero-free linear map
    assert torch.equal(quant._linear_code_f(u).to(torch.uint8), quant.quantize_nearest(u, quant.LINEAR_MAP_4BIT))
    codes = torch.arange(16, dtype=torch.float32)
    assert quant._de_value(codes).tolist() == [float(torch.tensor(v)) for v in SPEC_DE]
    assert torch.equal(quant._linear_value(codes), quant.map_tensor(quant.LINEAR_MAP_4BIT))
    packed = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    # the optimizer's float nibble path (two halves; packs as 16 * high + low) equals unpack_4bit
    halves = [quant._nibble_f(packed, 0), quant._nibble_f(packed, 1)]
    assert torch.equal(torch.cat(halves), quant.unpack_4bit(packed).float())
    assert torch.equal((halves[0] * 16 + halves[1]).to(torch.uint8), packed)



def _boundary_values() -> torch.Tensor:
    """Every DE midpoint and DE value as float32, their float32 neighbours, both signs, 0, -0,
    the smallest normal and subnormal, and random values in [-1, 1]."""
    points = torch.tensor(list(quant._DE_MIDPOINTS) + list(SPEC_DE) + [1e-38, 1e-45, 0.0], dtype=torch.float32)
    near = torch.cat([points, torch.nextafter(points, torch.tensor(2.0)), torch.nextafter(points, torch.tensor(-2.0))])
    torch.manual_seed(3)
    return torch.cat([near, -near, torch.tensor([-0.0]), torch.rand(200_000) * 2 - 1])


def test_sign_bit_count_equals_compares_at_every_midpoint():
    """The compiled DE quantizer counts midpoints below |x| by sign bits of ``t - |x|``: equal
    to the compares at and next to every midpoint (a wrong threshold or a >= would fail)."""
    a = _boundary_values().abs()
    expected = sum((a > t).float() for t in quant._DE_MIDPOINTS)
    assert torch.equal(quant._count_above(a, quant._DE_MIDPOINTS), expected)
    m = torch.tensor(quant._DE_MIDPOINTS, dtype=torch.float32)
    assert quant._count_above(m, quant._DE_MIDPOINTS).tolist() == list(range(8))  # a == t: not above
    assert quant._count_above(torch.nextafter(m, torch.tensor(2.0)), quant._DE_MIDPOINTS).tolist() == list(range(1, 9))

def test_quantize_rejects_non_finite():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize_blockwise(torch.tensor([1.0, float("nan")]), quant.DE_MAP_4BIT)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize_rank1(torch.tensor([[1.0, float("inf")]]), quant.LINEAR_MAP_4BIT)
    with pytest.raises(ValueError, match="at least 1 dim"):
        quant.rank1_factors(torch.tensor(1.0))


def test_linear_zero_free_midpoints_tie_to_the_lower_code():
    # LINEAR_MAP_4BIT[c] = (c + 1) / 16; the midpoint between codes k - 1 and k is (k + 0.5) / 16,
    # exact in float32. Ties go to the lower code k - 1 (documented); round-half-to-even would give
    # k for every even k.
    k = torch.arange(1, 16, dtype=torch.float32)
    mid = (k + 0.5) / 16
    assert torch.equal(mid * 16, k + 0.5)  # the midpoints are exact
    expected = (k - 1).to(torch.uint8)
    assert torch.equal(quant._linear_code_f(mid).to(torch.uint8), expected)
    assert torch.equal(quant._linear_code_f(mid), k - 1)  # the optimizer's path
    assert torch.equal(quant.quantize_nearest(mid, quant.LINEAR_MAP_4BIT), expected)
    # just above a midpoint: the upper code
    above = torch.nextafter(mid, torch.tensor(2.0))
    assert torch.equal(quant._linear_code_f(above), k)
