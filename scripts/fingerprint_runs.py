"""Behaviour fingerprint of short training runs, to show that a refactor changes no behaviour.

Each run is trained in this process with a fixed seed and one thread; its fingerprint is every
``metrics.jsonl`` value except timing, throughput and memory fields (which vary between runs of
the same code) plus a SHA-256 of the final weights (every parameter and buffer, in state-dict
order, as raw bytes). Run it on the code before a change and after it and compare the files:

    python scripts/fingerprint_runs.py --out before.json          # on the old commit
    python scripts/fingerprint_runs.py --out after.json           # on the new one
    python scripts/fingerprint_runs.py --compare before.json after.json

Runs: the embedded default (SmolLM2-135M, default task; 2 steps, so a few minutes on a CPU) and
the CPU testbed policy under gspo, dapo + balanced aggregation, adamw4bit and late_sam (4 short
steps each). ``--runs`` picks a subset by name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from typing import Any

_TESTBED = ["model=testbed", "task=testbed", "steps=4", "prompts_per_step=8", "num_generations=4",
            "max_new_tokens=8", "num_mini_batches=2", "micro_batch_size=8", "eval_prompts=16", "eval_every=2",
            "lr=3e-5"]
RUNS: dict[str, list[str]] = {
    "default": ["steps=2"],
    "gspo": _TESTBED + ["preset=gspo"],
    "dapo_balanced": _TESTBED + ["preset=dapo", "loss_agg_mode=balanced"],
    "adamw4bit": _TESTBED + ["optimizer=adamw4bit"],
    "late_sam": _TESTBED + ["optimizer=late_sam", "sam_start=0.5"],
}
_VOLATILE = ("time/", "throughput/", "memory/")


def _weights_sha256(model: Any) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(name: str) -> dict[str, Any]:
    """Train run ``name`` of :data:`RUNS` and return ``{"metrics": [...], "weights_sha256": str}``."""
    import torch

    from echotrain.train.config import parse_overrides, resolve_config
    from echotrain.train.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = RUNS[name] + ["seed=0", "num_threads=1", "save_final_model=false", "plots=false", "save_every=0",
                               f"output_dir={os.path.join(tmp, name)}"]
        trainer = Trainer(resolve_config(overrides=parse_overrides(tokens)))
        records = trainer.train()
        metrics = [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in records]
        return {"args": tokens[:-1], "metrics": metrics, "weights_sha256": _weights_sha256(trainer.model)}


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Differences between two fingerprint files (exact float equality; NaN equals NaN)."""
    diffs = []
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            diffs.append(f"{run}: only in {'second' if run in b else 'first'} file")
            continue
        if a[run]["weights_sha256"] != b[run]["weights_sha256"]:
            diffs.append(f"{run}: final weights differ")
        ma, mb = a[run]["metrics"], b[run]["metrics"]
        if len(ma) != len(mb):
            diffs.append(f"{run}: {len(ma)} vs {len(mb)} records")
        for ra, rb in zip(ma, mb):
            for k in sorted(set(ra) | set(rb)):
                va, vb = ra.get(k, "<absent>"), rb.get(k, "<absent>")
                same = va == vb or (isinstance(va, float) and isinstance(vb, float) and math.isnan(va) and math.isnan(vb))
                if not same:
                    diffs.append(f"{run} step {ra.get('step')}: {k} {va!r} vs {vb!r}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the fingerprints (JSON) here")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files; exit 1 on a difference")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) if diffs else f"identical: {', '.join(sorted(a))}")
        return 1 if diffs else 0
    if not args.out:
        ap.error("--out is required unless --compare is given")
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    result = {}
    for n in names:
        print(f"fingerprint: {n} ...", file=sys.stderr, flush=True)
        result[n] = fingerprint(n)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"fingerprint: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
