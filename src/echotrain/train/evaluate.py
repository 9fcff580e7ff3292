"""Evaluation: accuracy and unbiased pass@k of a policy on a task.

pass@k uses the unbiased estimator of Chen et al. 2021 (Codex, arXiv 2107.03374, Eq. 1): with
n samples per problem of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over
problems.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from echotrain.train.rollout import generate_rollouts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` correct (Chen et al. 2021, Eq. 1).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def greedy_samples_error(n: int, temperature: float) -> str | None:
    """Why ``n`` samples at ``temperature`` are refused, or None: ``temperature=0`` decodes
    greedily, so every sample of a prompt is the same and ``n > 1`` only repeats the work (and
    makes pass@k for k > 1 equal pass@1). ``echotrain eval`` (``--task`` and ``--suite``) refuses
    it with exit 2 rather than silently resetting ``n`` (a documented choice: the command line the
    user wrote is the one that runs)."""
    if temperature == 0 and n > 1:
        return (f"temperature=0 (--temperature 0) decodes greedily, so the n={n} samples of a prompt would be "
                "identical; use --n 1, or a temperature > 0 to sample")
    return None


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
             ks: Sequence[int] = (1,), max_new_tokens: int = 48, temperature: float = 0.7, seed: int = 1234,
             batch_prompts: int = 16, reward_fn: Any = None, keep_samples: int = 0) -> dict[str, Any]:
    """Sample ``n`` completions for each of ``num_prompts`` task prompts and score them.

    ``temperature=0`` decodes greedily (then every sample of a prompt is the same; use n=1).

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
    for start in range(0, len(examples), batch_prompts):
        exs = examples[start:start + batch_prompts]
        batch = generate_rollouts(model, tokenizer, [e.messages for e in exs], n, max_new_tokens=max_new_tokens,
                                  temperature=temperature if temperature > 0 else 1.0, do_sample=temperature > 0,
                                  record_log_prob=False)
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


def load_for_eval(model: str | None, device: str = "cpu") -> tuple[Any, Any, str]:
    """Load a policy for evaluation from a model name/path, a run directory or a checkpoint file.

    - run directory (has ``config.yaml``): its ``final_model`` if present, else the base model of
      its config with the latest checkpoint's weights;
    - a checkpoint file ``.../checkpoints/step_*.pt``: the run's base model with these weights;
      a LoRA run's checkpoint (``lora_r > 0`` in its config.yaml) holds the adapters only, so
      they are put on the base model (the run's ``lora_*`` settings) and merged into it;
    - anything else (or None): ``echotrain.models.load_policy(model)``.

    Returns:
        ``(model, tokenizer, description)``.

    Raises:
        FileNotFoundError: a run directory without a model or checkpoint.
        echotrain.train.checkpoint.CheckpointError: a damaged checkpoint, or one whose weights do
            not fit the run's base model (names both).
    """
    from echotrain.models import load_policy
    from echotrain.train.checkpoint import CheckpointError, latest_valid_checkpoint, load_checkpoint

    if model is not None and os.path.exists(model):
        p = Path(model)
        ckpt = None
        if p.is_file() and p.suffix == ".pt":
            ckpt, run_dir = p, p.parent.parent
        elif p.is_dir() and (p / "config.yaml").is_file():
            run_dir = p
            if (p / "final_model").is_dir():
                m, tok = load_policy(str(p / "final_model"), device=device)
                return m, tok, f"{p / 'final_model'}"
            ckpt = latest_valid_checkpoint(p)[0]
            if ckpt is None:
                raise FileNotFoundError(f"run directory {str(p)!r} has neither final_model/ nor checkpoints")
        else:
            m, tok = load_policy(str(p), device=device)
            return m, tok, str(p)
        import yaml

        run_cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        base = run_cfg.get("model")
        m, tok = load_policy(base, device=device)
        state = load_checkpoint(ckpt, map_location=device)["model"]
        lora_r = int(run_cfg.get("lora_r") or 0)
        if lora_r > 0:  # the checkpoint holds the adapters only: base model + adapters, merged for speed
            from echotrain.train.lora import apply_lora, load_model_state

            m = apply_lora(m, r=lora_r, alpha=float(run_cfg.get("lora_alpha", 16.0)), dropout=0.0,
                           target_modules=str(run_cfg.get("lora_target_modules", "all-linear")))
            load_model_state(m, state)
            m = m.merge_and_unload().eval()
            return m, tok, f"{ckpt} (base {base or 'default'} + LoRA r={lora_r} adapters)"
        try:
            m.load_state_dict(state)
        except RuntimeError as exc:  # e.g. a checkpoint of another base model
            raise CheckpointError(f"checkpoint {str(ckpt)!r} does not fit its run's base model {base or 'default'!r}: "
                                  f"{str(exc).splitlines()[0]}") from exc
        return m, tok, f"{ckpt} (base {base or 'default'})"
    m, tok = load_policy(model, device=device)
    return m, tok, model or "smollm2-135m-instruct (embedded default)"
