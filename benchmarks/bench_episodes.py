"""Model tokens per second of multi-turn episodes against single-turn rollouts (issue 38 item 7).

What is timed, in one process, alternating, after one untimed warm-up of each:

- episodes: :func:`echotrain.runtime.episodes.run_episodes` of ``--prompts`` task prompts x
  ``--generations`` episodes with the ``feedback`` environment (a fixed user turn after every model
  turn, so every episode runs ``--turns`` model turns unless the budget cuts it), ``--max-new-tokens``
  per turn, each episode's KV cache kept between turns (only the end-of-turn token and the
  environment's ids are prefilled);
- episodes without the kept cache (``kv_cache=False``: each turn runs the whole trajectory through
  the model again);
- single-turn: :func:`echotrain.runtime.rollout.generate_rollouts` of the same prompts with
  ``--turns x --max-new-tokens`` new tokens (the same budget of model tokens, one prefill).

Printed: wall seconds (median of ``--reps``), model tokens (the trained ones, ``response_mask``
sums), model tokens per second of each and their ratios to single-turn, the episodes' environment
tokens, and the peak size of the kept caches per episode (keys and values of every layer, MiB).

    python benchmarks/bench_episodes.py --threads 1 --reps 2
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default=None, help="model= (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--task", default="default")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    from echotrain.cli import set_omp_wait_policy

    set_omp_wait_policy()
    import torch

    torch.set_num_threads(args.threads)
    from echotrain.envs import get_env_factory
    from echotrain.models import load_policy
    from echotrain.runtime.episodes import EPISODE_STATS, run_episodes
    from echotrain.runtime.rollout import encode_prompts, generate_rollouts, render_prompts
    from echotrain.tasks import get_task

    model, tok = load_policy(args.model)
    examples = get_task(args.task).sample(args.prompts, 0)
    make_env = get_env_factory("feedback", message="Check your answer and give it again.")

    def episodes(kv_cache: bool) -> tuple[float, float, float]:
        res = run_episodes(model, tok, examples, args.generations, make_env, max_new_tokens=args.max_new_tokens,
                           max_turns=args.turns, max_episode_tokens=args.turns * args.max_new_tokens * 4,
                           kv_cache=kv_cache)
        env = float(res.batch.episode_stats[:, EPISODE_STATS.index("env_tokens")].sum())
        return float(res.batch.response_mask.sum()), env, float(res.batch.episode_stats[:, 0].mean())

    def single() -> tuple[float, float, float]:
        b = generate_rollouts(model, tok, [ex.messages for ex in examples], args.generations,
                              max_new_tokens=args.turns * args.max_new_tokens)
        return float(b.response_mask.sum()), 0.0, 1.0

    runs = {"episodes": lambda: episodes(True), "episodes-no-cache": lambda: episodes(False), "single-turn": single}
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[float]] = {k: [] for k in runs}
    extra: dict[str, tuple[float, float]] = {}
    for k, fn in runs.items():  # warm-up
        torch.manual_seed(0)
        fn()
    for rep in range(args.reps):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]  # alternating: drift hits every arm
        for k in order:
            torch.manual_seed(rep)
            t0 = time.perf_counter()
            n, env, turns = runs[k]()
            times[k].append(time.perf_counter() - t0)
            tokens[k].append(n)
            extra[k] = (env, turns)
    out = {}
    for k in runs:
        tps = sum(tokens[k]) / sum(times[k])
        out[k] = {"seconds": statistics.median(times[k]), "model_tokens": statistics.median(tokens[k]),
                  "tokens_per_s": tps, "env_tokens": extra[k][0], "turns": extra[k][1]}
        print(f"{k:17s} median {out[k]['seconds']:.2f} s, {out[k]['model_tokens']:.0f} model tokens, "
              f"{tps:.1f} model tokens/s, {extra[k][0]:.0f} env tokens, {extra[k][1]:.2f} turns/episode")
    ratio = out["episodes"]["tokens_per_s"] / out["single-turn"]["tokens_per_s"]
    ratio_plain = out["episodes-no-cache"]["tokens_per_s"] / out["single-turn"]["tokens_per_s"]
    print(f"model tokens per second / single-turn's: episodes {ratio:.2f}, episodes without the kept cache "
          f"{ratio_plain:.2f}")
    # the kept cache of one episode at its longest: keys and values of every layer per position
    cfg = model.config
    per_pos = None
    if hasattr(cfg, "num_hidden_layers"):  # a Hugging Face model (the testbed's decode keeps no cache)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_pos = 2 * cfg.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()
        ids, _ = encode_prompts(tok, render_prompts(tok, [ex.messages for ex in examples]), 0)
        longest = args.turns * args.max_new_tokens * 4 + ids.shape[1]
        print(f"kept cache per episode: {per_pos / 1024:.1f} KiB a position, at most "
              f"{per_pos * longest / 2**20:.1f} MiB ({longest} positions: prompt + the episode's token budget)")
    out.update(ratio=ratio, ratio_no_cache=ratio_plain, cache_kib_per_position=per_pos and per_pos / 1024)
    return out


if __name__ == "__main__":
    main()
