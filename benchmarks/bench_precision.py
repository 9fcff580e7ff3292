"""Mixed precision of the default run: ``autocast=off`` (float32) vs ``autocast=bfloat16``.

The default run's setting (SmolLM2-135M-Instruct, echo preset, 8 prompts x 8 rollouts, 32 new
tokens, 2 mini-batches) for ``--steps`` steps per variant, variants interleaved over
``--rounds`` rounds in one process, each from the same initial weights and seed. Reports the
median ``time/step``, ``time/generation`` and ``time/update`` and the step-time ratio against
``autocast=off`` measured in the same run. A bfloat16 speed-up needs native bf16 matrix
products (AVX512-BF16 or AMX on CPU); elsewhere bfloat16 is emulated and slower.

    python benchmarks/bench_precision.py --steps 2 --threads 2
    python benchmarks/bench_precision.py --variant "autocast=bfloat16 micro_batch_size=32"   # extra variants
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from echotrain.models import load_policy
from echotrain.train.config import resolve_config
from echotrain.runtime.precision import native_bf16
from echotrain.train.trainer import Trainer


def _parse(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[],
                    help="extra variant: space-separated key=value overrides (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"native bf16 on this CPU: {native_bf16('cpu')}; {args.threads} threads", flush=True)
    variants = {"off": {"autocast": "off"}, "bfloat16": {"autocast": "bfloat16"}}
    for v in args.variant:
        variants[v] = _parse(v.split())
    model, tok = load_policy(None)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    res: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, over in variants.items():
            model.load_state_dict(init)
            with tempfile.TemporaryDirectory() as d:
                cfg = resolve_config(overrides=dict(steps=args.steps, output_dir=d, eval_prompts=0, save_every=0,
                                                    plots=False, save_final_model=False, progress=False,
                                                    num_threads=args.threads, **over))
                recs = Trainer(cfg, model=model, tokenizer=tok).train()
            res.setdefault(name, []).extend(recs)
            print(name, [(round(r["time/step"], 2), round(r["time/generation"], 2)) for r in recs], flush=True)
    base = statistics.median(r["time/step"] for r in res["off"])
    print("\n| variant | time/step (s) | time/generation (s) | time/update (s) | step ratio to off | accuracy (mean) |")
    print("|---|---|---|---|---|---|")
    for name, recs in res.items():
        med = {k: statistics.median(r[k] for r in recs) for k in ("time/step", "time/generation", "time/update")}
        acc = statistics.mean(r["accuracy"] for r in recs)
        print(f"| {name} | {med['time/step']:.2f} | {med['time/generation']:.2f} | {med['time/update']:.2f} | "
              f"{med['time/step'] / base:.3f} | {acc:.3f} |")


if __name__ == "__main__":
    main()
