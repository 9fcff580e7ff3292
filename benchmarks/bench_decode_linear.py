"""``decode_linear``: the float32 linear layers of generation through PyTorch's ``F.linear`` (MKL's
sgemm) or oneDNN's inner product, plain or on packed weights, in one process, as ratios.

Two parts:

1. **Shapes** (skipped with ``--no-shapes``): every distinct (out, in) shape of the model's
   ``nn.Linear`` layers at ``--rows`` rows (a decode step's batch), each op timed ``--calls`` times
   per arm, arms interleaved; median ms and the ratio to ``F.linear``, and the largest difference
   of the outputs (float32 rounding).
2. **Rollouts**: ``generate_rollouts`` of the job's first step (the default job: SmolLM2-135M-
   Instruct, 8 prompts x 8, 32 new tokens, temperature 1, float32) with each ``decode_linear``, the
   same RNG seed before each call, ``--reps`` rounds in alternating order after one untimed
   warm-up call of each; median wall seconds, the ratio to ``torch``, and whether each arm drew
   the same token ids as ``torch`` (they may differ where float rounding moves a sample across a
   token boundary). With ``--only MODE`` just that mode runs (no ratio) and the process's peak
   resident set (``getrusage``) is printed: run each mode in its own process to compare memory.

    python benchmarks/bench_decode_linear.py --threads 2 --reps 5
    for m in torch onednn onednn_packed; do python benchmarks/bench_decode_linear.py --no-shapes --only $m --reps 3; done
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/bench_decode_linear.py --threads 2 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _job import add_job_arguments, load_job  # noqa: E402 - the benchmarks' shared setup (benchmarks/_job.py)


def _shapes(model, rows: list[int], calls: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    op = torch.ops.mkldnn._linear_pointwise
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}, reverse=True)
    out = []
    for shape in shapes:
        w = torch.randn(shape)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for n in rows:
            x = torch.randn(n, shape[1])
            arms = {"torch": lambda: F.linear(x, w), "onednn": lambda: op(x, w, None, "none", [], ""),
                    "onednn_packed": lambda: op(x, packed, None, "none", [], "")}
            ref = arms["torch"]()
            diff = max(float((f() - ref).abs().max()) for f in arms.values())
            times: dict[str, list[float]] = {a: [] for a in arms}
            for _ in range(2):
                for f in arms.values():
                    f()
            for i in range(calls):
                for a in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                    t0 = time.perf_counter()
                    arms[a]()
                    times[a].append(time.perf_counter() - t0)
            med = {a: statistics.median(t) * 1e3 for a, t in times.items()}
            out.append({"shape": shape, "rows": n, **{f"{a}_ms": v for a, v in med.items()},
                        "onednn_ratio": med["onednn"] / med["torch"],
                        "packed_ratio": med["onednn_packed"] / med["torch"], "max_abs_diff": diff})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(ap, threads=2, reps=5)
    ap.add_argument("--rows", default="1,4,16,64", help="row counts of the shape part (comma-separated)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per arm and shape")
    ap.add_argument("--no-shapes", action="store_true", help="skip the shape part")
    ap.add_argument("--only", default=None, help="run only this decode_linear mode and print the peak resident set")
    args = ap.parse_args(argv)
    job = load_job(args)
    import torch

    from echotrain.runtime.cpu_linear import DECODE_LINEARS, onednn_linear_available
    from echotrain.runtime.rollout import generate_rollouts

    if not onednn_linear_available():
        raise SystemExit("this torch build has no oneDNN inner product (torch.ops.mkldnn._linear_pointwise)")
    cfg, model, tok, messages = job.cfg, job.model, job.tokenizer, job.messages
    print(f"# model {cfg.model or 'the default (SmolLM2-135M-Instruct)'}, {args.threads} threads, OpenMP wait {job.wait}, load avg {os.getloadavg()[0]:.1f}; "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, "
          f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')}")
    result: dict = {"shapes": []}
    if not args.no_shapes:
        result["shapes"] = _shapes(model, [int(r) for r in args.rows.split(",")], args.calls)
        print("| weight (out x in) | rows | F.linear ms | onednn | onednn_packed | max abs diff |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in result["shapes"]:
            print(f"| {r['shape'][0]} x {r['shape'][1]} | {r['rows']} | {r['torch_ms']:.3f} | {r['onednn_ratio']:.2f}x | "
                  f"{r['packed_ratio']:.2f}x | {r['max_abs_diff']:.1e} |")

    def call(mode: str, max_new: int) -> tuple[float, object]:
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        b = generate_rollouts(model, tok, messages, cfg.num_generations, max_new_tokens=max_new,
                              temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              decode_loop=cfg.decode_loop, sampler=cfg.sampler, decode_linear=mode)
        return time.perf_counter() - t0, b

    arms = list(DECODE_LINEARS) if args.only is None else [args.only]
    if args.only is not None and args.only not in DECODE_LINEARS:
        raise SystemExit(f"--only must be one of {DECODE_LINEARS}, got {args.only!r}")
    for mode in arms:
        call(mode, 2)
    times: dict[str, list[float]] = {m: [] for m in arms}
    batches = {}
    for rep in range(args.reps):
        for mode in (arms if rep % 2 == 0 else arms[::-1]):
            t, batches[mode] = call(mode, cfg.max_new_tokens)
            times[mode].append(t)
    if args.only is not None:
        import resource

        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        result[args.only] = {"s": statistics.median(times[args.only]), "peak_mb": peak_mb}
        print(f"# decode_linear={args.only}: median {result[args.only]['s']:.2f} s, peak resident set {peak_mb:.0f} MB")
        return result
    base = statistics.median(times["torch"])
    print(f"# rollouts: {cfg.prompts_per_step} prompts x {cfg.num_generations}, {cfg.max_new_tokens} new tokens, "
          f"{args.reps} reps")
    print("| decode_linear | median s | ratio | same tokens as torch | per-rep s |")
    print("|---|---:|---:|---|---|")
    for mode in arms:
        med = statistics.median(times[mode])
        same = torch.equal(batches[mode].response_ids, batches["torch"].response_ids)
        result[mode] = {"s": med, "ratio": med / base, "same_tokens": same}
        print(f"| {mode} | {med:.2f} | {med / base:.2f} | {same} | {', '.join(f'{t:.2f}' for t in times[mode])} |")
    return result


if __name__ == "__main__":
    main()
