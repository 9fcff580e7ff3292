"""Speed of the trainer's shared-prompt forward against the plain forward, same run.

One micro-batch of G rollouts of one prompt (the trainer's layout: a group's rows share their
prompt): log-probs + backward with ``share_prefix=False`` (every row runs prompt + response) and
``share_prefix=True`` (the prompt runs once, its KV cache is expanded to the G rows), and the
same for generation (prefill B*G copies vs B prompts). Prints the times and the ratios.

    python benchmarks/bench_trainer_prefix.py [--model NAME] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="policy for echotrain.models.load_policy (default: embedded)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--B", type=int, default=2, help="prompts for the generation benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from echotrain.models import load_policy
    from echotrain.tasks import get_task
    from echotrain.runtime.rollout import forward_log_probs, generate_rollouts

    model, tok = load_policy(args.model)
    task = get_task("default")
    exs = task.sample(args.B, 0)
    torch.manual_seed(0)
    batch = generate_rollouts(model, tok, [e.messages for e in exs], args.G, max_new_tokens=args.max_new_tokens,
                              temperature=0.7)
    group = batch.select(list(range(args.G)))

    def fwd_bwd(share: bool) -> float:
        best = float("inf")
        for _ in range(args.reps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lp, _ = forward_log_probs(model, group.prompt_ids, group.prompt_mask, group.response_ids,
                                      group.response_mask, temperature=0.7, share_prefix=share)
            (lp * group.response_mask).sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best

    def gen(share: bool) -> float:
        best = float("inf")
        for _ in range(args.reps):
            torch.manual_seed(1)
            t0 = time.perf_counter()
            generate_rollouts(model, tok, [e.messages for e in exs], args.G, max_new_tokens=args.max_new_tokens,
                              temperature=0.7, share_prefix=share)
            best = min(best, time.perf_counter() - t0)
        return best

    P, T = group.prompt_ids.shape[1], int(group.response_mask.sum(-1).max())
    rows = []
    for name, fn in (("log-prob forward+backward, one group", fwd_bwd), ("generate, B*G rows", gen)):
        plain, shared = fn(False), fn(True)
        rows.append((name, plain, shared))
    print(f"model={args.model or 'default'} threads={args.threads} G={args.G} B={args.B} prompt_len={P} "
          f"max_response_len={T} (best of {args.reps})")
    print("| what | plain (s) | shared prefix (s) | speed-up |")
    print("|---|---|---|---|")
    for name, plain, shared in rows:
        print(f"| {name} | {plain:.3f} | {shared:.3f} | {plain / shared:.2f}x |")


if __name__ == "__main__":
    main()
