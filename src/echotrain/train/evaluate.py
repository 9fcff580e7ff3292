"""Evaluation of a policy on a task (``echotrain eval --task`` and a training run's evaluation):
accuracy and unbiased pass@k (:func:`echotrain.runtime.sampling_stats.pass_at_k`).

pass@k uses the unbiased estimator of Chen et al. 2021 (Codex, arXiv 2107.03374, Eq. 1): with
n samples per problem of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over
problems.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from echotrain.runtime.cpu_linear import DEFAULT_DECODE_LINEAR, linear_backend
from echotrain.runtime.rollout import generate_rollouts
from echotrain.runtime.sampling_stats import pass_at_k


def default_eval_task(task: Any, task_name: str, task_options: dict[str, Any]) -> Any:
    """The task of a training run's greedy evaluation: ``task.eval_task()`` when the task has one
    (its held-out split), else the task built by ``get_task(task_name, **task_options)`` with
    ``seed + 1`` when it takes a seed (other questions than the training ones), else ``task``."""
    own = task.eval_task() if callable(getattr(task, "eval_task", None)) else None
    if own is not None:
        return own
    if "seed" in getattr(task, "__dict__", {}):
        from echotrain.tasks import get_task

        try:
            return get_task(task_name, **{**task_options, "seed": int(task.seed) + 1})
        except (KeyError, TypeError, ValueError):
            return task
    return task


def evaluate(model: Any, tokenizer: Any, task: Any, *, num_prompts: int = 64, n: int = 4,
             ks: Sequence[int] = (1,), max_new_tokens: int = 48, temperature: float = 0.7, top_p: float = 1.0,
             seed: int = 1234,
             batch_prompts: int = 16, reward_fn: Any = None, keep_samples: int = 0,
             decode_loop: str = "echotrain", sampler: str = "inverse_cdf",
             decode_linear: str = DEFAULT_DECODE_LINEAR,
             episodes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sample ``n`` completions for each of ``num_prompts`` task prompts and score them.

    ``temperature=0`` decodes greedily (then every sample of a prompt is the same; use n=1);
    ``top_p`` < 1 samples from the nucleus (unused when greedy).
    ``decode_loop``, ``sampler``, ``decode_linear``: as in :func:`~echotrain.runtime.rollout.generate_rollouts`.
    ``episodes``: a run with an environment (``env=``) is evaluated as it trains: each sample is an
    episode (:func:`~echotrain.runtime.episodes.run_episodes` with these keyword arguments:
    ``make_env``, ``max_turns``, ``max_episode_tokens``), its final model turn scored;
    ``max_new_tokens`` is then one turn's limit, and ``truncated_frac`` counts episodes cut by the
    token budget. None: single completions.

    Returns:
        ``{"accuracy": mean correctness over all samples, "format_rate": ..., "pass@k": ... for k
        in ks, "num_prompts", "n", "truncated_frac": share of completions that hit
        max_new_tokens}``; with ``keep_samples > 0`` also ``"samples"``: the first
        ``keep_samples`` completions as dicts (question, answer, completion, correct, truncated).

    Raises:
        ValueError: a k outside [1, n].
    """
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"k={k} must be in [1, n={n}]")
    if reward_fn is None:
        from echotrain.rewards import RewardFunction

        reward_fn = RewardFunction(task)
    torch.manual_seed(seed)
    examples = list(task.sample(num_prompts, seed))
    correct_all, fmt_all, trunc_all, samples = [], [], [], []
    with linear_backend(model, decode_linear):  # one context for every batch: weights packed once
        for start in range(0, len(examples), batch_prompts):
            exs = examples[start:start + batch_prompts]
            sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature if temperature > 0 else 1.0,
                            do_sample=temperature > 0, top_p=top_p if temperature > 0 else 1.0, decode_loop=decode_loop,
                            sampler=sampler, decode_linear=decode_linear)
            if episodes is not None:
                from echotrain.runtime.episodes import run_episodes

                res = run_episodes(model, tokenizer, exs, n, **episodes, **sampling)
                batch, texts = res.batch, res.final_texts
            else:
                batch = generate_rollouts(model, tokenizer, [e.messages for e in exs], n, record_log_prob=False, **sampling)
                texts = [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                         for ids, m in zip(batch.response_ids, batch.response_mask)]
            rows = [e for e in exs for _ in range(n)]
            _, info = reward_fn(texts, rows)
            trunc_all.append(batch.truncated.float())
            for i in range(0, len(texts), n):  # the first sample of each prompt
                if len(samples) < keep_samples:
                    samples.append({"question": getattr(rows[i], "question", None), "answer": getattr(rows[i], "answer", None),
                                    "completion": texts[i], "correct": float(info["correct"][i]),
                                    "truncated": bool(batch.truncated[i])})
            correct_all.append(torch.as_tensor(info["correct"], dtype=torch.float32).view(len(exs), n))
            fmt_all.append(torch.as_tensor(info["format_ok"], dtype=torch.float32).view(len(exs), n))
    correct = torch.cat(correct_all)
    out: dict[str, float] = {"accuracy": float(correct.mean()), "format_rate": float(torch.cat(fmt_all).mean()),
                             "num_prompts": float(len(examples)), "n": float(n),
                             "truncated_frac": float(torch.cat(trunc_all).mean())}
    counts = (correct >= 1.0).sum(-1).tolist()
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in counts) / len(counts)
    if keep_samples:
        out["samples"] = samples
    return out
