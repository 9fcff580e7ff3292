"""AdamW with 4-bit optimizer states (Li, Chen, Zhu, NeurIPS 2023, arXiv 2309.01507).

A drop-in ``torch.optim`` optimizer. Each step, for each parameter: dequantize m and v to
float32, run the ordinary decoupled-weight-decay Adam update in float32 (Loshchilov & Hutter
2019, Algorithm 2), then quantize the new m and v (see :mod:`echotrain.optim.quant`):

- m: "B128/DE" -- block-wise absmax scales (block 128) and the signed dynamic-exponent map.
- v: "Rank-1/Linear" -- rank-1 scales and the zero-free linear map; 1-D tensors (after
  dropping size-1 dims) use B128/Linear instead. With ``factor_second_moment=True`` ("4-bit
  Factor", paper section 4.3) v of tensors with >= 2 dims is replaced by Adafactor's float32
  row and column statistics (Shazeer & Stern 2018, eq. 4-5).
- Tensors with ``min_quantize_numel`` (4096) elements or fewer keep float32 m and v (paper's
  rule); they are updated together with ``torch._foreach_*`` ops.

Only one parameter's float32 m and v exist at a time. Why a parameter whose gradient is always
0 does not drift: its m is exactly 0 (0 maps to the DE map's exact 0 code, whatever the block's
scale), so its update ``m / (sqrt(v) + eps)`` is exactly 0 even though its v dequantizes to
``scale / 16 > 0``; only decoupled weight decay moves it, as in float32 AdamW.

The state is plain tensors (uint8 codes, float32 scales, a float32 ``step``), so
``torch.save`` / ``torch.load(weights_only=True)`` work, and :meth:`AdamW4bit.load_state_dict`
keeps their dtypes (``torch.optim.Optimizer`` would cast float state to the parameter dtype).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import warnings
from typing import Any, Iterable, NamedTuple

import torch
from torch import Tensor

from echotrain.optim import quant
from echotrain.optim.registry import ADAM_SETTINGS, register_optimizer
from echotrain.optim.finite import first_nonfinite_grad, nonfinite_grad_message

__all__ = ["AdamW4bit", "adamw4bit_tensor_update_"]

_TINY = torch.finfo(torch.float32).tiny
# Inductor inlines (recomputes) a pointwise value in each of its consumers unless it has more
# than this many ops; its CPU default (50) recomputed the new m's dequantization three times per
# step, its GPU default (30) stores it once: with the (nb, block) buffer of the new m, 15% faster
# per piece on CPU (docs/benchmarks.md, "Faster CPU step").
_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 30}


def _compile_options(stochastic: bool) -> dict[str, Any] | None:
    """Inductor options of the compiled update (``_INDUCTOR_OPTIONS`` for round-to-nearest m).

    With ``ATEN_CPU_CAPABILITY`` set (kernels capped below the host's instruction set, e.g. to
    measure AVX2 on an AVX-512 host), torch 2.13's FX graph cache reuses a graph compiled in a
    process without the cap (and the reverse), and that graph computes a wrong update: after 3
    steps on a (512, 1024) parameter 450,000 of its elements were off by up to 47 (a shared
    ``/tmp/torchinductor_$USER``; docs/benchmarks.md, "AdamW with 4-bit states"). The cache is
    then off for this compile: the update is compiled anew in each process (~15-35 s)."""
    options = {} if stochastic else dict(_INDUCTOR_OPTIONS)
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        options["fx_graph_cache"] = False
    return options or None


def _squeezed_shape(shape: torch.Size) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _num_blocks_even(numel: int, block_size: int) -> int:
    """B128 block count rounded up to even, so each packed half holds whole blocks."""
    nb = quant.num_blocks(numel, block_size)
    return nb + nb % 2


class _Piece(NamedTuple):
    """One quantization unit: rows ``[r0, r1)`` of the squeezed tensor, and where its codes and
    scales live in the parameter's flat state buffers (offsets in elements of each buffer)."""

    r0: int
    r1: int
    shape: tuple[int, ...]
    nb: int  # B128 blocks (even)
    codes: tuple[int, int]  # byte range in exp_avg_codes / exp_avg_sq_codes
    m_scale: tuple[int, int]
    v_scale: tuple[int, int]  # rank-1 factors or block scales
    v_row: tuple[int, int]  # factor: row statistics
    v_col: tuple[int, int]  # factor: column statistics


