"""echotrain's decode loop (with each ``sampler``) against transformers' ``generate``: the default
job's rollouts, in one process, alternating, as ratios (issue 21 item 2).

What is timed: ``generate_rollouts`` of the default job's first step (embedded SmolLM2-135M-
Instruct, the default task's prompts, B = 8 x G = 8 rows, 32 new tokens, temperature 1, the
shared-prompt prefill, rollout log-probs recorded), with ``decode_loop=generate`` and
``decode_loop=echotrain`` with ``sampler=multinomial`` and ``sampler=inverse_cdf``, the same RNG
seed before each call, ``--reps`` rounds with the order alternating, after one untimed warm-up
call of each. Printed: the median wall seconds of each, the ratio to ``generate``, the rows x
steps each computes (``generate``: every row until the last one ends; echotrain: each row until
its own EOS), and whether ``generate`` and the loop with ``sampler=multinomial`` returned the same
token ids (they should: that sampler draws what ``generate`` draws from the same RNG state;
``inverse_cdf`` draws other tokens from the same distribution).

    python benchmarks/bench_decode_loop.py --threads 2 --reps 5
    python benchmarks/bench_decode_loop.py --model testbed-length --task testbed-length --reps 3   # its own generate
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _job import add_job_arguments, load_job  # noqa: E402 - the benchmarks' shared setup (benchmarks/_job.py)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_arguments(ap, threads=2, reps=5)
    args = ap.parse_args(argv)
    job = load_job(args)
    import torch

    from echotrain.runtime.rollout import generate_rollouts

    cfg, model, tok, messages, wait = job.cfg, job.model, job.tokenizer, job.messages, job.wait

    def call(arm: tuple[str, str], max_new: int) -> tuple[float, object]:
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        b = generate_rollouts(model, tok, messages, cfg.num_generations, max_new_tokens=max_new,
                              temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, decode_loop=arm[0],
                              sampler=arm[1])
        return time.perf_counter() - t0, b

    # (decode_loop, sampler); generate ignores the sampler
    arms = {"generate": ("generate", "multinomial"), "echotrain, multinomial": ("echotrain", "multinomial"),
            "echotrain, inverse_cdf": ("echotrain", "inverse_cdf")}
    names = list(arms)
    for name in names:
        call(arms[name], 2)
    times: dict[str, list[float]] = {name: [] for name in names}
    batches = {}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t, batches[name] = call(arms[name], cfg.max_new_tokens)
            times[name].append(t)
    from echotrain.runtime.rollout import _supports_decode_loop

    own = _supports_decode_loop(model)
    tg = statistics.median(times["generate"])
    print(f"# model {cfg.model or 'the default (SmolLM2-135M-Instruct)'}, {cfg.prompts_per_step} prompts x {cfg.num_generations}, {cfg.max_new_tokens} new "
          f"tokens, {args.threads} threads, OpenMP wait {wait}, load avg {os.getloadavg()[0]:.1f}, {args.reps} reps")
    print("| decode_loop, sampler | median s | ratio | rows x steps computed | mean response | per-rep s |")
    print("|---|---:|---:|---:|---:|---|")
    out: dict = {"generate_s": tg}
    for name in names:
        b = batches[name]
        lengths = b.response_mask.sum(-1)
        row_steps = (int(lengths.sum()) if own else "n/a (the model's own generate)") if name != "generate" \
            else len(lengths) * b.response_ids.shape[1]
        med = statistics.median(times[name])
        print(f"| {name} | {med:.2f} | {med / tg:.2f} | {row_steps} | {float(lengths.mean()):.1f} | "
              f"{', '.join(f'{t:.2f}' for t in times[name])} |")
        out[name.replace(", ", "_") + "_s"] = med
    same = torch.equal(batches["generate"].response_ids, batches["echotrain, multinomial"].response_ids)
    print(f"# generate and echotrain's loop with sampler=multinomial drew the same token ids: {same}")
    out.update(echotrain_s=out["echotrain_multinomial_s"], ratio=out["echotrain_multinomial_s"] / tg,
               inverse_cdf_ratio=out["echotrain_inverse_cdf_s"] / tg, same_tokens=same)
    return out


if __name__ == "__main__":
    main()
