"""Measure the calculator testbed's start facts (docs/testbed.md, "The calculator testbed").

On held-out problems of ``task=testbed-calc`` (the test split; ``--problems``, default 512), the
policy ``--model`` (default ``testbed-calc``), greedy and sampled (T = 1, ``--samples`` each):

- accuracy **with the tool**: episodes in the ``calculator`` environment (``max_turns`` 2, a turn
  of at most ``--max-new-tokens``), the final model turn scored, as ``env=calculator`` trains and
  evaluates (:func:`echotrain.train.evaluate.evaluate` with ``episodes``);
- accuracy **alone**: single completions, as a run without ``env`` trains and evaluates (a tool
  call then is a wrong answer);
- in the episodes: the share that called the tool, failed calls per call, the share of the
  sampled groups (``--samples`` episodes of one problem) with both right and wrong answers, and in
  those groups the right-minus-wrong length in model tokens (Balanced Aggregation's premise: mean
  and SD over the mixed groups; the pooled gap over all episodes beside it).

Usage::

    OMP_NUM_THREADS=1 nice -n 10 python scripts/measure_testbed_calc.py --json out.json
"""

from __future__ import annotations

import argparse

import torch

from _report import report  # scripts/_report.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="testbed-calc")
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from echotrain.envs import get_env_factory
    from echotrain.models import load_policy
    from echotrain.rewards import RewardFunction
    from echotrain.runtime.episodes import EPISODE_STATS, run_episodes
    from echotrain.tasks import get_task
    from echotrain.train.evaluate import evaluate

    torch.set_num_threads(1)
    model, tok = load_policy(args.model)
    task = get_task("testbed-calc", split="test", size=args.problems, seed=args.seed)
    episodes = dict(make_env=get_env_factory("calculator"), max_turns=2, max_episode_tokens=4 * args.max_new_tokens)
    out: dict = {"model": args.model, "source": model.testbed_report.get("source"), "problems": args.problems}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, args.samples)):
        kw = dict(num_prompts=args.problems, n=n, max_new_tokens=args.max_new_tokens, temperature=temperature,
                  seed=args.seed)
        out[f"{name}_accuracy_with_tool"] = evaluate(model, tok, task, episodes=episodes, **kw)["accuracy"]
        out[f"{name}_accuracy_alone"] = evaluate(model, tok, task, **kw)["accuracy"]
        torch.manual_seed(args.seed)
        examples = list(task.sample(args.problems, args.seed))
        res = run_episodes(model, tok, examples, n, episodes["make_env"], max_new_tokens=args.max_new_tokens,
                           max_turns=2, max_episode_tokens=episodes["max_episode_tokens"], do_sample=temperature > 0)
        stats = res.batch.episode_stats
        col = {k: stats[:, i] for i, k in enumerate(EPISODE_STATS)}
        calls = col["tool_calls"]
        out[f"{name}_episodes_calling"] = float((calls > 0).float().mean())
        out[f"{name}_errors_per_call"] = float(col["tool_errors"].sum() / calls.sum().clamp(min=1))
        if n > 1:
            _, info = RewardFunction(task)(res.final_texts, [e for e in examples for _ in range(n)])
            correct = torch.as_tensor(info["correct"], dtype=torch.float32).view(-1, n)
            out["sampled_mixed_groups"] = float(((correct.sum(1) > 0) & (correct.sum(1) < n)).float().mean())
            # Balanced Aggregation's premise: right and wrong answers to one problem differ in length
            # (model tokens of the episode; the environment's tokens are not trained)
            length = col["model_tokens"].view(-1, n)
            gaps = [float(length[g][correct[g] > 0].mean() - length[g][correct[g] == 0].mean())
                    for g in range(len(correct)) if 0 < correct[g].sum() < n]
            gap = torch.tensor(gaps)
            out["sampled_within_group_gap_mean"] = float(gap.mean()) if gaps else None
            out["sampled_within_group_gap_sd"] = float(gap.std()) if len(gaps) > 1 else None
            out["sampled_within_group_gap_groups"] = len(gaps)
            out["sampled_pooled_gap"] = float(length[correct > 0].mean() - length[correct == 0].mean())
    report(out, args.json)


if __name__ == "__main__":
    main()
