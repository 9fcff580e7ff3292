"""Rollouts under CPU bfloat16 autocast with generation under ``torch.no_grad`` (as now) against
``torch.inference_mode`` (as before), in one process, alternating, as ratios (issue 36 item 12).

Autocast caches its bfloat16 casts of parameters for the length of the autocast block, but not
inside ``torch.inference_mode``: there every forward re-casts every weight (read float32, write
bfloat16), at every decode step. ``generate_rollouts`` and the episodes' turns decoded inside
inference mode until this change; now they use ``no_grad``. The "inference_mode" arm wraps the
same call in ``torch.inference_mode()`` (the inner ``no_grad`` does not leave it), which is the
old behaviour. Both compute the same numbers (the same bfloat16 weights), so they draw the same
tokens from the same RNG state (checked).

What is timed: ``generate_rollouts`` of the default job's first step (SmolLM2-135M-Instruct, the
default task's prompts, B = 8 x G = 8 rows, 32 new tokens, temperature 1, shared-prompt prefill,
rollout log-probs recorded, ``decode_loop``/``sampler`` the defaults), the same seed before each
call, ``--reps`` rounds with the order alternating after one untimed warm-up round.

    python benchmarks/bench_rollout_autocast.py --threads 2 --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _job import add_job_arguments, load_job  # noqa: E402 - the benchmarks' shared setup (benchmarks/_job.py)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(ap, threads=2, reps=5)
    ap.add_argument("--autocast", choices=("bfloat16", "off"), default="bfloat16",
                    help="off: both arms in float32 (autocast's cache plays no part: the control)")
    args = ap.parse_args(argv)
    job = load_job(args)
    import torch

    from echotrain.runtime.rollout import generate_rollouts

    cfg, model, tok, messages, wait = job.cfg, job.model, job.tokenizer, job.messages, job.wait
    arms = {"no_grad": contextlib.nullcontext, "inference_mode": torch.inference_mode}

    def call(name: str):
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        with arms[name](), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bfloat16"):
            b = generate_rollouts(model, tok, messages, cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  decode_loop=cfg.decode_loop, sampler=cfg.sampler)
        return time.perf_counter() - t0, b

    times: dict[str, list[float]] = {name: [] for name in arms}
    batches = {}
    names = list(arms)
    for rep in range(args.reps + 1):  # round 0: warm-up
        for name in (names if rep % 2 == 0 else names[::-1]):
            t, batches[name] = call(name)
            if rep:
                times[name].append(t)
    med = {name: statistics.median(t) for name, t in times.items()}
    same = torch.equal(batches["no_grad"].response_ids, batches["inference_mode"].response_ids)
    out = dict(no_grad_s=med["no_grad"], inference_mode_s=med["inference_mode"],
               ratio=med["no_grad"] / med["inference_mode"], same_tokens=same,
               row_steps=int(batches["no_grad"].response_mask.sum()), per_rep_s=times)
    print(f"# model {cfg.model or 'the default (SmolLM2-135M-Instruct)'}, autocast {args.autocast}, "
          f"{cfg.prompts_per_step} x {cfg.num_generations} rows, {cfg.max_new_tokens} new tokens, {args.threads} threads, "
          f"OpenMP wait {wait}, load avg {os.getloadavg()[0]:.1f}, {args.reps} rounds")
    print(f"no_grad {med['no_grad']:.2f} s, inference_mode {med['inference_mode']:.2f} s: ratio **{out['ratio']:.2f}**; "
          f"same tokens {same}; row-steps {out['row_steps']}; per round "
          f"{ {k: [round(x, 2) for x in v] for k, v in times.items()} }")
    return out


if __name__ == "__main__":
    main()
