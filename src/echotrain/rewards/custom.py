"""A user's reward function by import path: ``reward=my_module:my_reward``.

Two call styles are accepted, told apart by the function's first parameter name:

- per sample (ours): ``fn(completion: str, example: Example) -> float``;
- batched (TRL ``reward_funcs``): ``fn(completions: list[str], **kwargs) -> list[float]``, first
  parameter named ``completions``. It is called one sample at a time (so each sample gets its
  own timeout and a failure scores only that sample 0) with the keyword arguments it accepts
  among ``prompts`` (bare questions), ``answer`` (gold answers) and ``examples``.

A function may carry per-step metrics as an attribute, ``fn.step_metrics = metrics_fn``
(:mod:`echotrain.train.task_metrics`); they win over the task's.

:class:`CustomRewardTask` wraps a task so that :class:`echotrain.rewards.RewardFunction` scores
with the custom function (timeouts and exceptions counted per sample) and keeps the task's
format check.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["CustomRewardTask", "load_reward"]


def load_reward(spec: str) -> Callable[[str, Any], float]:
    """Import ``module:function`` and return a per-sample ``score(completion, example) -> float``.

    The current directory is put on ``sys.path`` first, so ``reward=my_reward:fn`` finds a
    ``my_reward.py`` next to where the command runs.

    Raises:
        echotrain.errors.ConfigError: bad spec, module not importable, no such callable.
    """
    from echotrain.errors import ConfigError

    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward={spec!r}: expected 'module:function' (e.g. reward=my_reward:score)")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward={spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward={spec!r}: module {module_name!r} has no callable {attr!r}")
    params = list(inspect.signature(fn).parameters.values())
    if not params:
        raise ConfigError(f"reward={spec!r}: the function takes no arguments")
    score = _per_sample(fn, params)
    score.step_metrics = getattr(fn, "step_metrics", None)  # its per-step metrics (train/task_metrics.py)
    return score


def _per_sample(fn: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[[str, Any], float]:
    """``fn`` as ``score(completion, example) -> float`` (see :func:`load_reward`)."""
    if params[0].name != "completions":
        return lambda completion, example: float(fn(completion, example))
    names = {p.name for p in params}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def batched(completion: str, example: Any) -> float:
        kwargs = {"prompts": [getattr(example, "question", None)], "answer": [getattr(example, "answer", None)],
                  "examples": [example]}
        kwargs = {k: v for k, v in kwargs.items() if var_kw or k in names}
        out = fn([completion], **kwargs)
        value = out[0] if isinstance(out, (list, tuple)) else out
        return float("nan") if value is None else float(value)

    return batched


class CustomRewardTask:
    """``task`` with ``score`` replaced by a custom reward (``is_formatted`` etc. delegated)."""

    def __init__(self, task: Any, score_fn: Callable[[str, Any], float]):
        self._task, self._score = task, score_fn

    def score(self, completion: str, example: Any) -> float:
        return self._score(completion, example)

    @property
    def step_metrics(self) -> Any:
        """The reward function's ``step_metrics`` attribute, else the task's, else None
        (:mod:`echotrain.train.task_metrics`)."""
        return getattr(self._score, "step_metrics", None) or getattr(self._task, "step_metrics", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)
