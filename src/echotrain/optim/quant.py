"""4-bit quantizers for optimizer states, as pure tensor functions.

Source: B. Li, J. Chen, J. Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023
(arXiv 2309.01507), section 3-4. A quantizer is a *normalisation* (a scale per block, or a
rank-1 scale per element) followed by a *map*: the normalised value is replaced by the index of
the nearest of 16 code values. Two 4-bit codes are packed into one byte.

- First moment m: "B128/DE" -- block-wise absmax scale over the row-major flattened tensor
  (block 128, last block zero-padded) and the signed dynamic-exponent map :data:`DE_MAP_4BIT`.
- Second moment v: "Rank-1/Linear" -- rank-1 scale (:func:`rank1_scale`) and the zero-free
  linear map :data:`LINEAR_MAP_4BIT` (k/16, k = 1..16), so that a positive v never dequantizes
  to 0 (the paper's "zero-point problem", section 4.1). 1-D tensors use B128 blocks instead.

Conventions (ours): codes are ``torch.uint8`` in ``[0, 15]``; n codes (padded to even) pack
into n/2 bytes, byte i holding code i in the high nibble and code i + n/2 in the low nibble
(both halves contiguous, which vectorises; lpmm and torchao interleave neighbours). Scales are
float32 and stored *unclamped*: a block whose values are all 0 has scale 0, is normalised by
``max(scale, tiny)`` (so 0/0 never happens) and dequantizes to exactly 0 whatever its codes.
"Nearest" rounding breaks exact ties toward the lower code value in :func:`quantize_nearest`.

Everything here is plain PyTorch (CPU or GPU). The public functions validate their inputs
(NaN/Inf, code range, sizes); the private ``_*`` helpers the optimizer uses have no
data-dependent Python control flow, so they run inside ``torch.compile``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch import Tensor

# The signed 4-bit dynamic-exponent map (Dettmers 2016, "8-bit approximations"; with 3 exponent
# bits and no zero padding, as in the paper's B128/DE and torchao's ``create_dynamic_map(True,
# 3, 4)``). Sorted; contains an exact 0 and +1 but not -1.
DE_MAP_4BIT: tuple[float, ...] = (
    -0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
    0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0,
)  # fmt: skip
# The unsigned linear map without zero (paper section 4.1): k/16 for k = 1..16.
LINEAR_MAP_4BIT: tuple[float, ...] = tuple(k / 16 for k in range(1, 17))

BLOCK_SIZE = 128
# Guard for zero scales: normalisation divides by max(scale, _TINY).
_TINY = torch.finfo(torch.float32).tiny


def as_map(qmap: Sequence[float] | Tensor) -> tuple[float, ...]:
    """Validate a 16-value map and return it as a sorted tuple of Python floats.

    Raises:
        ValueError: not 16 finite values in strictly increasing order.
    """
    values = tuple(float(v) for v in (qmap.tolist() if isinstance(qmap, Tensor) else qmap))
    if len(values) != 16:
        raise ValueError(f"qmap must have 16 values for 4-bit codes, got {len(values)}")
    if not all(math.isfinite(v) for v in values) or any(
        a >= b for a, b in zip(values, values[1:])
    ):
        raise ValueError(f"qmap must be finite and strictly increasing, got {values}")
    return values


def map_tensor(qmap: Sequence[float] | Tensor, device: torch.device | str | None = None) -> Tensor:
    """The map as a float32 tensor of shape (16,)."""
    return torch.tensor(as_map(qmap), dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Number of blocks of ``block_size`` covering ``numel`` elements (the last one padded)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return -(-numel // block_size)


def to_blocks(x: Tensor, block_size: int = BLOCK_SIZE) -> Tensor:
    """Row-major flatten ``x`` and zero-pad it to shape ``(num_blocks, block_size)``.

    Returns a view when no padding is needed, otherwise a new tensor.
    """
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def rank1_factors(x: Tensor) -> list[Tensor]:
    """Per-dimension absmax statistics for rank-1 normalisation (paper section 4.2).

    For dim ``d`` the factor is ``max |x|`` over all other dims, shape ``(x.shape[d],)``. For a
    matrix these are the row maxima and the column maxima.

    Raises:
        ValueError: ``x`` is 0-d.
    """
    if x.dim() == 0:
        raise ValueError("rank-1 normalisation needs a tensor with at least 1 dim")
    a = x.float().abs()
    dims = range(x.dim())
    return [a.amax(dim=[e for e in dims if e != d]) if x.dim() > 1 else a for d in dims]


def rank1_scale(factors: Sequence[Tensor]) -> Tensor:
    """Rank-1 scale from :func:`rank1_factors`: ``scale[i_1..i_n] = min_d factor_d[i_d]``.

    For a matrix, ``scale_ij = min(rowmax_i, colmax_j)`` (paper eq. 3), which is >= |x_ij|, so
    every normalised value lies in [-1, 1]. Returns float32 of shape ``(len(f) for f in factors)``.
    """
    n = len(factors)
    scale = None
    for d, f in enumerate(factors):
        shape = [1] * n
        shape[d] = f.numel()
        fd = f.view(shape)
        scale = fd if scale is None else torch.minimum(scale, fd)
    return scale


def flatten_factors(factors: Sequence[Tensor]) -> Tensor:
    """Concatenate rank-1 factors into one float32 vector of length ``sum(shape)``."""
    return torch.cat([f.reshape(-1).float() for f in factors])


def split_factors(flat: Tensor, shape: Sequence[int]) -> list[Tensor]:
    """Inverse of :func:`flatten_factors` for a tensor of ``shape``.

    Raises:
        ValueError: ``flat`` does not have ``sum(shape)`` elements.
    """
    if flat.numel() != sum(shape):
        raise ValueError(f"rank-1 factors: expected {sum(shape)} values for {tuple(shape)}, got {flat.numel()}")
    return list(torch.split(flat, list(shape)))


def _safe(scale: Tensor) -> Tensor:
    return scale.clamp(min=_TINY)


# --------------------------------------------------------------------------------------------
# Maps: nearest rounding and lookup
#
# Codes are computed as float32 small integers inside (``_*_f`` helpers) because float
# compare/select/add vectorise well both in eager PyTorch and in torch.compile's CPU code, where
# uint8 arithmetic and table gathers do not; the public functions return uint8.
# --------------------------------------------------------------------------------------------


def _nearest_code_f(x: Tensor, values: tuple[float, ...]) -> Tensor:
    """Nearest code as float32: the number of midpoints strictly below ``x``."""
    code = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for lo, hi in zip(values, values[1:]):
        code = code + (x > (lo + hi) / 2).float()
    return code


def _de_code_f(x: Tensor) -> Tensor:
    """Nearest :data:`DE_MAP_4BIT` code of ``x`` (float32), using the map's symmetry.

    The magnitude index ``j`` in 0..8 is the number of the 8 positive midpoints below ``|x|``;
    negative values use ``7 - min(j, 7)`` (the map has no -1). Half the compares of
    :func:`_nearest_code_f`; compiled, the compares are sign bits (:func:`_count_above`).
    """
    a = x.abs()
    if torch.compiler.is_compiling():
        j = _count_above(a, _DE_MIDPOINTS)
    else:  # eager: in place, no temporaries per midpoint
        j = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        for m in _DE_MIDPOINTS:
            j += torch.gt(a, m, out=mask)
    return torch.where(x < 0, 7 - j.clamp(max=7), 7 + j)


# the 8 midpoints between consecutive non-negative DE values (0.00275, ..., 0.94375)
_DE_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip(DE_MAP_4BIT[7:], DE_MAP_4BIT[8:]))


def _count_above(a: Tensor, thresholds: Sequence[float]) -> Tensor:
    """``sum_k [a > t_k]`` as float32, for finite float32 ``a``, exactly.

    Each term is the sign bit of the float32 difference ``t_k - a``: it is negative exactly
    when ``a > t_k`` (two different floats never subtract to 0, and ``t - t = +0``). An integer
    shift and add per threshold: in inductor's CPU code a float compare turned into a number
    costs about twice as many vector instructions (measured: the m quantizer ~11% faster).
    """
    acc = None
    for t in thresholds:
        bit = (t - a).view(torch.int32) >> 31  # -1 where a > t, else 0
        acc = bit if acc is None else acc + bit
    return (-acc).float()


def _de_value(code: Tensor) -> Tensor:
    """:data:`DE_MAP_4BIT` value of a float32 code, bit-exact in float32.

    The positive values are piecewise linear in the magnitude index ``a = |code - 7|``:
    ``0.0055 a`` for a <= 1, ``0.0325 + 0.045 (a - 2)`` for a = 2, 3, ``0.4375 + 0.225 (a - 5)``
    for a = 4..7 and 1 for a = 8. These float32 formulas reproduce the float32 map exactly
    (with or without a fused multiply-add; tested for every code), with 3 selects instead of 8.
    """
    c = code - 7
    a = c.abs()
    mag = torch.where(a >= 4, 0.4375 + (a - 5) * 0.225, 0.0325 + (a - 2) * 0.045)
    mag = torch.where(a >= 8, 1.0, mag)
    mag = torch.where(a <= 1, a * 0.0055, mag)
    return torch.where(c < 0, -mag, mag)


def _de_code_sr_f(x: Tensor, u: Tensor) -> Tensor:
    """Stochastically rounded :data:`DE_MAP_4BIT` code of ``x`` (float32), given uniforms ``u``.

    With ``lo <= x < hi`` the two neighbouring map values, the code of ``hi`` is taken with
    probability ``(x - lo) / (hi - lo)`` (``u < p``), else the code of ``lo``, so the dequantized
    value is unbiased: E[value] = x for x in [map[0], 1]. Values below the map's smallest entry
    (-0.8875; the map has no -1) go to code 0, as with nearest rounding. Exactly 0 stays code 7
    (p = 0), so a coordinate whose m is 0 keeps m = 0.
    Source: stochastic rounding (Gupta et al., ICML 2015, arXiv 1502.02551) on the DE map of
    arXiv 2309.01507.
    """
    code = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for value in DE_MAP_4BIT[1:]:
        code = code + (x >= value).float()  # floor code: map values <= x, minus 1
    lo = _de_value(code)
    hi = _de_value((code + 1).clamp(max=15))
    gap = hi - lo
    p = torch.where(gap > 0, (x - lo) / torch.where(gap > 0, gap, 1.0), 0.0).clamp(0.0, 1.0)
    return code + (u < p).float()


_M32 = 0xFFFFFFFF


def hash_uniform(index: Tensor, seed: Tensor | int) -> Tensor:
    """Counter-based uniforms in [0, 1) (float32, 24 random bits) from int64 ``index`` and ``seed``.

    A 32-bit integer mix (xor-shift / multiply rounds, multipliers below 2^31 so that every
    product fits in int64) of ``index + seed * 0x9E3779B9``: the same (index, seed) always give
    the same value, with no generator state, and it fuses into a compiled kernel (a CPU
    generator's ``torch.rand`` costs more than the whole 4-bit update). Not for cryptography;
    enough to decorrelate stochastic-rounding decisions across elements and steps.
    """
    x = (index + seed * 0x9E3779B9) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _linear_code_f(x: Tensor) -> Tensor:
    """Nearest :data:`LINEAR_MAP_4BIT` code (float32): ``clamp(ceil(16 x - 1/2) - 1, 0, 15)``."""
    return (torch.ceil(x * 16 - 0.5) - 1).clamp(0, 15)


def _linear_value(code: Tensor) -> Tensor:
    """:data:`LINEAR_MAP_4BIT` value of a float32 code: ``(code + 1) / 16`` (exact)."""
    return (code + 1) * 0.0625


def quantize_nearest(x: Tensor, qmap: Sequence[float] | Tensor) -> Tensor:
    """Index of the nearest code value of ``qmap`` for each element.

    Args:
        x: normalised values, any shape (values outside the map's range go to the end codes).
        qmap: 16 sorted code values.
    Returns:
        uint8 tensor of the shape of ``x`` with values in [0, 15]. Exact ties between two code
        values go to the lower one here; the specialised DE/Linear quantizers used by the
        optimizer may break exact ties the other way (a set of measure zero).
    """
    return _nearest_code_f(x.float(), as_map(qmap)).to(torch.uint8)


def quantize_de(x: Tensor) -> Tensor:
    """Nearest :data:`DE_MAP_4BIT` code (uint8), the fast symmetric form used by the optimizer."""
    return _de_code_f(x.float()).to(torch.uint8)


def quantize_de_stochastic(x: Tensor, u: Tensor) -> Tensor:
    """Stochastically rounded :data:`DE_MAP_4BIT` code (uint8) of normalised ``x`` in [-1, 1].

    Args:
        x: normalised values, any shape.
        u: uniforms in [0, 1) of the shape of ``x`` (e.g. ``torch.rand``), float32.
    Returns:
        uint8 codes; ``E[DE_MAP_4BIT[code]] = x`` for ``x >= DE_MAP_4BIT[0]``.
    Raises:
        ValueError: ``u`` and ``x`` differ in shape.
    """
    if u.shape != x.shape:
        raise ValueError(f"quantize_de_stochastic: u has shape {tuple(u.shape)}, x has {tuple(x.shape)}")
    return _de_code_sr_f(x.float(), u.float()).to(torch.uint8)


def dequantize_codes(codes: Tensor, qmap: Sequence[float] | Tensor) -> Tensor:
    """Look up code values: ``qmap[codes]`` as float32, shape of ``codes``."""
    table = map_tensor(qmap, codes.device)
    return table[codes.long()]


# --------------------------------------------------------------------------------------------
# Packing: two codes per byte
#
# Layout (ours): for n codes (padded to even), byte i holds code i in the high nibble and code
# i + n/2 in the low nibble. Both halves are contiguous, so packing and unpacking vectorise
# (the interleaved layout of lpmm/torchao needs stride-2 access).
# --------------------------------------------------------------------------------------------


def _nibble_f(packed: Tensor, half: int) -> Tensor:
    """Float32 codes of one half: ``half=0`` high nibbles (codes 0..n/2-1), ``1`` low nibbles.

    The optimizer works on the two halves separately, so every load stays contiguous and
    torch.compile vectorises it (a (2, n/2) broadcast or a concatenation does not).
    """
    q = packed.float()
    hi = torch.floor(q * 0.0625)
    return hi if half == 0 else q - 16 * hi


@functools.lru_cache(maxsize=16)
def _nibble_table(qmap: tuple[float, ...], half: int, device: torch.device) -> Tensor:
    byte = torch.arange(256)
    idx = byte >> 4 if half == 0 else byte & 15
    return torch.tensor(qmap, dtype=torch.float32)[idx].to(device)


def _nibble_value(packed: Tensor, half: int, qmap: tuple[float, ...]) -> Tensor:
    """Map values (float32) of one half of the packed codes.

    Eager: one 256-entry table lookup per byte. Under torch.compile: float arithmetic and
    selects (:func:`_de_value`, :func:`_linear_value`), which vectorise where a gather does not.
    """
    if torch.compiler.is_compiling():
        code = _nibble_f(packed, half)
        return _de_value(code) if qmap == DE_MAP_4BIT else _linear_value(code)
    return _nibble_table(qmap, half, packed.device).index_select(0, packed.int())


def pack_4bit(codes: Tensor) -> Tensor:
    """Pack 4-bit codes two per byte (code i high nibble, code i + n/2 low nibble).

    Args:
        codes: integer tensor, any shape, values in [0, 15]; flattened row-major. An odd count
            is padded with one code 0.
    Returns:
        uint8 tensor of shape ``(ceil(codes.numel() / 2),)``.
    Raises:
        ValueError: a code outside [0, 15].
    """
    flat = codes.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > 15):
        raise ValueError("pack_4bit: codes must be in [0, 15]")
    flat = flat.to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    h = flat.numel() // 2
    return (flat[:h] << 4) | flat[h:]


def unpack_4bit(packed: Tensor, numel: int | None = None) -> Tensor:
    """Inverse of :func:`pack_4bit`: uint8 codes of shape ``(numel,)`` (default ``2 * len``).

    Raises:
        ValueError: ``numel`` exceeds the packed capacity.
    """
    if numel is None:
        numel = 2 * packed.numel()
    if numel > 2 * packed.numel():
        raise ValueError(f"unpack_4bit: {numel} codes requested from {packed.numel()} bytes")
    return torch.cat([packed >> 4, packed & 15])[:numel]


# --------------------------------------------------------------------------------------------
# Quantizers: normalisation + map + packing
# --------------------------------------------------------------------------------------------


def quantize_blockwise(
    x: Tensor, qmap: Sequence[float] | Tensor, block_size: int = BLOCK_SIZE
) -> tuple[Tensor, Tensor]:
    """Block-wise quantization (paper "B128/DE" for m with ``DE_MAP_4BIT``).

    Args:
        x: floating tensor, any shape (row-major flattened; the last block zero-padded).
        qmap: 16 sorted code values in [-1, 1].
        block_size: elements per scale.
    Returns:
        ``(packed, scale)``: uint8 of shape ``(num_blocks * block_size / 2,)`` and float32 absmax
        scales of shape ``(num_blocks,)``.
    Raises:
        ValueError: ``x`` has NaN or Inf (a NaN would silently become a valid code).
    """
    if not torch.isfinite(x).all():
        raise ValueError("quantize_blockwise: x has NaN or Inf values")
    blocks = to_blocks(x.float(), block_size)
    scale = blocks.abs().amax(dim=1)
    codes = quantize_nearest(blocks / _safe(scale)[:, None], qmap)
    return pack_4bit(codes), scale


def dequantize_blockwise(
    packed: Tensor,
    scale: Tensor,
    qmap: Sequence[float] | Tensor,
    shape: Sequence[int],
    block_size: int = BLOCK_SIZE,
) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: float32 tensor of ``shape``.

    ``scale`` may hold more blocks than ``shape`` needs (trailing all-padding blocks, as in the
    optimizer's state, which rounds the block count up to even); they are dropped.

    Raises:
        ValueError: ``packed``/``scale`` sizes do not match each other or do not cover ``shape``.
    """
    numel = math.prod(shape)
    nb = scale.numel()
    if nb < num_blocks(numel, block_size) or packed.numel() * 2 != nb * block_size:
        raise ValueError(
            f"dequantize_blockwise: shape {tuple(shape)} with block {block_size} needs at least "
            f"{num_blocks(numel, block_size)} scales and 2 * bytes == scales * block_size, got "
            f"{scale.numel()} scales and {packed.numel()} bytes"
        )
    values = dequantize_codes(unpack_4bit(packed), qmap)
    return (values.view(nb, block_size) * scale.float()[:, None]).view(-1)[:numel].view(shape)


def quantize_rank1(x: Tensor, qmap: Sequence[float] | Tensor) -> tuple[Tensor, Tensor]:
    """Rank-1 quantization (paper "Rank-1/Linear" for v with ``LINEAR_MAP_4BIT``).

    Args:
        x: floating tensor with >= 1 dims.
        qmap: 16 sorted code values.
    Returns:
        ``(packed, factors)``: uint8 of shape ``(ceil(numel / 2),)`` and the float32 rank-1
        factors concatenated, shape ``(sum(x.shape),)`` (see :func:`split_factors`).
    Raises:
        ValueError: NaN/Inf in ``x`` or a 0-d ``x``.
    """
    if not torch.isfinite(x).all():
        raise ValueError("quantize_rank1: x has NaN or Inf values")
    factors = rank1_factors(x)
    codes = quantize_nearest(x.float() / _safe(rank1_scale(factors)), qmap)
    return pack_4bit(codes), flatten_factors(factors)


def dequantize_rank1(
    packed: Tensor, factors: Tensor, qmap: Sequence[float] | Tensor, shape: Sequence[int]
) -> Tensor:
    """Inverse of :func:`quantize_rank1`: float32 tensor of ``shape``.

    The codes are the first ``numel`` of ``unpack_4bit(packed)``; ``packed`` may be longer
    (the optimizer pads v's codes to whole B128 blocks).

    Raises:
        ValueError: ``packed`` too short or ``factors`` not of length ``sum(shape)``.
    """
    numel = math.prod(shape)
    if packed.numel() * 2 < numel:
        raise ValueError(f"dequantize_rank1: {tuple(shape)} needs >= {-(-numel // 2)} bytes, got {packed.numel()}")
    scale = rank1_scale(split_factors(factors.float(), shape))
    values = dequantize_codes(unpack_4bit(packed, numel), qmap)
    return values.view(shape) * scale
