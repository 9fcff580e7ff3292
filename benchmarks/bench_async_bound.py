"""The bound on asynchronous rollouts on 2 CPU cores: 1- vs 2-thread scaling of generation and update.

An asynchronous trainer overlaps generation (a rollout process) with the update (the learner).
On 2 cores the two processes get 1 thread each, so with perfect overlap a step takes
``max(g1, u1)`` (generation and update times at 1 thread), against ``g2 + u2`` for the
synchronous trainer at 2 threads. This script measures the four times on the default job
(SmolLM2-135M-Instruct, the default task, the default sampling and update settings) through the
real CLI, one fresh process per thread count (so the OpenMP environment is read when torch
loads), and prints

- ``overlap bound``   ``(g2 + u2) / max(g2, u2)``: perfect overlap with no thread lost
- ``1+1 bound``       ``(g2 + u2) / max(g1, u1)``: perfect overlap, 1 thread per process (and
  against the faster synchronous setting, ``min(g1 + u1, g2 + u2) / max(g1, u1)``)
- each phase's 2-thread scaling ``g1 / g2`` and ``u1 / u2``

``--mode cli`` (for a quiet machine): times are the median over steps 2.. of
``time/generation`` and ``time/update`` in metrics.jsonl of ``echotrain train`` runs (step 1 warms
up). ``--mode phases`` (default; fits a loaded machine): a fresh process per thread count loads
the default policy and times ``--reps`` x [one ``generate`` of ``--prompts`` x 8 rollouts of 32
new tokens, then one forward + backward of those rollouts] (the update's work per micro-batch,
without the optimizer step), after one warm-up rep. Settings are interleaved over ``--rounds``.
Both report wall seconds; ``phases`` also CPU seconds (all threads), which shows how much of a core
the process got on a loaded machine.

    python benchmarks/bench_async_bound.py                               # phases, ~2 minutes loaded
    python benchmarks/bench_async_bound.py --mode cli --prompts 8 --steps 3   # the full default job
    python benchmarks/bench_async_bound.py --mode cli --config configs/testbed_length.yaml --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


PHASES = r"""
import json, statistics, sys, time
import torch
threads, prompts, reps = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
from echotrain.models import load_policy
from echotrain.tasks import get_task
from echotrain.runtime.rollout import forward_log_probs, generate_rollouts
model, tok = load_policy(None)
examples = get_task("default").sample(prompts, 0)
out = {"generation": [], "update": [], "generation_cpu": [], "update_cpu": []}
for rep in range(reps + 1):
    torch.manual_seed(rep)
    t0, c0 = time.perf_counter(), time.process_time()
    batch = generate_rollouts(model, tok, [e.messages for e in examples], 8, max_new_tokens=32)
    t1, c1 = time.perf_counter(), time.process_time()
    lp, _ = forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    (lp * batch.response_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    t2, c2 = time.perf_counter(), time.process_time()
    if rep:  # the first rep warms up
        out["generation"].append(t1 - t0); out["update"].append(t2 - t1)
        out["generation_cpu"].append(c1 - c0); out["update_cpu"].append(c2 - c1)
print(json.dumps({k: statistics.median(v) for k, v in out.items()}))
"""


def run_phases(threads: int, prompts: int, reps: int) -> dict[str, float]:
    """Median seconds of one generate and one forward + backward at ``threads`` threads."""
    # PASSIVE: what the CLI sets on a loaded machine (spinning OpenMP threads wait for descheduled ones)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.run([sys.executable, "-c", PHASES, str(threads), str(prompts), str(reps)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(threads: int, prompts: int | None, steps: int, out: Path, config: str | None = None) -> dict[str, float]:
    """One CLI run at ``threads`` threads (of ``config``, default the default job; ``prompts``
    None: its prompts_per_step); the median generation / update seconds over steps 2.."""
    args = [sys.executable, "-m", "echotrain.cli", "train"] + (["--config", config] if config else []) + [
            f"num_threads={threads}"] + ([f"prompts_per_step={prompts}"] if prompts else []) + [
            f"steps={steps}", "eval_prompts=0", "save_final_model=false", "plots=false", "progress=false",
            "save_every=0", f"output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return {"generation": statistics.median(r["time/generation"] for r in records),
            "update": statistics.median(r["time/update"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts_per_step (default: 4 in phases, the config's in cli; default job: 8)")
    ap.add_argument("--config", default=None, help="cli: a train config (default: the default job)")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--mode", choices=("phases", "cli"), default="phases")
    ap.add_argument("--reps", type=int, default=2, help="phases: timed reps per process (after one warm-up)")
    args = ap.parse_args(argv)
    times: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for threads in (2, 1) if rnd % 2 == 0 else (1, 2):
                times[threads].append(run_phases(threads, args.prompts or 4, args.reps) if args.mode == "phases" else
                                      run(threads, args.prompts, args.steps, Path(tmp) / f"t{threads}_r{rnd}",
                                          args.config))
                print(f"round {rnd} threads {threads}: {times[threads][-1]}", file=sys.stderr, flush=True)
    med = {t: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for t, ms in times.items()}
    g1, u1, g2, u2 = med[1]["generation"], med[1]["update"], med[2]["generation"], med[2]["update"]
    what = (f"{args.config or 'the default job'}, prompts_per_step={args.prompts or 'its own'}" if args.mode == "cli"
            else f"{args.prompts or 4} prompts x 8 rollouts x 32 new tokens")
    print(f"mode {args.mode}, {what}, {args.rounds} round(s), "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| threads | generation s | update s | step s | generation CPU s | update CPU s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in (1, 2):
        m = med[t]
        print(f"| {t} | {m['generation']:.2f} | {m['update']:.2f} | {m['generation'] + m['update']:.2f} | "
              f"{m.get('generation_cpu', float('nan')):.2f} | {m.get('update_cpu', float('nan')):.2f} |")
    print(f"2-thread scaling: generation {g1 / g2:.2f}x, update {u1 / u2:.2f}x")
    print(f"overlap bound (g2+u2)/max(g2,u2) = {(g2 + u2) / max(g2, u2):.2f}x")
    print(f"1+1 bound (g2+u2)/max(g1,u1) = {(g2 + u2) / max(g1, u1):.2f}x")
    best = min(g1 + u1, g2 + u2)
    print(f"1+1 bound against the faster synchronous setting min(g1+u1, g2+u2)/max(g1,u1) = {best / max(g1, u1):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
