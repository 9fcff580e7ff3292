"""Helpers the async-rollout tests pickle into the worker process (an importable module: the
tests themselves are imported by pytest's importlib mode under names a child cannot import)."""

from __future__ import annotations

import time


class SlowReward:
    """The task's reward function, but its second call takes ``sleep_s`` seconds."""

    def __init__(self, task, sleep_s: float = 30.0):
        from echotrain.train.collect import default_reward_fn

        self.inner, self.calls, self.sleep_s = default_reward_fn(task), 0, sleep_s

    def __call__(self, completions, examples):
        self.calls += 1
        if self.calls == 2:
            time.sleep(self.sleep_s)
        return self.inner(completions, examples)


class RaisingReward:
    """A reward function that raises on its first call (in the worker process)."""

    def __call__(self, completions, examples):
        raise ValueError("the reward function exploded on purpose")
