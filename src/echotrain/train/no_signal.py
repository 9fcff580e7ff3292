"""A run that cannot learn: every prompt group of its first steps scored alike.

Group-relative advantages (GRPO and every estimator of :mod:`echotrain.rl.advantages`) are
exactly 0 for a group whose rewards are all equal, so when *every* group of a step scored alike
the policy-gradient term of that step is 0 (only a KL term, if any, moves the policy). A model
that never writes the answer in the form the reward reads (or a task it always or never solves)
does this on every step, and the run trains nothing while looking normal.

The trainer records, per step, whether every group of the step had zero reward variance
(:data:`METRICS`), and warns once in the terminal when the first ``no_signal_steps`` steps an
invocation runs all did (a run shorter than that: at its last step); the closing summary counts
such steps. ``no_signal_steps`` is a trainer key (``train/config/schema.py``; 0 = never warn).
"""

from __future__ import annotations

from typing import Any

import torch

from echotrain.metrics import Metric, declare_metric
from echotrain.rl import zero_variance_groups

#: the metric key: 1 when every prompt group of the step had zero reward variance, else 0
ALL_ZERO_VARIANCE = "groups/all_zero_variance"

#: the metric this module adds to each step record, declared in the metric schema
METRICS: dict[str, Metric] = {m.name: m for m in (
    declare_metric(ALL_ZERO_VARIANCE, reduce="step", unit="0/1 (int)",
                   help="every prompt group of the step scored alike (zero reward variance), so every advantage "
                        "is 0: no learning signal"),
)}


def all_zero_variance(rewards: torch.Tensor, group_index: torch.Tensor) -> bool:
    """Whether every prompt group has all-equal rewards.

    Args:
        rewards: ``(N,)`` float rewards as the advantages read them (after any shaping).
        group_index: ``(N,)`` int prompt ids.

    Returns:
        True when every group's rewards are exactly equal (True for an empty batch too).

    Raises:
        TypeError / ValueError: as :func:`echotrain.rl.zero_variance_groups` (bad shapes, NaN/Inf).
    """
    return bool(zero_variance_groups(rewards, group_index).all())


def warning_text(num_steps: int) -> str:
    """The one-line terminal warning after ``num_steps`` steps without a learning signal."""
    steps = f"{num_steps} step" + ("s" if num_steps != 1 else "")
    return (f"echotrain: warning: no learning signal: every group scored alike for {steps} (all rollouts of "
            f"each prompt got the same reward, so every advantage is 0 and the policy-gradient update is 0). "
            f"Look at samples.jsonl: does the model write the answer in the form the reward reads (e.g. <answer> "
            f"tags)? If it never (or always) scores: show it the format (a worked example, task_options.one_shot), "
            f"or use an easier (or harder) task, more rollouts (num_generations) or more new tokens "
            f"(max_new_tokens). {ALL_ZERO_VARIANCE} in metrics.jsonl marks such steps.")


class NoSignalWatch:
    """Counts the leading steps of an invocation without a learning signal and says when to warn.

    Args:
        num_steps: the ``no_signal_steps`` key: warn when this many first steps all had no
            signal; 0 = never.
    """

    def __init__(self, num_steps: int):
        if num_steps < 0:
            raise ValueError(f"no_signal_steps must be >= 0, got {num_steps}")
        self.num_steps = num_steps
        self.streak = 0  # leading steps without signal; -1 once a step had signal or the warning was given

    def update(self, record: dict[str, Any], last: bool = False) -> str | None:
        """Feed one step's metrics record; returns the warning text once, else None.

        Args:
            record: the step's record (reads :data:`ALL_ZERO_VARIANCE`; a record without it
                counts as having signal).
            last: this is the invocation's last step (a run shorter than ``num_steps`` is
                warned about at its end).
        """
        if self.num_steps == 0 or self.streak < 0:
            return None
        if not record.get(ALL_ZERO_VARIANCE):
            self.streak = -1
            return None
        self.streak += 1
        if self.streak >= self.num_steps or last:
            n, self.streak = self.streak, -1
            return warning_text(n)
        return None


def summary_line(records: list[dict[str, Any]]) -> str | None:
    """'no learning signal on N of M steps ...' for the closing summary, or None when N is 0."""
    n = sum(1 for r in records if r.get(ALL_ZERO_VARIANCE))
    if n == 0:
        return None
    return (f"no learning signal on {n} of {len(records)} steps: every group scored alike, every advantage 0 "
            f"({ALL_ZERO_VARIANCE})")
