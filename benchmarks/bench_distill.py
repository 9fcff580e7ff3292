"""The cost of on-policy distillation's teacher pass: one RL step without a teacher against the same
step with the distillation term (full vocabulary, and the teacher's top-k).

Each arm is a fresh ``echotrain train`` process (so ``memory/peak_mb``, the peak RSS, is the arm's
own), same seed and settings; the teacher is the student's own model (``--model``, a second copy),
so the work is the teacher's and not a difference of models. Reports the median ``time/step``,
``time/update`` and ``time/teacher`` over the steps after the first, the peak memory, and each
arm's ratio to the no-teacher arm measured in the same run.

    python benchmarks/bench_distill.py --model smollm2-135m-instruct --steps 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CLI = "import sys; from echotrain.cli import main; sys.exit(main(sys.argv[1:]))"


def arms(model: str, top_k: int) -> dict[str, list[str]]:
    """The arms' extra trainer keys: the baseline first."""
    return {"rl": [], "rl+distill (full vocabulary)": [f"teacher={model}", "distill_coeff=0.1"],
            f"rl+distill (top-{top_k})": [f"teacher={model}", "distill_coeff=0.1", f"distill_top_k={top_k}"]}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--task", default=None, help="default: the trainer's default task (testbed for --model testbed)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=32)
    args = ap.parse_args(argv)
    task = args.task or ("testbed" if args.model.startswith("testbed") else None)
    common = [f"model={args.model}", f"steps={args.steps}", f"prompts_per_step={args.prompts}",
              f"num_generations={args.generations}", f"max_new_tokens={args.max_new_tokens}",
              f"num_threads={args.threads}", "eval_prompts=0", "save_every=0", "save_final_model=false",
              "plots=false", "progress=false", "log_samples=0", "seed=0", *([f"task={task}"] if task else [])]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in arms(args.model, args.top_k).items():
            run = Path(d) / name.replace(" ", "_")
            subprocess.run([sys.executable, "-c", _CLI, "train", *common, *extra, f"output_dir={run}"], check=True)
            recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            later = recs[1:] or recs
            med = lambda k: statistics.median(r.get(k, 0.0) for r in later)  # noqa: E731
            out[name] = {"step_s": med("time/step"), "update_s": med("time/update"), "teacher_s": med("time/teacher"),
                         "teacher_mb": med("memory/teacher_mb"), "peak_mb": max(r["memory/peak_mb"] for r in recs)}
    base = out["rl"]
    print("\n| arm | time/step (s) | time/update (s) | time/teacher (s) | teacher outputs (MiB) | peak RSS (MiB) "
          "| step ratio | update ratio | peak ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in out.items():
        r["step_ratio"], r["update_ratio"] = r["step_s"] / base["step_s"], r["update_s"] / base["update_s"]
        r["peak_ratio"] = r["peak_mb"] / base["peak_mb"]
        print(f"| {name} | {r['step_s']:.2f} | {r['update_s']:.2f} | {r['teacher_s']:.2f} | {r['teacher_mb']:.1f} "
              f"| {r['peak_mb']:.0f} | {r['step_ratio']:.2f} | {r['update_ratio']:.2f} | {r['peak_ratio']:.2f} |")
    return out


if __name__ == "__main__":
    main()
