"""Memory bandwidth by kernel: why the roofline's bandwidth peak is the best of three kernels.

Each kernel streams ``--mib`` MiB float32 tensors (far larger than the caches) and is counted by
the bytes it reads and writes: ``copy_`` (2 tensors' worth), triad ``torch.add(b, c, alpha, out=a)``
(3), in-place ``a.add_(b)`` (3), in-place ``a.mul_(s)`` (2), read-only ``a.sum()`` (1), and torch's
fused AdamW step over ``--params`` float32 parameters (28 bytes each: read parameter, gradient and
both moments, write three). A copy or a triad also fetches the lines it overwrites
(write-allocate), which in-place kernels do not, so their counted rates read lower for the same
memory traffic. Printed per round (best of ``--repeats`` calls): GB/s by kernel and each as a
ratio to the peak :func:`echotrain.roofline.peaks.measure_bandwidth` takes (the best of copy,
in-place add, in-place mul and sum), all in one process.

    python benchmarks/bench_bandwidth.py --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import time


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256, help="MiB per tensor")
    ap.add_argument("--params", type=int, default=134_515_008, help="AdamW parameters (default: the default job's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    n = args.mib * 2**20 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    nbytes = n * 4
    p = torch.nn.Parameter(torch.zeros(args.params))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, betas=(0.9, 0.99), fused=True)
    kernels = {
        "copy_ (2)": (2 * nbytes, lambda: a.copy_(b)),
        "triad add(out=) (3)": (3 * nbytes, lambda: torch.add(b, c, alpha=2.0, out=a)),
        "in-place add_ (3)": (3 * nbytes, lambda: a.add_(b)),
        "in-place mul_ (2)": (2 * nbytes, lambda: a.mul_(1.0)),
        "read-only sum (1)": (nbytes, lambda: a.sum()),
        "fused AdamW step (28 B/param)": (28 * args.params, opt.step),
    }
    peak_kernels = ("copy_ (2)", "in-place add_ (3)", "in-place mul_ (2)", "read-only sum (1)")
    rounds = []
    for r in range(args.rounds):
        rates = {name: moved / _best(fn, args.repeats) for name, (moved, fn) in kernels.items()}
        peak = max(rates[k] for k in peak_kernels)
        rounds.append({name: {"gb_s": rate / 1e9, "of_peak": rate / peak} for name, rate in rates.items()})
        print(f"round {r + 1} ({args.threads} threads, {args.mib} MiB tensors): peak {peak / 1e9:.1f} GB/s")
        for name, v in rounds[-1].items():
            print(f"  {name:32s} {v['gb_s']:7.1f} GB/s  {v['of_peak']:.2f} of the peak")
    return {"rounds": rounds}


if __name__ == "__main__":
    main()
