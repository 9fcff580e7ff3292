"""Time every registered advantage estimator against ``grpo`` on one step's batch, in one run.

Interleaved rounds in shuffled order, process CPU time, median over rounds, one CPU thread, on a
step-sized batch (``--prompts`` x ``--generations`` responses of up to ``--T`` tokens, ragged):

    python benchmarks/bench_adv_estimators.py [--prompts 64 --generations 8 --T 1024 --rounds 30]

Prints a markdown table: each estimator's median time, its ratio to ``grpo``'s, and that time as
a share of ``--step-s`` (a training step's wall time, default 16 s: the default job's median step
on a 2-core AMD EPYC, docs/benchmarks.md). ReMax's greedy rollout is not in these numbers: it is a
generation of one response per prompt, 1/G of the rollout's, and counts in the step's
``time/generation``.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from echotrain.rl.advantages import ADV_METHODS, compute_token_advantages


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--step-s", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B = args.prompts * args.generations
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    gid = torch.arange(B) // args.generations
    mask = (torch.arange(args.T) < torch.randint(1, args.T + 1, (B,), generator=g)[:, None]).float()
    base = torch.randint(0, 2, (B,), generator=g).float()
    pi = 0.01 + 0.99 * torch.rand(B, args.T, generator=g)  # the optimal token baselines' policy statistics
    stats = dict(old_log_prob=pi.log(), sum_pi_squared=pi**2 + (1 - pi**2) * torch.rand(B, args.T, generator=g))
    times: dict[str, list[float]] = {name: [] for name in ADV_METHODS}
    names = list(ADV_METHODS)
    for _ in range(args.rounds):
        random.shuffle(names)
        for name in names:
            t0 = time.process_time()
            compute_token_advantages(rewards, gid, mask, name, reward_baselines=base, gamma=0.99, **stats)
            times[name].append(time.process_time() - t0)
    ref = statistics.median(times["grpo"])
    out = {}
    print(f"{platform.processor() or platform.machine()}, {args.threads} thread(s), B={B}, T={args.T}, "
          f"{args.rounds} rounds\n")
    print("| adv_estimator | median ms | / grpo | share of a %.0f-s step |" % args.step_s)
    print("|---|---|---|---|")
    for name in ADV_METHODS:
        med = statistics.median(times[name])
        out[name] = {"median_s": med, "ratio": med / ref if ref > 0 else float("nan"), "step_share": med / args.step_s}
        print(f"| `{name}` | {1e3 * med:.2f} | {out[name]['ratio']:.2f} | {out[name]['step_share']:.1e} |")
    return out


if __name__ == "__main__":
    main()
