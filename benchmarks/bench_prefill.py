"""The rollout prefill with the prompts' common prefix computed once, against one prefill per
distinct prompt (the previous main), in one process, alternating, as ratios (issue 21).

What is timed, on the default job (embedded SmolLM2-135M-Instruct, the default task, whose chat
prompts share a system prompt and a one-shot exchange: ~76 of ~88 tokens):

- ``rollouts``: ``generate_rollouts`` of one step's B x G rows (temperature 1, the sampler's
  log-probs recorded), prefill and decode;
- ``evaluation``: the trainer's evaluation (``echotrain.train.evaluate.evaluate`` with the
  trainer's arguments: ``eval_prompts`` held-out prompts, greedy, one completion each).

Arms: ``common prefix`` (today: :func:`echotrain.runtime.rollout._prefill` computes the prompts'
common prefix once, then each prompt's rest) and ``per prompt`` (the same code with the common
prefix taken as empty: each distinct prompt prefilled whole, as the previous main did; with G = 1,
as in the evaluation, the previous main prefilled nothing ahead and neither does this arm). The
same RNG seed before every call; ``--reps`` rounds with the order alternating, after one untimed
warm-up call of each. Printed: median seconds, the ratio to ``per prompt``, the prompt tokens each
arm prefills, and whether both arms produced the same tokens (greedy: they should, up to float
rounding of near-ties).

    python benchmarks/bench_prefill.py --threads 2 --reps 3                      # autocast as the job's
    python benchmarks/bench_prefill.py --threads 2 --reps 3 --set autocast=off   # float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the job, as on the command line (e.g. autocast=off, model=testbed)")
    args = ap.parse_args(argv)

    from echotrain.cli import set_omp_wait_policy

    wait = set_omp_wait_policy()
    import torch

    torch.set_num_threads(args.threads)
    from echotrain.models import load_policy
    from echotrain.runtime import rollout
    from echotrain.runtime.packing import common_prefix_len, real_prompts
    from echotrain.runtime.precision import autocast, resolve_autocast
    from echotrain.tasks import get_task
    from echotrain.train.config import resolve_config
    from echotrain.train.config.parse import parse_overrides
    from echotrain.train.evaluate import evaluate

    cfg = resolve_config(overrides=parse_overrides(args.set))
    model, tok = load_policy(cfg.model)
    ac = resolve_autocast(cfg.autocast, next(model.parameters()).device, next(model.parameters()).dtype)
    task = get_task(cfg.task, **cfg.task_options)
    messages = [ex.messages for ex in task.sample(cfg.prompts_per_step, cfg.seed)]
    G = cfg.num_generations
    arms = {"per prompt": lambda prompts: 0, "common prefix": common_prefix_len}

    def rollouts() -> object:
        return rollout.generate_rollouts(model, tok, messages, G, max_new_tokens=cfg.max_new_tokens,
                                         temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                         decode_loop=cfg.decode_loop, sampler=cfg.sampler)

    def evaluation() -> object:  # the trainer's call (Trainer.evaluate)
        return evaluate(model, tok, task, num_prompts=cfg.eval_prompts, n=1, ks=(1,),
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature, seed=cfg.seed + 7,
                        batch_prompts=max(cfg.prompts_per_step * cfg.num_generations, 1),
                        decode_loop=cfg.decode_loop, sampler=cfg.sampler, keep_samples=cfg.eval_prompts)

    def call(what, arm: str) -> tuple[float, object]:
        rollout.common_prefix_len = arms[arm]  # what _prefill calls
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        with autocast(model, ac):
            out = what()
        return time.perf_counter() - t0, out

    results: dict = {}
    try:
        for name, what in (("rollouts", rollouts), ("evaluation", evaluation)):
            for arm in arms:
                call(what, arm)
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            outs = {}
            for rep in range(args.reps):
                for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                    t, outs[arm] = call(what, arm)
                    times[arm].append(t)
            base = statistics.median(times["per prompt"])
            results[name] = {arm: {"median_s": statistics.median(ts), "ratio": statistics.median(ts) / base,
                                   "per_rep_s": ts} for arm, ts in times.items()}
            if name == "rollouts":
                same = torch.equal(outs["per prompt"].response_ids, outs["common prefix"].response_ids)
            else:
                same = [s["completion"] for s in outs["per prompt"]["samples"]] == \
                    [s["completion"] for s in outs["common prefix"]["samples"]]
            results[name]["same_tokens"] = same
    finally:
        rollout.common_prefix_len = common_prefix_len
    ids, attn = rollout.encode_prompts(tok, rollout.render_prompts(tok, messages), tok.pad_token_id or 0)
    prompts = real_prompts(ids, attn)
    C = common_prefix_len(prompts)
    tokens = {"per prompt": sum(len(p) - 1 for p in prompts), "common prefix": C + sum(len(p) - 1 - C for p in prompts)}
    print(f"# {cfg.model or 'the default model (SmolLM2-135M-Instruct)'}, autocast {ac}, {cfg.prompts_per_step} "
          f"prompts x {G}, {cfg.eval_prompts} evaluation prompts, {args.threads} threads, OpenMP wait {wait}, "
          f"load avg {os.getloadavg()[0]:.1f}, {args.reps} reps; one step's prompts: {len(prompts)}, common prefix "
          f"{C} tokens, prefilled tokens per prompt / common prefix: {tokens['per prompt']} / {tokens['common prefix']}")
    print("| what | arm | median s | ratio | same tokens | per-rep s |")
    print("|---|---|---:|---:|---|---|")
    for name, res in results.items():
        for arm in arms:
            r = res[arm]
            print(f"| {name} | {arm} | {r['median_s']:.2f} | {r['ratio']:.2f} | {res['same_tokens']} | "
                  f"{', '.join(f'{t:.2f}' for t in r['per_rep_s'])} |")
    results["prefill_tokens"] = tokens
    results["common_prefix"] = C
    return results


if __name__ == "__main__":
    main()
