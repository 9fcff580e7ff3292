"""Metrics a task or a reward function adds to each step's ``metrics.jsonl`` line.

A task (or the function of ``reward=module:function``) may define

    step_metrics(completions: list[str], examples: list[Example], scores: torch.Tensor) -> dict[str, float]

called once per training step on the step's trained rollouts: ``completions[i]`` the decoded
response of row ``i`` (N rows: the step's prompt groups x ``num_generations``, after dynamic
sampling), ``examples[i]`` its prompt's :class:`~echotrain.tasks.Example`, ``scores`` float32 (N,)
the task's ``score`` (or the reward function's value) of each row, before any reward shaping.
It returns one number per metric. Each name must be declared once with
:func:`echotrain.metrics.declare_metric` and ``reduce="step"`` (one value per training step), in
the module that defines the task, so the run writes it, plots it on its ``panel`` and lists it
like every built-in metric. A reward function carries it as an attribute
(``my_reward.step_metrics = fn``); it wins over the task's.

What is checked (a :class:`~echotrain.errors.ConfigError`: the CLI prints one line, exit 2):
the result is a mapping; every name is declared, with ``reduce="step"``, and is not one of the
step's built-in keys; every value is a finite real number (a Python or NumPy number or a 0-d tensor; never a silent NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

from echotrain.metrics import METRICS
from echotrain.train.config import ConfigError

#: ``step_metrics(completions, examples, scores) -> {name: value}``
StepMetricsFn = Callable[[list, list, Any], Mapping[str, float]]


def step_metrics_fn(task: Any, reward_fn: Any = None) -> StepMetricsFn | None:
    """The ``step_metrics`` callable of the run: the reward function's (``reward_fn.task``, a
    :class:`~echotrain.rewards.custom.CustomRewardTask` for ``reward=``) or else ``task``'s;
    None when neither defines one."""
    for owner in (getattr(reward_fn, "task", None), task):
        fn = getattr(owner, "step_metrics", None)
        if callable(fn):
            return fn
    return None


def task_step_metrics(fn: StepMetricsFn | None, completions: list[str], examples: list[Any], scores: Any,
                      builtin: Mapping[str, Any] = {}) -> dict[str, float]:
    """``fn(completions, examples, scores)`` checked as the module docstring says; ``{}`` when
    ``fn`` is None. ``builtin``: the step's record so far (its keys may not be returned).

    Raises:
        ConfigError: not a mapping, an undeclared name, a name declared with another ``reduce``,
            a built-in key, or a value that is not a finite real number.
    """
    if fn is None:
        return {}
    owner = getattr(getattr(fn, "__self__", None), "name", None) or getattr(fn, "__qualname__", repr(fn))
    out = fn(list(completions), list(examples), scores)
    if not isinstance(out, Mapping):
        raise ConfigError(f"step_metrics of {owner} returned {type(out).__name__}, not a mapping of metric names "
                          "to numbers")
    checked: dict[str, float] = {}
    for name, value in out.items():
        where = f"step_metrics of {owner}: metric {name!r}"
        if name not in METRICS:
            raise ConfigError(f"{where} is not declared: call echotrain.metrics.declare_metric({name!r}, "
                              "reduce='step', unit=..., help=...) in the module of the task")
        if METRICS[name].reduce != "step":
            raise ConfigError(f"{where} is declared with reduce={METRICS[name].reduce!r}; a task's metric is one "
                              "value per training step: reduce='step'")
        if name in builtin:
            raise ConfigError(f"{where} is one of the step's own metrics; give it a name of its own")
        try:  # a Python or NumPy number, a 0-d tensor; not a bool or a string
            number = None if isinstance(value, (bool, str, bytes)) else float(value)
        except (TypeError, ValueError, RuntimeError):
            number = None
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where} has the value {value!r}; it must be a finite real number")
        checked[name] = number
    return checked
