"""Device check of echotrain's AdamW4bit: compiled == eager, and step time vs torch AdamW.

For a machine with an accelerator (torch.compile generates Triton kernels on CUDA); it also
runs on CPU (``--device cpu``, small shapes, ~1 minute with a cold inductor cache). Checks:

1. the compiled DE quantizer and dequantizer equal the eager ones bit for bit (at and next to
   every midpoint, and on random values);
2. three optimizer steps with the compiled update equal the eager update within the tolerances
   of ``tests/optim/test_adamw4bit_compiled.py`` (parameters rtol 1e-5 / atol 1e-6 but for at
   most 0.1% of them, a near-tie code flip; at most 0.1% of m codes differing, m scales rtol
   1e-5), for the Rank-1 (matrices) and B128 (1-D)
   second-moment layouts, and with ``factor_second_moment=True``;
3. the median ``optimizer.step()`` time (device-synchronised wall time) against
   ``torch.optim.AdamW`` with ``foreach=True`` and ``fused=True``, on the same parameters.

Prints one JSON line per check and a final ``{"ok": ...}`` line; exits 1 when a check fails.

    python benchmarks/device_check_adamw4bit.py                  # cuda when available
    python benchmarks/device_check_adamw4bit.py --device cpu     # quick CPU run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from echotrain.devicecheck.common import (MAX_CODE_MISMATCH, first_moment_mismatch, params_agree, random_grads,
                                          random_params, sync, time_optimizer_steps)
from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit

# (matrix shapes, 1-D shapes): GPU defaults are a small transformer's worth (~9.4M parameters);
# a matrix of 2**21 elements is 8 pieces of 256 x 1024 (chunk_numel 2**18), one compiled shape.
SHAPES = {
    "cuda": ([(2048, 1024), (1024, 1024), (1024, 1024), (256, 1024)], [(1 << 20,)]),
    "cpu": ([(512, 512), (512, 512)], [(70000,)]),
}


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def check_quantizers(device: torch.device) -> dict:
    """Compiled quantize_de / _de_value equal the eager ones exactly on ``device`` (float32
    values at and next to every midpoint of the DE map, and 100,000 uniform ones in [-1, 1]).

    Returns:
        the row printed: ``check``, ``ok`` (both equal), ``quantize_ok``, ``dequantize_ok``."""
    points = torch.tensor(list(quant._DE_MIDPOINTS) + list(quant.DE_MAP_4BIT) + [1e-38, 0.0], dtype=torch.float32)
    near = torch.cat([points, torch.nextafter(points, torch.tensor(2.0)), torch.nextafter(points, torch.tensor(-2.0))])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([near, -near, torch.tensor([-0.0]), torch.rand(100_000, generator=gen) * 2 - 1]).to(device)
    codes = torch.compile(quant.quantize_de, fullgraph=True, dynamic=False)(x)
    codes_ok = torch.equal(codes, quant.quantize_de(x))
    table = torch.arange(16, dtype=torch.float32, device=device).repeat(64)
    values = torch.compile(quant._de_value, fullgraph=True, dynamic=False)(table)
    values_ok = torch.equal(values, quant.map_tensor(quant.DE_MAP_4BIT, device).repeat(64))
    row = {"check": "compiled DE quantizer/dequantizer exact", "ok": codes_ok and values_ok, "quantize_ok": codes_ok,
           "dequantize_ok": values_ok}
    _emit(row)
    return row


def check_compiled_equals_eager(shapes: list[tuple[int, ...]], device: torch.device, factor: bool, steps: int = 3) -> dict:
    """``steps`` steps of AdamW4bit (lr 1e-2) compiled vs eager on the same parameters and
    gradients (:func:`~echotrain.devicecheck.common.random_params` of ``shapes``, float32, on
    ``device``); ``factor`` is ``factor_second_moment``. They agree when at most 0.1% of the
    parameters are beyond rtol 1e-5 / atol 1e-6 and none further than ``steps`` x lr
    (:func:`~echotrain.devicecheck.common.params_agree`: a first-moment code that flips at a
    near-tie, because the compiled kernel rounds a product differently, moves its element by one
    quantisation step; seen on an H200: 1.9e-6 of the codes), at most 0.1% of the m codes differ
    and the m scales are within rtol 1e-5.

    Returns:
        the row printed: ``check``, ``factor``, ``ok``, ``steps``, ``max_abs_param_diff``,
        ``param_frac_beyond_tol``, ``max_m_code_mismatch_frac``, ``max_m_scale_rel_diff``,
        ``compile_and_run_s``; or, when torch.compile fell back to eager, ``check``, ``factor``,
        ``ok`` False and ``error``."""
    runs = {}
    lr = 1e-2
    for compiled in (False, True):
        params = random_params(shapes, device, seed=0)
        opt = AdamW4bit(params, lr=lr, factor_second_moment=factor, compile=compiled)
        t0 = time.perf_counter()
        for k in range(steps):
            for p, g in zip(params, random_grads(shapes, device, k)):
                p.grad = g
            opt.step()
        sync(device)
        runs[compiled] = (params, opt, time.perf_counter() - t0)
        if compiled and opt.compile is not True:
            row = {"check": "compiled == eager", "factor": factor, "ok": False, "error": "compilation fell back to eager"}
            _emit(row)
            return row
    (pe, oe, _), (pc, oc, t_compile) = runs[False], runs[True]
    params_ok, worst_param, frac_param = params_agree(pc, pe, bound=steps * lr)
    worst_codes, worst_scale = first_moment_mismatch(oe, pe, oc, pc)
    ok = params_ok and worst_codes < MAX_CODE_MISMATCH and worst_scale <= 1e-5
    row = {
        "check": "compiled == eager", "factor": factor, "ok": ok, "steps": steps,
        "max_abs_param_diff": worst_param, "param_frac_beyond_tol": frac_param, "max_m_code_mismatch_frac": worst_codes,
        "max_m_scale_rel_diff": worst_scale, "compile_and_run_s": round(t_compile, 1),
    }
    _emit(row)
    return row


def time_steps(shapes: list[tuple[int, ...]], device: torch.device, reps: int) -> None:
    """Median step time of AdamW4bit (compiled; and Factor) vs torch AdamW foreach / fused."""
    makers = {
        "torch_adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "echotrain_4bit": lambda ps: AdamW4bit(ps, lr=1e-3, compile=True),
        "echotrain_4bit_factor": lambda ps: AdamW4bit(ps, lr=1e-3, compile=True, factor_second_moment=True),
    }
    times, errors = time_optimizer_steps(makers, shapes, device, reps)
    for name, error in errors.items():
        _emit({"timing": name, "error": error})
    base = statistics.median(times["torch_adamw_foreach"]) if "torch_adamw_foreach" in times else None
    n = sum(torch.Size(s).numel() for s in shapes)
    for name, ts in times.items():
        med = statistics.median(ts)
        _emit({"timing": name, "params": n, "median_step_ms": round(1e3 * med, 3),
               "vs_torch_adamw_foreach": None if base is None else round(med / base, 3)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per optimizer (default 50 on cuda, 10 on cpu)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    matrices, vectors = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    shapes = matrices + vectors
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    _emit({"device": str(device), "name": name, "torch": torch.__version__, "params": sum(torch.Size(s).numel() for s in shapes)})
    t0 = time.perf_counter()
    rows = [check_quantizers(device), check_compiled_equals_eager(shapes, device, factor=False),
            check_compiled_equals_eager(matrices, device, factor=True)]
    ok = all(row["ok"] for row in rows)
    if not args.skip_timing:
        time_steps(shapes, device, args.reps or (50 if device.type == "cuda" else 10))
    _emit({"ok": bool(ok), "total_s": round(time.perf_counter() - t0, 1)})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
