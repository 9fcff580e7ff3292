"""The update's layouts of a prompt group, A/B in one process: the KV-cache layout (each distinct
prompt once, its cache expanded to the G padded responses) against the packed layout (the
prompts' common prefix once per row, each prompt's rest and its responses back to back under a
block mask, no response padding; ``pack_responses``), the packed layout with its attention as
one masked call over the whole row (``packed_attention=mask``) instead of one call per block
(``blocks``, the default), and optionally the plain forward (every row prompt + response).

What is timed: the with-grad forward + backward of all 64 rows of the default job's first step
(embedded SmolLM2-135M-Instruct, the default task, B = 8 x G = 8 rollouts of 32 new tokens at
temperature 1, sampled once), in micro-batches of ``--micro-batch-size`` rows in the trainer's
order (whole groups), the backward of the masked log-prob sum; ``--reps`` rounds, the order of
the layouts alternating, after one untimed warm-up round. Printed: the median wall seconds of
each layout, the ratio to the KV-cache layout, the tokens each layout runs through the model,
the largest difference of the log-probs from the KV-cache layout's and the relative L2 distance
of the gradient from it (float rounding: the three compute the same function).

    python benchmarks/bench_packing.py --threads 2 --reps 5 [--micro-batch-size 8] [--plain]
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
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="also time the plain forward (no prompt sharing)")
    args = ap.parse_args(argv)
    job = load_job(args, micro_batch_size=args.micro_batch_size)
    import torch

    from echotrain.runtime.packing import supports_packed_forward
    from echotrain.runtime.rollout import forward_log_probs, generate_rollouts

    cfg, model, tok, messages, wait = job.cfg, job.model, job.tokenizer, job.messages, job.wait
    torch.manual_seed(cfg.seed)
    with torch.no_grad():
        batch = generate_rollouts(model, tok, messages, cfg.num_generations, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature)
    micro = [batch.select(torch.arange(i, min(i + cfg.micro_batch_size, len(batch))))
             for i in range(0, len(batch), cfg.micro_batch_size)]
    layouts = {"kv cache": {"pack": False}, "packed": {"pack": True},
               "packed, whole-row mask": {"pack": True, "packed_attention": "mask"}}
    if args.plain:
        layouts["plain"] = {"share_prefix": False}

    def run(kw: dict) -> tuple[float, list, dict]:
        model.zero_grad(set_to_none=True)
        lps = []
        t0 = time.perf_counter()
        for mb in micro:
            lp, _ = forward_log_probs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                      temperature=cfg.temperature, **kw)
            (lp * mb.response_mask).sum().backward()
            lps.append(lp.detach())
        t = time.perf_counter() - t0
        return t, lps, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    for kw in layouts.values():
        run(kw)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in layouts}
    outs = {}
    names = list(layouts)
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t, lps, grads = run(layouts[name])
            times[name].append(t)
            outs[name] = (lps, grads)
    base = statistics.median(times["kv cache"])
    lens = batch.response_mask.sum(-1).long()
    uniq_tokens = sum(int(mb.prompt_mask[mb.group_index == g][0].sum()) for mb in micro
                      for g in mb.group_index.unique())
    padded = sum(len(mb) * int(mb.response_mask.sum(-1).max()) for mb in micro)
    from echotrain.runtime.packing import PAD, pack_layout

    packed = sum(int((pack_layout(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask).block > PAD).sum())
                 for mb in micro)  # the common prefix once per row, each prompt's rest once, no padding
    tokens = {"kv cache": uniq_tokens + padded, "packed": packed, "packed, whole-row mask": packed,
              "plain": int(batch.prompt_mask.sum()) + padded}
    print(f"# model {cfg.model or 'the default (SmolLM2-135M-Instruct)'}, {len(batch)} rows in micro-batches of "
          f"{cfg.micro_batch_size}, {args.threads} threads, OpenMP wait {wait}, load avg {os.getloadavg()[0]:.1f}, "
          f"{args.reps} reps; packed layout supported: {supports_packed_forward(model)}; mean response "
          f"{float(lens.float().mean()):.1f} tokens (max {int(lens.max())})")
    print("| layout | median s | ratio | tokens through the model | max abs log-prob diff | gradient diff (relative L2) | per-rep s |")
    print("|---|---:|---:|---:|---:|---:|---|")
    ref_lps, ref_g = outs["kv cache"]
    result = {}
    for name in names:
        lps, grads = outs[name]
        d_lp = max(float(((a - b) * mb.response_mask).abs().max()) for a, b, mb in zip(lps, ref_lps, micro))
        num = sum(float((grads[k] - ref_g[k]).pow(2).sum()) for k in ref_g)
        d_g = (num / sum(float(ref_g[k].pow(2).sum()) for k in ref_g)) ** 0.5
        med = statistics.median(times[name])
        result[name] = {"median_s": med, "ratio": med / base, "tokens": tokens[name]}
        print(f"| {name} | {med:.2f} | {med / base:.2f} | {tokens[name]} | {d_lp:.1e} | {d_g:.1e} | "
              f"{', '.join(f'{t:.2f}' for t in times[name])} |")
    return result


if __name__ == "__main__":
    main()
