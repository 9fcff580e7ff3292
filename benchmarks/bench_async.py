"""Asynchronous against synchronous rollouts, through the real CLI: steps per second and held-out
accuracy after the same number of steps, seeds interleaved, as ratios measured in one run.

Each seed runs ``echotrain train`` twice in fresh processes, in alternating order: synchronous
(``num_threads=T``) and asynchronous (``async_rollouts=true max_staleness=K``, the same T threads
split between the rollout worker and the learner, ``rollout_threads`` / ``learner_threads`` when
given). Reported per mode: the median ``time/step`` over steps 2.. (step 1 includes the worker's
start), steps per second, the whole command's wall time, and the last ``eval/accuracy``; then the
async / sync ratio of steps per second per seed and its mean. The bound to compare against is
``benchmarks/bench_async_bound.py``'s (docs/benchmarks.md, "Off-policy rollouts").

    python benchmarks/bench_async.py                                   # the default job, 3 seeds (quiet machine: ~1.5 h)
    python benchmarks/bench_async.py --config configs/testbed_length.yaml --steps 20 --seeds 2 --eval-prompts 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(config: str | None, seed: int, mode: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One ``echotrain train`` in a fresh process; its step times, wall time and last accuracy."""
    run_dir = out / f"{mode}_s{seed}"
    cmd = [sys.executable, "-m", "echotrain.cli", "train"] + (["--config", config] if config else []) + [
        f"seed={seed}", f"steps={args.steps}", f"num_threads={args.threads}", f"eval_prompts={args.eval_prompts}",
        "eval_every=0", "plots=false", "save_final_model=false", "save_every=0", "progress=false",
        f"output_dir={run_dir}"]
    if mode == "async":
        cmd += ["async_rollouts=true", f"max_staleness={args.max_staleness}", f"async_stale={args.async_stale}"]
        cmd += [f"rollout_threads={args.rollout_threads}"] if args.rollout_threads else []
        cmd += [f"learner_threads={args.learner_threads}"] if args.learner_threads else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "eval.jsonl").exists() else []
    step_s = statistics.median(r["time/step"] for r in recs[1:]) if len(recs) > 1 else recs[0]["time/step"]
    out_rec = {"step_s": step_s, "steps_per_s": 1.0 / step_s, "wall_s": wall,
               "accuracy": evals[-1]["eval/accuracy"] if evals else float("nan"),
               # the trained samples' mean response length (every step has the same number of samples)
               "response_length": statistics.mean(r["response_length/mean"] for r in recs)}
    if mode == "async":
        out_rec["learner_wait_frac"] = statistics.mean(r["async/learner_wait_frac"] for r in recs[1:] or recs)
        out_rec["dropped"] = sum(r["async/dropped"] for r in recs)
        # batches the worker generated up to the last one trained, beyond the one per step trained
        out_rec["wasted"] = recs[-1].get("async/worker_generated", float("nan")) - len(recs)
        out_rec["staleness_mean"] = statistics.mean(r["staleness/mean"] for r in recs)
    return out_rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a train config (default: the embedded default job)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="default: the config's steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--async-stale", default="wait", help="wait (default), drop or regenerate")
    p.add_argument("--rollout-threads", type=int, default=0)
    p.add_argument("--learner-threads", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=64)
    args = p.parse_args()
    if args.steps is None:
        from echotrain.train.config import resolve_config

        args.steps = resolve_config(args.config).steps
    rows: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            order = ("sync", "async") if seed % 2 == 0 else ("async", "sync")  # interleaved
            for mode in order:
                rows[mode].append(run(args.config, seed, mode, args, Path(tmp)))
                print(f"seed {seed} {mode}: {rows[mode][-1]}", file=sys.stderr)
    print(f"| mode | median s / step | steps / s | wall s | mean response length trained (tokens) "
          f"| held-out accuracy after {args.steps} steps |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, rs in rows.items():
        acc = [r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"| {mode} | {statistics.mean(r['step_s'] for r in rs):.2f} | "
              f"{statistics.mean(r['steps_per_s'] for r in rs):.3f} | {statistics.mean(r['wall_s'] for r in rs):.0f} | "
              f"{statistics.mean(r['response_length'] for r in rs):.2f} | "
              f"{statistics.mean(acc):.3f} +- {sd:.3f} ({', '.join(f'{a:.3f}' for a in acc)}) |")
    ratios = [a["steps_per_s"] / s["steps_per_s"] for a, s in zip(rows["async"], rows["sync"])]
    print(f"\nasync / sync steps per second, per seed: {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"mean {statistics.mean(ratios):.2f}x; async learner waited "
          f"{statistics.mean(r['learner_wait_frac'] for r in rows['async']):.0%} of its steps, dropped "
          f"{sum(r['dropped'] for r in rows['async']):.0f} batches, generated "
          f"{sum(r['wasted'] for r in rows['async']):.0f} it did not train on, mean staleness "
          f"{statistics.mean(r['staleness_mean'] for r in rows['async']):.2f}")


if __name__ == "__main__":
    main()
