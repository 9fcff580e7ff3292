"""Batched rewards that never hang or crash a run.

Each sample is scored under ``call_with_timeout``; a timeout or an exception gives that sample
0, is counted in ``info`` and logged (logger ``echotrain.rewards``) -- never swallowed silently,
never fatal. Reward (binary correctness by default, as in DeepSeek-R1 / DAPO rule-based rewards):

    r_i = correct_i + format_weight * format_ok_i

where ``correct_i = score_fn(completion_i, example_i)`` (1.0 / 0.0 for our tasks) and
``format_ok_i`` says whether an answer in the task's format is present.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from echotrain.rewards.timeout import RewardTimeout, _check_timeout, call_with_timeout

if TYPE_CHECKING:
    import torch

__all__ = ["RewardFunction", "score_batch"]

logger = logging.getLogger("echotrain.rewards")

_MAX_ERRORS_KEPT = 8


def score_batch(
    completions: Sequence[str],
    examples: Sequence[Any],
    score_fn: Callable[[str, Any], float],
    *,
    format_fn: Callable[[str], bool] | None = None,
    format_weight: float = 0.0,
    timeout_s: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Score a batch of completions; safe to call from any thread.

    Args:
        completions: B completion texts (the generated part only).
        examples: B examples, ``examples[i]`` the prompt of ``completions[i]``.
        score_fn: ``score_fn(completion, example) -> float`` (the task's ``score``).
        format_fn: ``format_fn(completion) -> bool``; ``None`` counts every sample as formatted.
        format_weight: weight of the format bonus (0 = pure correctness, the default).
        timeout_s: per-sample time limit in seconds for ``score_fn`` and ``format_fn`` together
            (each call gets the full limit); ``None`` = unbounded.

    Returns:
        ``(rewards, info)``: ``rewards`` float32 tensor (B,); ``info`` with ``correct`` float32
        (B,), ``format_ok`` bool (B,), ``n_timeouts``, ``n_exceptions``, ``n_format_ok`` (int),
        ``accuracy`` (mean of ``correct``) and ``format_rate`` (float), ``errors`` (up to 8
        short messages ``"i: Type: message"``).

    Raises:
        ValueError: ``completions`` and ``examples`` differ in length, ``format_weight`` is not
            finite, or ``timeout_s`` is not positive.
        TypeError: a completion is not a ``str``.
    """
    if len(completions) != len(examples):
        raise ValueError(
            f"completions and examples must have the same length, got {len(completions)} and {len(examples)}"
        )
    if not math.isfinite(float(format_weight)):
        raise ValueError(f"format_weight must be finite, got {format_weight}")
    _check_timeout(timeout_s)
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise TypeError(f"completions[{i}] must be a str, got {type(c).__name__}")

    import torch  # here, not at import: the reward worker process imports this package

    n = len(completions)
    correct = torch.zeros(n, dtype=torch.float32)
    format_ok = torch.zeros(n, dtype=torch.bool)
    n_timeouts = n_exceptions = 0
    errors: list[str] = []

    def record(i: int, what: str, exc: BaseException) -> None:
        msg = f"{i}: {type(exc).__name__}: {exc}"
        if len(errors) < _MAX_ERRORS_KEPT:
            errors.append(msg)
        logger.warning("reward %s failed for sample %s", what, msg)

    def guarded(i: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) under the timeout; a timeout or exception is counted, logged and gives None."""
        nonlocal n_timeouts, n_exceptions
        try:
            return call_with_timeout(fn, *args, timeout_s=timeout_s)
        except RewardTimeout as exc:
            n_timeouts += 1
            record(i, f"{what} (timeout)", exc)
        except Exception as exc:
            n_exceptions += 1
            record(i, what, exc)
        return None

    def finite_score(completion: str, example: Any) -> float:
        value = float(score_fn(completion, example))
        if not math.isfinite(value):
            raise ValueError(f"score_fn returned a non-finite reward {value}")
        return value

    for i, (completion, example) in enumerate(zip(completions, examples)):
        value = guarded(i, "score", finite_score, completion, example)
        if value is not None:
            correct[i] = value
        if format_fn is None:
            format_ok[i] = True
        else:
            format_ok[i] = bool(guarded(i, "format", format_fn, completion))

    rewards = correct + float(format_weight) * format_ok.to(torch.float32)
    info = {
        "correct": correct,
        "format_ok": format_ok,
        "n_timeouts": n_timeouts,
        "n_exceptions": n_exceptions,
        "n_format_ok": int(format_ok.sum()),
        "accuracy": float(correct.mean()) if n else 0.0,
        "format_rate": float(format_ok.to(torch.float32).mean()) if n else 0.0,
        "errors": errors,
    }
    return rewards, info


class RewardFunction:
    """A task's reward as one callable: ``rewards, info = reward_fn(completions, examples)``.

    Args:
        task: any object with ``score(completion, example) -> float`` and
            ``is_formatted(completion) -> bool`` (every ``echotrain.tasks`` task).
        timeout_s: per-sample time limit in seconds (default 5; ``None`` = unbounded).
        format_weight: format bonus weight (default 0 = binary correctness only).

    Attributes:
        total_timeouts, total_exceptions: counts summed over every call, for run-level logs.

    See ``score_batch`` for the returned values and errors.
    """

    def __init__(self, task: Any, *, timeout_s: float | None = 5.0, format_weight: float = 0.0):
        if not callable(getattr(task, "score", None)) or not callable(getattr(task, "is_formatted", None)):
            raise TypeError("task must have callable score(completion, example) and is_formatted(completion)")
        _check_timeout(timeout_s)
        if not math.isfinite(float(format_weight)):
            raise ValueError(f"format_weight must be finite, got {format_weight}")
        self.task = task
        self.timeout_s = timeout_s
        self.format_weight = float(format_weight)
        self.total_timeouts = 0
        self.total_exceptions = 0

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        rewards, info = score_batch(
            completions,
            examples,
            self.task.score,
            format_fn=self.task.is_formatted,
            format_weight=self.format_weight,
            timeout_s=self.timeout_s,
        )
        self.total_timeouts += info["n_timeouts"]
        self.total_exceptions += info["n_exceptions"]
        return rewards, info

    def __repr__(self) -> str:
        return (
            f"RewardFunction(task={getattr(self.task, 'name', self.task)!r}, "
            f"timeout_s={self.timeout_s}, format_weight={self.format_weight})"
        )
