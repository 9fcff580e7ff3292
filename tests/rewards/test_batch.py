"""Batched rewards: exact values, counted timeouts/exceptions, worker threads, real tasks."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from echotrain.rewards import RewardFunction, score_batch
from echotrain.tasks import JsonlMathTask, get_task


class _FakeTask:
    """score: '1' -> 1.0, '0' -> 0.0, 'hang' -> blocks, 'raise' -> error, 'nan' -> NaN."""

    name = "fake"

    def score(self, completion, example):
        if completion == "hang":
            threading.Event().wait(5.0)
        if completion == "raise":
            raise KeyError("missing field")
        if completion == "nan":
            return float("nan")
        return float(completion == "1")

    def is_formatted(self, completion):
        return completion in ("0", "1")


COMPLETIONS = ["1", "0", "hang", "raise", "nan", "1"]


def _check(rewards, info, format_weight):
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    fmt = torch.tensor([True, True, False, False, False, True])
    assert torch.equal(info["correct"], correct)
    assert torch.equal(info["format_ok"], fmt)
    assert rewards.dtype == torch.float32 and rewards.shape == (6,)
    assert torch.allclose(rewards, correct + format_weight * fmt.float())
    assert info["n_timeouts"] == 1
    assert info["n_exceptions"] == 2  # the KeyError and the NaN
    assert info["n_format_ok"] == 3
    assert info["accuracy"] == pytest.approx(2 / 6)
    assert info["format_rate"] == pytest.approx(3 / 6)
    assert any("KeyError" in e for e in info["errors"]) and any("non-finite" in e for e in info["errors"])


def test_score_batch_counts_and_logs_failures(caplog):
    task = _FakeTask()
    with caplog.at_level(logging.WARNING, logger="echotrain.rewards"):
        rewards, info = score_batch(
            COMPLETIONS, [None] * 6, task.score, format_fn=task.is_formatted, format_weight=0.5, timeout_s=0.2
        )
    _check(rewards, info, 0.5)
    assert sum("failed for sample" in r.message for r in caplog.records) == 3


def test_reward_function_from_a_worker_thread():
    reward_fn = RewardFunction(_FakeTask(), timeout_s=0.2)
    with ThreadPoolExecutor(max_workers=1) as pool:
        rewards, info = pool.submit(reward_fn, COMPLETIONS, [None] * 6).result()
    _check(rewards, info, 0.0)
    assert reward_fn.total_timeouts == 1 and reward_fn.total_exceptions == 2


def test_math_task_reward_from_a_worker_thread():
    """math-verify runs off the main thread without its signal timeout failing."""
    task = JsonlMathTask("t", [{"question": "q", "answer": r"\frac{1}{2}"}, {"question": "q2", "answer": "1000"}])
    examples = [task[0], task[0], task[1], task[1]]
    completions = [r"so \boxed{0.5}", r"\boxed{0.4}", r"total: \boxed{1,000}", "the answer is 1000"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        rewards, info = pool.submit(RewardFunction(task, format_weight=0.1), completions, examples).result()
    assert torch.allclose(rewards, torch.tensor([1.1, 0.1, 1.1, 0.0]))
    assert info["n_exceptions"] == 0 and info["n_timeouts"] == 0 and info["n_format_ok"] == 3


def test_reasoning_gym_task_rewards():
    task = get_task("default", size=20, seed=3)
    ex = task[0]
    completions = [f"<answer>{ex.answer}</answer>", f"<answer>{int(ex.answer) + 1}</answer>", f"it is {ex.answer}"]
    rewards, info = RewardFunction(task)(completions, [ex] * 3)
    assert rewards.tolist() == [1.0, 0.0, 0.0]  # no tag -> 0 even with the right number in the text
    assert info["format_ok"].tolist() == [True, True, False]


def test_bad_arguments():
    task = _FakeTask()
    with pytest.raises(ValueError, match="same length"):
        score_batch(["1"], [None, None], task.score)
    with pytest.raises(ValueError, match="format_weight must be finite"):
        score_batch(["1"], [None], task.score, format_weight=float("nan"))
    with pytest.raises(TypeError, match=r"completions\[0\] must be a str"):
        score_batch([1], [None], task.score)
    with pytest.raises(TypeError, match="must have callable score"):
        RewardFunction(object())
    rewards, info = score_batch([], [], task.score)
    assert rewards.shape == (0,) and info["accuracy"] == 0.0
