"""Measure a policy's starting accuracy and format rate on a task (before any training).

Used to choose the default task of `echotrain train` (see docs/benchmarks.md, "Tasks: starting accuracy of the default task"):

    python scripts/measure_start_accuracy.py --task default --n 64 --temperature 0.7 --max-new-tokens 48

Task options go as --opt key=value (values parsed as Python literals when possible), e.g.
    --task basic_arithmetic --opt min_terms=2 --opt max_terms=2 --opt max_digits=1
"""

from __future__ import annotations

import argparse
import ast
import time

import torch

from _report import report  # scripts/_report.py


def _parse_opt(text: str):
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub id / folder; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--task", default="default", help="echotrain task name (default: the default task)")
    p.add_argument("--opt", action="append", default=[], help="task option key=value (repeatable)")
    p.add_argument("--n", type=int, default=64, help="number of prompts (one sample each)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="seed of prompt sampling and generation")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    p.add_argument("--show", type=int, default=4, help="completions printed")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    from echotrain.models import load_policy
    from echotrain.rewards import RewardFunction
    from echotrain.tasks import get_task

    t0 = time.time()
    model, tokenizer = load_policy(args.model)
    t_load = time.time() - t0
    task = get_task(args.task, **dict(_parse_opt(o) for o in args.opt))
    examples = task.sample(args.n, seed=args.seed)
    torch.manual_seed(args.seed)

    completions: list[str] = []
    t0 = time.time()
    for start in range(0, len(examples), args.batch_size):
        batch = examples[start : start + args.batch_size]
        prompts = [
            tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False) for ex in batch
        ]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=args.temperature > 0,
                temperature=args.temperature if args.temperature > 0 else None,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_new_tokens,
            )
        completions += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    t_gen = time.time() - t0

    rewards, info = RewardFunction(task)(completions, examples)
    result = {
        "model": args.model or "smollm2-135m-instruct (embedded)",
        "task": repr(task),
        "n": len(examples),
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "threads": args.threads,
        "accuracy": round(info["accuracy"], 4),
        "format_rate": round(info["format_rate"], 4),
        "accuracy_given_format": round(info["accuracy"] / info["format_rate"], 4) if info["format_rate"] else None,
        "n_timeouts": info["n_timeouts"],
        "n_exceptions": info["n_exceptions"],
        "load_s": round(t_load, 1),
        "generate_s": round(t_gen, 1),
    }
    for ex, c, r in list(zip(examples, completions, rewards.tolist()))[: args.show]:
        print(f"--- Q: {ex.question!r} gold={ex.answer!r} reward={r}\n{c!r}")
    report(result, args.json)


if __name__ == "__main__":
    main()
