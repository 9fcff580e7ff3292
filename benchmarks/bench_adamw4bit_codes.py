"""Reading the packed 4-bit codes as uint8 or as int32 copies in the compiled AdamW4bit update (``widen_codes``).

Two measurements, in one process (``--threads``, default 1) (run it once per instruction set, e.g. with
``ATEN_CPU_CAPABILITY=avx2`` for inductor's 256-bit kernels on an AVX-512 host):

1. parts: each part of the update compiled alone on one piece of ``--numel`` elements (median of
   ``--calls`` calls): unpacking the nibbles of uint8 codes and of int32 copies, ATen's uint8 -> int32
   conversion, the AdamW arithmetic, DE and Linear quantization;
2. step: ``step()`` of torch AdamW (foreach) and of ``AdamW4bit`` with ``widen_codes`` False and True on
   ``--pieces`` parameters of ``--shape`` each (static gradients: nothing warms the caches before a step, unlike
   a training loop), alternating for ``--rounds`` rounds (wall time, medians), and the ratios.

    python benchmarks/bench_adamw4bit_codes.py
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_adamw4bit_codes.py
    python benchmarks/bench_adamw4bit_codes.py --skip-parts --threads 2

Results in docs/benchmarks.md, "int32 codes for inductor's AVX2 kernels: `widen_codes`".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from echotrain.optim import quant
from echotrain.optim.adamw4bit import AdamW4bit, _narrow_uint8_loads


def _median_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def parts(numel: int, calls: int) -> dict[str, float]:
    """Microseconds per call of each part, compiled alone (ATen's conversion eager)."""
    half = numel // 2
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (half,), dtype=torch.uint8, generator=gen)
    codes32 = codes.to(torch.int32)
    x, z = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    y = torch.rand(numel, generator=gen) + 0.1
    out, out32 = torch.empty(numel), torch.empty(half, dtype=torch.int32)

    def unpack(c):
        return torch.cat([quant._nibble_f(c, 0), quant._nibble_f(c, 1)])

    compiled = {
        "unpack uint8 codes": lambda: out.copy_(unpack(codes)),
        "unpack int32 codes": lambda: out.copy_(unpack(codes32)),
        "AdamW arithmetic": lambda: out.copy_(x * 0.99 - 1e-3 * ((z + 0.1 * (x - z)) / ((0.999 * y + 0.001 * x * x).sqrt() / 0.3 + 1e-8))),
        "DE quantization": lambda: out.copy_(quant._de_code_f(x * 0.3)),
        "Linear quantization": lambda: out.copy_(quant._linear_code_f(y * 0.5)),
    }
    # under ATEN_CPU_CAPABILITY, inductor's FX graph cache would hand back kernels compiled without the cap
    # (echotrain.optim.adamw4bit._compile_options): compile anew
    options = {"fx_graph_cache": False} if os.environ.get("ATEN_CPU_CAPABILITY") else None
    res = {name: _median_us(torch.compile(fn, fullgraph=True, dynamic=False, options=options), calls)
           for name, fn in compiled.items()}
    res["ATen uint8 -> int32 (eager)"] = _median_us(lambda: out32.copy_(codes), calls)
    return res


def step(shape: tuple[int, ...], pieces: int, rounds: int, steps: int) -> dict[str, object]:
    """Median ms of ``step()`` of torch AdamW (foreach) and AdamW4bit with uint8 and int32 codes, alternating in
    one process, each on its own parameters and (static) gradients of the same shapes (drawn in turn from one
    seed); wall time."""
    torch.manual_seed(0)
    makers = {"torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
              "uint8": lambda ps: AdamW4bit(ps, lr=1e-3, compile=True, widen_codes=False),
              "int32": lambda ps: AdamW4bit(ps, lr=1e-3, compile=True, widen_codes=True)}
    opts = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(shape)) for _ in range(pieces)]
        for p in params:
            p.grad = torch.randn_like(p)
        opts[name] = make(params)
        for _ in range(3):  # warm-up, compilation
            opts[name].step()
    ms: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
            ms[name].append(1e3 * statistics.median(times))
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {**{f"{name}_ms": [round(v, 2) for v in values] for name, values in ms.items()},
            "int32_over_uint8": round(med["int32"] / med["uint8"], 3),
            "uint8_over_torch_adamw": round(med["uint8"] / med["torch_adamw"], 3),
            "int32_over_torch_adamw": round(med["int32"] / med["torch_adamw"], 3)}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=262144, help="elements of the piece the parts run on")
    ap.add_argument("--calls", type=int, default=200, help="calls per part (median)")
    ap.add_argument("--shape", type=int, nargs="+", default=[512, 512], help="shape of each parameter of the step")
    ap.add_argument("--pieces", type=int, default=24, help="parameters of the step")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds of the step")
    ap.add_argument("--steps", type=int, default=11, help="steps per round (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--skip-parts", action="store_true", help="time the step only")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        out = {"isa": os.environ.get("ATEN_CPU_CAPABILITY") or "the host's", "threads": args.threads,
               "widen_codes_default": _narrow_uint8_loads(torch.device("cpu"))}
        if not args.skip_parts:
            out["parts_us"] = {k: round(v, 1) for k, v in parts(args.numel, args.calls).items()}
        out["step"] = step(tuple(args.shape), args.pieces, args.rounds, args.steps)
    finally:
        torch.set_num_threads(threads)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
