"""Data-parallel ``echotrain train`` on this machine: 1 process vs 2 processes, same global batch.

Three runs of the same config (SmolLM2-135M-Instruct by default, ``rollout_rng=group`` so all
three sample the same rollouts), each in its own process(es), under ``nice``:

    1 proc x 1 thread       python bench_distributed.py --worker --threads 1
    1 proc x 2 threads      python bench_distributed.py --worker --threads 2
    2 procs x 1 thread      torchrun --nproc_per_node 2 bench_distributed.py --worker --threads 1

Prints time per step (mean of the steps after the first), its parts, and what the 2-process run
sent (echotrain.train.dist.TRAFFIC: gradient all-reduce bytes, gathered rollouts / log-probs,
seconds inside collectives), and checks that the 2-process metrics equal the 1-process ones.

    python benchmarks/bench_distributed.py [--steps 3] [--model NAME] [--out /tmp/bench_dist]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIG = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=16, micro_batch_size=8,
              num_mini_batches=1, eval_prompts=0, plots=False, save_every=0, save_final_model=False, progress=False,
              rollout_rng="group", device="cpu", seed=0)


def worker(args: argparse.Namespace) -> None:
    import torch

    from echotrain.train.config import resolve_config
    from echotrain.train.dist import TRAFFIC
    from echotrain.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = resolve_config(overrides={**CONFIG, "steps": args.steps, "output_dir": args.out, "num_threads": args.threads,
                                    **({"model": args.model} if args.model else {})})
    trainer = Trainer(cfg)
    records = trainer.train()
    n_params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if trainer.dist.is_main:
        Path(args.out, "bench.json").write_text(json.dumps(
            {"records": records, "traffic": TRAFFIC, "trainable_params": n_params,
             "world_size": trainer.dist.world_size, "threads": torch.get_num_threads()}))


def launch(args: argparse.Namespace, name: str, procs: int, threads: int) -> dict:
    out = Path(args.out) / name
    base = [__file__, "--worker", "--threads", str(threads), "--steps", str(args.steps), "--out", str(out)]
    if args.model:
        base += ["--model", args.model]
    cmd = ["nice", "-n", "10", sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)] if procs > 1 else []) + base
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())


def mean_after_first(records: list[dict], key: str) -> float:
    vals = [r[key] for r in records[1:]] or [records[0][key]]
    return sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="/tmp/bench_dist")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {"1 proc x 1 thread": launch(args, "p1t1", 1, 1), "1 proc x 2 threads": launch(args, "p1t2", 1, 2),
            "2 procs x 1 thread": launch(args, "p2t1", 2, 1)}
    print(f"{'run':22s} {'step s':>8s} {'gen s':>8s} {'update s':>9s} {'vs 1x1':>7s}")
    ref = mean_after_first(runs["1 proc x 1 thread"]["records"], "time/step")
    for name, res in runs.items():
        rec = res["records"]
        t = mean_after_first(rec, "time/step")
        print(f"{name:22s} {t:8.2f} {mean_after_first(rec, 'time/generation'):8.2f} "
              f"{mean_after_first(rec, 'time/update'):9.2f} {ref / t:7.2f}x")
    two = runs["2 procs x 1 thread"]
    tr, steps = two["traffic"], len(two["records"])
    opt_steps = sum(r["optimizer_steps"] for r in two["records"])
    print(f"2 procs, per step (rank 0 sent): gradient all-reduce {tr['all_reduce_bytes'] / opt_steps / 2**20:.1f} MiB "
          f"per optimizer step ({two['trainable_params'] / 1e6:.1f} M float32 grads), gathers "
          f"{tr['gather_bytes'] / steps / 2**20:.2f} MiB, broadcasts {tr['broadcast_bytes'] / steps / 2**10:.1f} KiB; "
          f"{tr['seconds'] / steps:.2f} s/step in collectives")
    skip = ("time/", "throughput/", "memory/")
    one = runs["1 proc x 1 thread"]["records"]
    worst = max(abs(a[k] - b[k]) / max(1e-9, abs(a[k])) for a, b in zip(one, two["records"]) for k in a
                if not k.startswith(skip) and isinstance(a[k], (int, float)))
    print(f"largest relative difference of a logged metric, 2 procs vs 1 proc: {worst:.2e}")


if __name__ == "__main__":
    main()
