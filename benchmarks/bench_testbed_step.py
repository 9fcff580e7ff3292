"""RL step time on a CPU testbed (``model=testbed`` or ``testbed-length``, docs/testbed.md), per preset.

Runs ``echotrain train --config <--config, default configs/testbed.yaml> preset=<p>`` for ``--steps`` steps of each
preset in this process (one thread, no evaluation, no checkpoints) and reports, per preset, the
median over steps (after ``--warmup``) of the wall-clock step time, its process CPU time
(``time/step_cpu``: on a shared machine the wall clock mostly measures the other users' load, the
CPU time the work), and the generation / update split, plus the machine load (``os.getloadavg``).
The policy is loaded (shipped weights, or built if not cached) before the timed steps.

Usage::

    nice -n 10 python benchmarks/bench_testbed_step.py --presets echo,grpo --steps 20 --json out.json
    nice -n 10 python benchmarks/bench_testbed_step.py --config configs/testbed_length.yaml --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="echo,grpo", help="comma-separated presets (default echo,grpo)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per preset (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "testbed.yaml"),
                        help="the train config of the testbed (default configs/testbed.yaml)")
    args = parser.parse_args()

    from echotrain.train.config import load_yaml, parse_overrides, resolve_config
    from echotrain.train.trainer import Trainer

    config = Path(args.config)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            over = parse_overrides([f"preset={preset}", f"steps={args.steps}", "eval_prompts=0", "progress=false",
                                    f"num_threads={args.threads}", f"output_dir={tmp}/{preset}", *args.set])
            trainer = Trainer(resolve_config(load_yaml(config), over))
            records = trainer.train()[args.warmup:]

            def med(key: str) -> float:
                return round(statistics.median(r[key] for r in records), 4)

            results[preset] = {k.split("/")[1]: med(k) for k in ("time/step", "time/step_cpu", "time/generation",
                                                                  "time/update")}
            print(preset, results[preset], flush=True)
    out = {"config": str(config), "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "loadavg": os.getloadavg(),
           "results": results}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