@functools.lru_cache(maxsize=1024)
def _pieces(shape: tuple[int, ...], kind: str, block_size: int, chunk_numel: int | None) -> tuple[_Piece, ...]:
    """Split a tensor along its first (squeezed) dim into pieces of at most ``chunk_numel``
    elements (whole rows; one piece when ``chunk_numel`` is None or the tensor is smaller).
    Cached: it runs for every parameter at every step."""
    qshape = _squeezed_shape(shape) or (1,)
    rows, row_numel = qshape[0], math.prod(qshape[1:])
    k = 1 if not chunk_numel else max(1, min(rows, -(-rows * row_numel // chunk_numel)))
    per = -(-rows // k)
    out, off = [], dict(codes=0, m_scale=0, v_scale=0, v_row=0, v_col=0)
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        pshape = (r1 - r0, *qshape[1:])
        nb = _num_blocks_even(math.prod(pshape), block_size)
        sizes = dict(codes=nb * block_size // 2, m_scale=nb, v_scale=0, v_row=0, v_col=0)
        if kind == "rank1":
            sizes["v_scale"] = sum(pshape)
        elif kind == "block":
            sizes["v_scale"] = nb
        elif kind == "factor":
            sizes["v_row"] = math.prod(pshape[:-1])
            sizes["v_col"] = math.prod(pshape[:-2] + pshape[-1:])
        ranges = {key: (off[key], off[key] + n) for key, n in sizes.items()}
        off = {key: ranges[key][1] for key in off}
        out.append(_Piece(r0, r1, pshape, nb, **ranges))
    return tuple(out)


def _v_kind(p: Tensor, group: dict[str, Any]) -> str:
    """'fp32' | 'rank1' | 'block' | 'factor' for parameter ``p`` in ``group``."""
    if p.numel() <= group["min_quantize_numel"]:
        return "fp32"
    if len(_squeezed_shape(p.shape)) < 2:
        return "block"
    return "factor" if group["factor_second_moment"] else "rank1"


def _pad_to(x: Tensor, length: int) -> Tensor:
    return x if x.numel() == length else torch.nn.functional.pad(x, (0, length - x.numel()))


def adamw4bit_tensor_update_(
    p: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_scale: Tensor,
    v_codes: Tensor | None,
    v_scale: Tensor | None,
    v_row: Tensor | None,
    v_col: Tensor | None,
    step: Tensor | float,
    lr: Tensor | float,
    beta1: Tensor | float,
    beta2: Tensor | float,
    eps: Tensor | float,
    weight_decay: Tensor | float,
    *,
    v_kind: str,
    block_size: int,
    m_seed: Tensor | None = None,
    m_codes_in: Tensor | None = None,
    v_codes_in: Tensor | None = None,
) -> None:
    """One AdamW step for one parameter with 4-bit m (and 4-bit or factored v), in place.

    Pure tensor math without Python branches on values, so it can be ``torch.compile``d. The
    flattened tensor is zero-padded to ``L = nb * block_size`` elements (``nb`` even) and
    processed as two contiguous halves, which are exactly the high and low nibbles of the
    packed codes (see :mod:`echotrain.optim.quant`).

    Args:
        p: parameter (or a piece of its rows) with size-1 dims removed, float32 or bfloat16;
            updated in place (math in float32). Rank-1 and Factor statistics use its dims.
        grad: gradient, shape of ``p``.
        m_codes, m_scale: packed B128/DE codes (uint8, ``L / 2``) and float32 block scales
            (``nb``) of m; replaced in place by the new m.
        v_codes, v_scale: packed Linear codes of v (uint8, ``L / 2``) and, for ``v_kind``
            'rank1', the concatenated rank-1 factors (``sum(squeezed shape)``), for 'block'
            the block scales (``nb``).
        v_row, v_col: for 'factor', float32 Adafactor statistics of shapes ``shape[:-1]`` and
            ``shape[:-2] + shape[-1:]`` of the squeezed shape.
        step: the step count t after incrementing (>= 1).
        lr, beta1, beta2, eps, weight_decay: AdamW hyperparameters (floats or 0-d tensors).
        v_kind: 'rank1' | 'block' | 'factor'.
        block_size: B128 block size.
        m_seed: None for round-to-nearest m codes (the paper's rule), or a 0-d int64 seed for
            stochastically rounded m codes (``m_rounding="stochastic"``, ours): element k of
            the padded piece uses ``quant.hash_uniform(k, m_seed)`` (see
            :func:`echotrain.optim.quant.quantize_de_stochastic`).
        m_codes_in, v_codes_in: None, or the same packed codes as ``m_codes`` / ``v_codes``
            widened to int32 (``L / 2``), read instead of them (the new codes are still written
            to the uint8 tensors); the result is the same bit for bit. Compiled for 256-bit
            AVX2, a uint8 load of 8 codes goes through a stack buffer, which made unpacking the
            nibbles 3.2x slower than from int32 (:class:`AdamW4bit`'s ``widen_codes``).
    Source: AdamW (Loshchilov & Hutter 2019, Alg. 2) with the quantizers of arXiv 2309.01507.
    """
    n = p.numel()
    nb = m_scale.numel()
    length = nb * block_size
    half = length // 2
    bh = nb // 2  # blocks per half
    qshape = tuple(p.shape)
    g = _pad_to(grad.reshape(-1).float(), length)
    p32 = _pad_to(p.reshape(-1).float(), length)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    decay = 1 - lr * weight_decay
    if isinstance(step_size, Tensor):
        # One small buffer: compiled, the scalars are then computed once per call instead of in
        # every iteration of the elementwise loop (two powf calls per 16 elements on CPU).
        step_size, bias_correction2_sqrt, decay = torch.stack([step_size, bias_correction2_sqrt, decay]).unbind()

    if v_kind == "factor":
        g2 = (g[:n] * g[:n]).view(qshape)
        row = beta2 * v_row + (1 - beta2) * g2.mean(dim=-1)
        col = beta2 * v_col + (1 - beta2) * g2.mean(dim=-2)
        row_mean = row.mean(dim=-1, keepdim=True).clamp(min=_TINY)
        v_all = _pad_to(((row / row_mean).unsqueeze(-1) * col.unsqueeze(-2)).reshape(-1), length)
    elif v_kind == "rank1":
        v_scale_all = _pad_to(quant.rank1_scale(torch.split(v_scale, list(qshape))).reshape(-1), length)

    new_p, new_m, new_v = [], [], []
    for i in (0, 1):
        gi = g[i * half : (i + 1) * half]
        mi = quant._nibble_value(m_codes if m_codes_in is None else m_codes_in, i, quant.DE_MAP_4BIT).view(bh, block_size)
        mi = (mi * m_scale[i * bh : (i + 1) * bh, None]).view(-1)
        mi = mi + (1 - beta1) * (gi - mi)  # lerp: beta1 m + (1 - beta1) g
        if v_kind == "factor":
            vi = v_all[i * half : (i + 1) * half]
        else:
            vi = quant._nibble_value(v_codes if v_codes_in is None else v_codes_in, i, quant.LINEAR_MAP_4BIT)
            if v_kind == "rank1":
                vi = vi * v_scale_all[i * half : (i + 1) * half]
            else:
                vi = (vi.view(bh, block_size) * v_scale[i * bh : (i + 1) * bh, None]).view(-1)
            vi = beta2 * vi + (1 - beta2) * (gi * gi)
        denom = vi.sqrt() / bias_correction2_sqrt + eps
        new_p.append(p32[i * half : (i + 1) * half] * decay - step_size * (mi / denom))
        new_m.append(mi.view(bh, block_size))
        new_v.append(vi)
    p.copy_(torch.cat(new_p)[:n].view(p.shape))

    # Quantize the new m: B128/DE, one half (= one nibble) at a time.
    # (multiplying by a per-block reciprocal instead of dividing every element: same codes up to
    # float rounding at exact midpoints, and a division per element is the costliest op here)
    # (one (nb, block) buffer for both halves: inductor then writes the new m once instead of
    # recomputing its dequantization in the absmax and the quantizer loops)
    m_all = torch.cat(new_m)
    m_absmax = m_all.abs().amax(dim=1)
    m_inv = 1 / m_absmax.clamp(min=_TINY)
    m_halves = [(m_all[i * bh : (i + 1) * bh], m_inv[i * bh : (i + 1) * bh, None]) for i in (0, 1)]
    if m_seed is None:
        m_code = [quant._de_code_f(mi * inv).view(-1) for mi, inv in m_halves]
    else:
        m_code = []
        for i, (mi, inv) in enumerate(m_halves):
            index = torch.arange(i * half, (i + 1) * half, device=mi.device, dtype=torch.int64).view(bh, block_size)
            u = quant.hash_uniform(index, m_seed)
            m_code.append(quant._de_code_sr_f(mi * inv, u).view(-1))
    m_codes.copy_((m_code[0] * 16 + m_code[1]).to(torch.uint8))
    m_scale.copy_(m_absmax)

    # Quantize the new v: Rank-1/Linear, B128/Linear, or keep the float32 factors.
    if v_kind == "factor":
        v_row.copy_(row)
        v_col.copy_(col)
        return
    if v_kind == "rank1":
        vq = torch.cat(new_v)[:n].view(qshape)
        dims = range(len(qshape))
        factors = [vq.amax(dim=[e for e in dims if e != d]) for d in dims]
        # 1 / min(row_i, col_j) = max(1 / row_i, 1 / col_j): reciprocals of the factors only
        # (concatenated: one small buffer, so that each reciprocal is computed once, not for
        # every 16 elements of the loop that reads it)
        neg_recips = torch.cat([-(1 / f.clamp(min=_TINY)) for f in factors])
        inv = quant.rank1_scale(torch.split(neg_recips, list(qshape)))  # min of negatives
        inv_all = _pad_to(inv.reshape(-1), length)
        v_code = [quant._linear_code_f(vi * -inv_all[i * half : (i + 1) * half]) for i, vi in enumerate(new_v)]
        v_scale.copy_(torch.cat(factors))
    else:
        v_blocks = [vi.view(bh, block_size) for vi in new_v]
        v_scales = [vb.amax(dim=1) for vb in v_blocks]
        v_code = [quant._linear_code_f(vb * (1 / s.clamp(min=_TINY))[:, None]).view(-1) for vb, s in zip(v_blocks, v_scales)]
        v_scale.copy_(torch.cat(v_scales))
    v_codes.copy_((v_code[0] * 16 + v_code[1]).to(torch.uint8))


def _update_nearest_(*args: Any, hp: Tensor, **kwargs: Any) -> None:
    """:func:`adamw4bit_tensor_update_` with the six hyperparameters (step, lr, beta1, beta2, eps,
    weight_decay) in one float32 tensor ``hp``: the compiled call then guards one tensor instead
    of six. Compiled with ``_INDUCTOR_OPTIONS``, which help round-to-nearest m but made the
    stochastic-rounding update 4x slower (its rounding decisions were stored and re-read), so
    :func:`_update_stochastic_` is compiled apart (its own code object, its own cache)."""
    adamw4bit_tensor_update_(*args, *hp.unbind(), **kwargs)


def _update_stochastic_(*args: Any, hp: Tensor, **kwargs: Any) -> None:
    """:func:`_update_nearest_` for ``m_rounding="stochastic"``, compiled without the options."""
    adamw4bit_tensor_update_(*args, *hp.unbind(), **kwargs)


class AdamW4bit(torch.optim.Optimizer):
    """AdamW whose m and v are stored in 4 bits (paper: "4-bit AdamW"; "4-bit Factor").

    Args:
        params: parameters or param groups (dicts), as for ``torch.optim.AdamW``. Per-group keys:
            ``lr``, ``betas``, ``eps``, ``weight_decay``, ``factor_second_moment``,
            ``block_size``, ``min_quantize_numel``, ``chunk_numel``.
        lr: learning rate, float or 0-d tensor (default 1e-3).
        betas: (beta1, beta2) (default (0.9, 0.999)).
        eps: added to sqrt(v_hat) (default 1e-8).
        weight_decay: decoupled weight decay coefficient lambda: ``p *= 1 - lr * lambda``
            (default 1e-2, as ``torch.optim.AdamW``).
        factor_second_moment: "4-bit Factor" (paper section 4.3): v of tensors with >= 2 dims is
            Adafactor's float32 row/column statistics instead of 4-bit codes (default False).
        block_size: elements per scale for B128 (default 128, the paper's).
        min_quantize_numel: tensors with this many elements or fewer keep float32 m and v
            (default 4096, the paper's rule).
        chunk_numel: (ours) a tensor with more elements is updated in pieces of whole rows
            (along its first dim) of about this many elements (at most one row more), each its
            own quantization unit: the float32 temporaries of a step are bounded by the piece,
            not by the largest tensor (an embedding), and stay in cache (2.3x vs 4.0x torch
            AdamW's step time on a 2048x1024 matrix, docs/benchmarks.md). m's B128 blocks are
            unchanged; v's rank-1 column statistics (and Factor's) become per piece, which is
            finer than the paper's and costs 4 bytes per column per extra piece. ``None``: the
            paper's whole-tensor statistics. Default 2**18.
        compile: run the per-piece update through ``torch.compile`` (one fused kernel per
            piece shape and kind; compiling takes 5-30 s per shape on CPU, cached on disk by
            inductor). ``None`` (default): compiled where it can build (a C++ compiler on CPU,
            Triton on CUDA) -- on CPU it measured 5-15x faster than eager -- else eager; a
            failed compilation warns and falls back to eager. ``ECHOTRAIN_OPTIM_COMPILE=0/1``
            overrides the ``None`` default.
        m_rounding: (ours) how the new m is rounded to its 4-bit codes: ``"nearest"`` (default,
            the paper's rule) or ``"stochastic"`` (unbiased stochastic rounding between the two
            neighbouring DE codes). With nearest rounding and beta1 = 0.9 a code rarely moves
            by itself (0.9 x a code rounds back to it), so m of coordinates whose gradient
            fades or flips stays stuck at a stale value relative to its block's absmax; on a
            dense least-squares problem this, not v's quantizer, is what makes 4-bit AdamW
            converge slower than fp32 (docs/design/optimizers.md, "4-bit quality on dense
            problems"). No extra state: the uniforms are a counter-based hash of (``seed``,
            parameter index, piece, step, element), so runs are reproducible and a resumed run
            draws the same ones.
        seed: (ours) seed of the stochastic-rounding uniforms (default 0).
        widen_codes: (ours) the compiled update reads int32 copies of the packed uint8 codes
            (ATen conversions before the kernel, one for m's codes and one for v's unless
            Factor; 1 MiB of temporaries for a 2**18-element piece) instead of the codes
            themselves. Inductor's 256-bit (AVX2) CPU kernels load 8 uint8 codes at a time
            through a stack buffer; with int32 copies the 4-bit step took 0.74-0.77x the time
            under AVX2 at 1 thread (0.92-0.93x at 2), and 0.95-1.11x at 1 thread, 1.29x at 2
            under AVX-512, where uint8 loads are masked loads (docs/benchmarks.md, "int32 codes
            for inductor's AVX2 kernels"). ``None`` (default): widen when the step is compiled
            for a CPU whose inductor vector ISA is AVX2; never on GPUs. ``True`` / ``False``
            force it (any device); any other value is a ``ValueError``. Results are
            bit-identical either way.
        check_finite: before writing anything, check every gradient of the step
            (:mod:`echotrain.optim.finite`: NaN, Inf, or |g| whose square overflows float32);
            on a bad one raise ``FloatingPointError`` naming the parameter (param group, index,
            shape) with every parameter and every state tensor unchanged, so the caller can skip
            the step and go on (default True; one max-abs reduction per gradient, one sync).
            ``False``: no check (a bad gradient then corrupts the parameter and its state).
        skip_nonfinite: with ``check_finite``, skip such a step instead of raising: nothing is
            written and :attr:`skipped_steps` is incremented (default False).

    Raises:
        ValueError: invalid hyperparameters (negative lr/eps/weight_decay, betas outside [0, 1),
            block_size not a positive even number, m_rounding not "nearest"/"stochastic",
            sparse gradients at step time).

    State per parameter (plain tensors): ``step`` (float32, 0-d); small tensors: ``exp_avg``,
    ``exp_avg_sq`` (float32); others: ``exp_avg_codes`` (uint8), ``exp_avg_scale`` (float32),
    and ``exp_avg_sq_codes`` + ``exp_avg_sq_scale`` (Rank-1 factors or B128 scales) or
    ``exp_avg_sq_row`` + ``exp_avg_sq_col`` (Factor). Each is the concatenation over the
    tensor's pieces (``chunk_numel``); within a piece the flattened tensor is zero-padded to an
    even number of B128 blocks and byte i packs element i (high nibble) with element i + L/2.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        factor_second_moment: bool = False,
        block_size: int = quant.BLOCK_SIZE,
        min_quantize_numel: int = 4096,
        chunk_numel: int | None = 2**18,
        compile: bool | None = None,
        check_finite: bool = True,
        skip_nonfinite: bool = False,
        m_rounding: str = "nearest",
        seed: int = 0,
        widen_codes: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            factor_second_moment=factor_second_moment,
            block_size=block_size,
            min_quantize_numel=min_quantize_numel,
            chunk_numel=chunk_numel,
            m_rounding=m_rounding,
        )
        _check_hparams(defaults, "defaults")
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            _check_hparams(group, f"param_groups[{i}]")
        self.compile = compile  # None: decided per device at the first step
        self.check_finite = check_finite
        self.skip_nonfinite = skip_nonfinite
        #: steps skipped because of a bad gradient (``skip_nonfinite=True``)
        self.skipped_steps = 0
        self.seed = int(seed)
        if widen_codes is not None and not isinstance(widen_codes, bool):
            raise ValueError(f"widen_codes must be True, False or None, got {widen_codes!r}")
        self.widen_codes = widen_codes
        self._widen_auto: dict[str, bool] = {}  # widen_codes=None: the decision per device type
        self._compiled: dict[bool, Any] | None = None  # compiled update per m_rounding == "stochastic"

    # ---------------------------------------------------------------- state layout

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        kind = _v_kind(p, group)
        dev = p.device
        state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
        if kind == "fp32":
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            return state
        pieces = _pieces(tuple(p.shape), kind, group["block_size"], group["chunk_numel"])
        last = pieces[-1]
        # Code 0x77: both nibbles are code 7 of the DE map, 0.0 (with scale 0 any code gives 0).
        state["exp_avg_codes"] = torch.full((last.codes[1],), 0x77, dtype=torch.uint8, device=dev)
        state["exp_avg_scale"] = torch.zeros(last.m_scale[1], dtype=torch.float32, device=dev)
        if kind == "factor":
            state["exp_avg_sq_row"] = torch.zeros(last.v_row[1], dtype=torch.float32, device=dev)
            state["exp_avg_sq_col"] = torch.zeros(last.v_col[1], dtype=torch.float32, device=dev)
        else:
            state["exp_avg_sq_codes"] = torch.zeros(last.codes[1], dtype=torch.uint8, device=dev)
            state["exp_avg_sq_scale"] = torch.zeros(last.v_scale[1], dtype=torch.float32, device=dev)
        return state

    # ---------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        """Perform one optimization step (``closure`` re-evaluates the loss, as in torch.optim).

        Raises:
            ValueError: a sparse gradient (nothing is written).
            FloatingPointError: (``check_finite`` without ``skip_nonfinite``) a gradient holds
                NaN/Inf; raised before anything is written (see :mod:`echotrain.optim.finite`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"AdamW4bit does not support sparse gradients (param_groups[{gi}] param {pi})")
        if self.check_finite:
            hit = first_nonfinite_grad(self.param_groups)
            if hit is not None:
                if self.skip_nonfinite:
                    self.skipped_steps += 1
                    return loss
                raise FloatingPointError(nonfinite_grad_message("AdamW4bit", hit))
        with self._compile_config():
            for gi, group in enumerate(self.param_groups):
                self._step_group(gi, group)
        return loss

    def _compile_config(self):
        """One kernel per (shape, dtype, v_kind): a model has more distinct shapes than dynamo's
        default recompile limit (8), past which it silently runs eager; raised for this step
        only (entered once per step: it costs ~10 us)."""
        if self.compile is None:  # decided by the device of the first parameter with a gradient
            p = next((p for g in self.param_groups for p in g["params"] if p.grad is not None), None)
            if p is None:
                return contextlib.nullcontext()
            self.compile = _compile_available(p.device)
        if not self.compile:
            return contextlib.nullcontext()
        return torch._dynamo.config.patch(recompile_limit=max(256, torch._dynamo.config.recompile_limit))

    def _step_group(self, gi: int, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        hp_cache: dict[tuple, tuple] = {}  # 0-d hyperparameter tensors per (step count, device)
        small: list[tuple[Tensor, dict[str, Tensor]]] = []
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(self._init_state(p, group))
            state["step"] += 1
            if "exp_avg" in state:
                small.append((p, state))
                continue
            self._update_quantized(p, state, group, lr, beta1, beta2, index=(gi, pi), hp_cache=hp_cache)
        if small:
            self._update_small(small, group, lr, beta1, beta2)

    def _update_quantized(self, p, state, group, lr, beta1, beta2, index=(0, 0), hp_cache=None) -> None:
        kind = _v_kind(p, group)
        stochastic = group["m_rounding"] == "stochastic"
        pieces = _pieces(tuple(p.shape), kind, group["block_size"], group["chunk_numel"])
        qshape = _squeezed_shape(p.shape) or (1,)
        target = p if p.is_contiguous() else p.contiguous()
        p_rows, g_rows = target.view(qshape), p.grad.reshape(qshape)
        step = float(state["step"])
        hp = (step, float(lr), beta1, beta2, group["eps"], group["weight_decay"])
        if self.compile is None:
            self.compile = _compile_available(p.device)
        if self.compile:  # one float32 tensor, so that a new lr or step does not recompile
            hp_cache = {} if hp_cache is None else hp_cache  # shared by a group's parameters
            key = (step, p.device)
            if key not in hp_cache:
                hp_cache[key] = torch.tensor(hp, dtype=torch.float32, device=p.device)
            hp = hp_cache[key]
        for k, piece in enumerate(pieces):
            whole = len(pieces) == 1
            sl = lambda key, rng: state[key][rng[0] : rng[1]] if key in state else None  # noqa: E731
            args = (
                p_rows if whole else p_rows[piece.r0 : piece.r1],
                g_rows if whole else g_rows[piece.r0 : piece.r1],
                sl("exp_avg_codes", piece.codes),
                sl("exp_avg_scale", piece.m_scale),
                sl("exp_avg_sq_codes", piece.codes),
                sl("exp_avg_sq_scale", piece.v_scale),
                None if kind != "factor" else state["exp_avg_sq_row"][piece.v_row[0] : piece.v_row[1]].view(piece.shape[:-1]),
                None if kind != "factor" else state["exp_avg_sq_col"][piece.v_col[0] : piece.v_col[1]].view(piece.shape[:-2] + piece.shape[-1:]),
            )
            seed = None
            if stochastic:  # one stream per (seed, parameter, piece, step): reproducible and resume-exact
                seed = torch.tensor(_mix(self.seed, *index, k, int(state["step"])), dtype=torch.int64, device=p.device)
            self._update_piece(args, hp, kind, group["block_size"], seed)
        if target is not p:
            p.copy_(target)

    def _update_piece(self, args, hp, kind: str, block_size: int, m_seed: Tensor | None = None) -> None:
        if self.compile:
            if self._compiled is None:
                self._compiled = {}
            stochastic = m_seed is not None
            if stochastic not in self._compiled:
                fn, options = (_update_stochastic_ if stochastic else _update_nearest_), _compile_options(stochastic)
                self._compiled[stochastic] = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
            widened = {}
            if self._widen(args[0].device):  # read int32 copies of the codes (see widen_codes)
                widened = {"m_codes_in": args[2].to(torch.int32),
                           "v_codes_in": None if args[4] is None else args[4].to(torch.int32)}
            try:  # (inside step's _compile_config: the raised recompile limit)
                self._compiled[stochastic](*args, hp=hp, v_kind=kind, block_size=block_size, m_seed=m_seed, **widened)
                return
            except Exception as err:
                if not _is_compile_error(err):
                    raise
                warnings.warn(f"AdamW4bit: torch.compile failed ({type(err).__name__}: {err}); using eager", stacklevel=4)
                self.compile = False
                hp = tuple(float(x) for x in hp)
        adamw4bit_tensor_update_(*args, *hp, v_kind=kind, block_size=block_size, m_seed=m_seed)

    def _widen(self, device: torch.device) -> bool:
        """Whether the compiled update reads int32 copies of the codes (``widen_codes``)."""
        if self.widen_codes is not None:
            return self.widen_codes
        if device.type not in self._widen_auto:
            self._widen_auto[device.type] = _narrow_uint8_loads(device)
        return self._widen_auto[device.type]

    def _update_small(self, small, group, lr, beta1, beta2) -> None:
        """float32 AdamW for the small tensors of one group, vectorised with ``_foreach`` ops."""
        lr = float(lr)
        params = [p for p, _ in small]
        p32 = [p if p.dtype == torch.float32 else p.float() for p in params]
        grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in params]
        exp_avgs = [s["exp_avg"] for _, s in small]
        exp_avg_sqs = [s["exp_avg_sq"] for _, s in small]
        steps = [float(s["step"]) for _, s in small]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(p32, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(p32, exp_avgs, denom, [-lr / (1 - beta1**t) for t in steps])
        for p, q in zip(params, p32):
            if q is not p:
                p.copy_(q)

    # ---------------------------------------------------------------- state_dict

    #: attributes of ours that ``copy.deepcopy`` and pickling keep (torch's ``Optimizer.__getstate__``
    #: keeps only defaults, state and param_groups); the compiled functions are rebuilt on first use
    _PICKLED = ("compile", "check_finite", "skip_nonfinite", "skipped_steps", "seed", "widen_codes", "_widen_auto")

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self._PICKLED}, "_compiled": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, keeping the saved dtypes.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter's dtype
        (bf16 scales would lose bits); here every state tensor keeps its saved dtype and only
        moves to the parameter's device.

        Raises:
            ValueError: group/parameter counts differ (from torch), or a parameter's saved state
                does not have the layout this optimizer expects (e.g. saved with a different
                ``factor_second_moment`` or ``block_size``).
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # settings added after the state dict was saved
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            expected = self._init_state(torch.empty(p.shape, dtype=p.dtype, device="meta"), group)
            if set(saved) != set(expected):
                raise ValueError(
                    f"load_state_dict: state of a parameter of shape {tuple(p.shape)} has keys "
                    f"{sorted(saved)}, expected {sorted(expected)} (different factor_second_moment, "
                    "block_size or min_quantize_numel?)"
                )
            for key, ref in expected.items():
                value = saved[key]
                if value.shape != ref.shape or value.dtype != ref.dtype:
                    raise ValueError(
                        f"load_state_dict: {key} of a parameter of shape {tuple(p.shape)} is "
                        f"{value.dtype}{tuple(value.shape)}, expected {ref.dtype}{tuple(ref.shape)}"
                    )
                self.state[p][key] = value.to(device="cpu" if key == "step" else p.device, copy=True)


def _mix(*values: int) -> int:
    """A 31-bit seed from a few small ints (for the stochastic-rounding hash)."""
    h = 0x12345
    for v in values:
        h = (h * 1_000_003 + int(v) + 0x9E37) % 2_147_483_629
    return h


def _check_hparams(group: dict[str, Any], where: str) -> None:
    lr = group["lr"]
    lr_value = float(lr) if not isinstance(lr, Tensor) or lr.numel() == 1 else None
    if lr_value is None or not math.isfinite(lr_value) or lr_value < 0:
        raise ValueError(f"{where}: lr must be a finite number >= 0 (float or 1-element tensor), got {lr!r}")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two values in [0, 1), got {betas!r}")
    if not (math.isfinite(group["eps"]) and group["eps"] >= 0):
        raise ValueError(f"{where}: eps must be finite and >= 0, got {group['eps']!r}")
    if not (math.isfinite(group["weight_decay"]) and group["weight_decay"] >= 0):
        raise ValueError(f"{where}: weight_decay must be finite and >= 0, got {group['weight_decay']!r}")
    bs = group["block_size"]
    if not isinstance(bs, int) or bs <= 0 or bs % 2:
        raise ValueError(f"{where}: block_size must be a positive even int, got {bs!r}")
    chunk = group["chunk_numel"]
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"{where}: chunk_numel must be a positive int or None, got {chunk!r}")
    if group.get("m_rounding", "nearest") not in ("nearest", "stochastic"):
        raise ValueError(f"{where}: m_rounding must be 'nearest' or 'stochastic', got {group['m_rounding']!r}")
    if not isinstance(group["min_quantize_numel"], int) or group["min_quantize_numel"] < 0:
        raise ValueError(f"{where}: min_quantize_numel must be an int >= 0, got {group['min_quantize_numel']!r}")


def _is_compile_error(err: Exception) -> bool:
    mod = type(err).__module__
    return mod.startswith(("torch._dynamo", "torch._inductor")) or "BackendCompilerFailed" in type(err).__name__


def _narrow_uint8_loads(device: torch.device) -> bool:
    """Default of ``widen_codes``: True when inductor compiles CPU kernels for AVX2 (its
    ``VecAVX2``, also under ``ATEN_CPU_CAPABILITY=avx2``), whose uint8 loads of fewer than 32
    bytes go through a stack buffer. False on GPUs, AVX-512 (masked loads) and the ISAs not
    measured (NEON, SVE, VSX, none)."""
    if device.type != "cpu":
        return False
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - depends on the torch build
        return False
    return type(cpu_vec_isa.pick_vec_isa()) is cpu_vec_isa.VecAVX2


def _compile_available(device: torch.device) -> bool:
    """Default for ``compile=None``: compile where torch.compile can build kernels.

    The environment variable ``ECHOTRAIN_OPTIM_COMPILE=0`` (or ``1``) overrides it, e.g. for
    test suites that cannot afford the compilation time.

    Measured on CPU (docs/benchmarks.md): the compiled update is about 16x faster than eager
    per step, so it is the default wherever it can build -- a C++ compiler on CPU, Triton on
    CUDA. A failed compilation falls back to eager with a warning.
    """
    env = os.environ.get("ECHOTRAIN_OPTIM_COMPILE")
    if env is not None:
        return env.strip().lower() not in ("0", "false", "no", "")
    if device.type == "cpu":
        return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton

            return has_triton()
        except ImportError:  # pragma: no cover - depends on the torch build
            return False
    return False


register_optimizer("adamw4bit", "echotrain.optim.adamw4bit:AdamW4bit", takes=ADAM_SETTINGS)
