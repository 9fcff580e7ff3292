"""Share of the separate old-log-prob pass in an RL step: ``reuse_on_policy_log_probs`` off vs on.

The default run's setting (SmolLM2-135M-Instruct, 8 prompts x 8 rollouts, 32 new tokens) with
``num_mini_batches`` 1 and 2, each for ``--steps`` steps, off and on interleaved in one process
(same seed, so the same rollouts); reports the median ``time/step`` and ``time/update`` and the
ratio on/off.

    python benchmarks/bench_reuse_log_probs.py --steps 2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from echotrain.models import load_policy
from echotrain.train.config import resolve_config
from echotrain.train.trainer import Trainer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_policy(None)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    res: dict[tuple[int, bool], list[dict]] = {}
    for _ in range(args.rounds):
        for nmb in (1, 2):
            for reuse in (False, True):
                model.load_state_dict(init)
                with tempfile.TemporaryDirectory() as d:
                    cfg = resolve_config(overrides=dict(steps=args.steps, num_mini_batches=nmb, reuse_on_policy_log_probs=reuse,
                                                        output_dir=d, eval_prompts=0, save_every=0, plots=False,
                                                        save_final_model=False, progress=False, num_threads=args.threads))
                    recs = Trainer(cfg, model=model, tokenizer=tok).train()
                res.setdefault((nmb, reuse), []).extend(recs)
                print(nmb, reuse, [round(r["time/step"], 2) for r in recs], flush=True)
    print("\n| num_mini_batches | reuse | time/step (s) | time/update (s) | step ratio on/off |")
    print("|---|---|---|---|---|")
    for nmb in (1, 2):
        off = statistics.median(r["time/step"] for r in res[(nmb, False)])
        for reuse in (False, True):
            recs = res[(nmb, reuse)]
            step = statistics.median(r["time/step"] for r in recs)
            upd = statistics.median(r["time/update"] for r in recs)
            print(f"| {nmb} | {reuse} | {step:.2f} | {upd:.2f} | {step / off:.3f} |")


if __name__ == "__main__":
    main()
