"""Measure the length testbed's start facts (docs/testbed.md) before any study.

On the held-out problems of ``task=testbed-length`` (``--problems``, default all 512): greedy
accuracy at ``--max-new-tokens`` and at a budget that truncates nothing (128); then ``--samples``
completions per problem at temperature 1: accuracy, pass@k, the share of mixed groups, truncated
share, and the response-length facts of :func:`echotrain.train.length_stats.length_facts`
(range, variance, correct-minus-wrong gap pooled and within groups), also per number of terms.
With ``--check-steps`` the same samples are also scored with ``check_steps=True`` (a skipped step
or a guess is wrong): ``sampled_check_steps`` holds those facts, ``greedy_accuracy_check_steps@B``
the greedy accuracy.

Usage::

    OMP_NUM_THREADS=1 nice -n 10 python scripts/measure_testbed_length.py --max-new-tokens 72 --json out.json
    # on a loaded machine, in two parts of under 3 minutes each:
    ... --greedy-budgets 72,128 --samples 0;   ... --greedy-budgets "" --problems 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from _report import report  # scripts/_report.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="testbed-length")
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=72)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy-budgets", default="72,128", help="comma-separated greedy budgets ('' = none)")
    parser.add_argument("--check-steps", action="store_true",
                        help="also score with task option check_steps=true (same samples)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from echotrain.models import load_policy
    from echotrain.tasks import get_task
    from echotrain.train.length_stats import length_facts
    from echotrain.runtime.rollout import generate_rollouts

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model, tok = load_policy(args.model)
    examples = list(get_task("testbed-length").eval_task())[: args.problems]
    prompts = [e.messages for e in examples]
    task = get_task("testbed-length", size=1)
    strict = get_task("testbed-length", size=1, check_steps=True) if args.check_steps else None
    out: dict = {"model": args.model, "source": model.testbed_report.get("source"), "problems": len(examples),
                 "max_new_tokens": args.max_new_tokens}

    def run(n: int, budget: int, sample: bool) -> tuple:
        t0 = time.perf_counter()
        rows = []
        for s in range(0, len(prompts), 64):
            b = generate_rollouts(model, tok, prompts[s: s + 64], n, max_new_tokens=budget, do_sample=sample,
                                  temperature=1.0, group_offset=s)
            texts = [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(b.response_ids, b.response_mask)]
            for i, text in enumerate(texts):
                ex = examples[int(b.group_index[i])]
                rows.append((int(b.group_index[i]), float(b.response_mask[i].sum()), task.score(text, ex),
                             bool(b.truncated[i]), ex.metadata["n_terms"],
                             strict.score(text, ex) if strict is not None else None))
        return rows, time.perf_counter() - t0

    for budget in [int(b) for b in args.greedy_budgets.split(",") if b]:
        rows, sec = run(1, budget, False)
        print(f"greedy@{budget}: {sec:.0f} s", file=sys.stderr, flush=True)
        out[f"greedy_accuracy@{budget}"] = sum(r[2] for r in rows) / len(rows)
        out[f"greedy_truncated@{budget}"] = sum(r[3] for r in rows) / len(rows)
        if strict is not None:
            out[f"greedy_accuracy_check_steps@{budget}"] = sum(r[5] for r in rows) / len(rows)
        out[f"greedy_seconds@{budget}"] = round(sec, 1)
    if args.samples < 1:
        report(out, args.json)  # greedy budgets only
        return
    rows, sec = run(args.samples, args.max_new_tokens, True)
    g = torch.tensor([r[0] for r in rows])
    L = torch.tensor([r[1] for r in rows])
    c = torch.tensor([r[2] for r in rows])
    out["sampled"] = length_facts(L, c, g)
    out["sampled"]["truncated"] = sum(r[3] for r in rows) / len(rows)
    out["sampled"]["pass@k"] = float(c.view(-1, args.samples).max(1).values.mean())
    out["sampled"]["seconds"] = round(sec, 1)
    if strict is not None:
        cs = torch.tensor([r[5] for r in rows])
        out["sampled_check_steps"] = length_facts(L, cs, g)
        out["sampled_check_steps"]["pass@k"] = float(cs.view(-1, args.samples).max(1).values.mean())
    by_n = defaultdict(list)
    for r in rows:
        by_n[r[4]].append(r)
    out["by_n_terms"] = {n: {"accuracy": round(sum(r[2] for r in v) / len(v), 3),
                             "mean_length": round(sum(r[1] for r in v) / len(v), 1),
                             "truncated": round(sum(r[3] for r in v) / len(v), 3)} for n, v in sorted(by_n.items())}
    report(out, args.json)


if __name__ == "__main__":
    main()
