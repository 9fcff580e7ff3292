"""The step record's length gap between correct and wrong responses (``response_length/gap``,
``response_length/within_group_gap``), by hand, and its absence when undefined."""

from __future__ import annotations

import time

import pytest
import torch

from echotrain.runtime.rollout import RolloutBatch
from echotrain.train.metrics import step_record
from echotrain.train.step import StepData


def _data(lengths, correct, groups):
    n, width = len(lengths), max(lengths)
    mask = torch.tensor([[1.0] * L + [0.0] * (width - L) for L in lengths])
    z = torch.zeros(n, 2, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=z, prompt_mask=z + 1, response_ids=torch.zeros(n, width, dtype=torch.long),
                         response_mask=mask, group_index=torch.tensor(groups), truncated=torch.zeros(n, dtype=torch.bool))
    data = StepData(batch=batch, rewards=torch.tensor(correct, dtype=torch.float32),
                    correct=torch.tensor(correct, dtype=torch.float32), format_ok=torch.ones(n, dtype=torch.bool),
                    examples=[None] * n, texts=[""] * n, time_generation=0.0, time_scoring=0.0)
    data.entropy = torch.zeros(n, width)
    data.seq_advantages = torch.zeros(n)
    return data


def _record(data):
    return step_record(1, data, [], last_lr=1e-3, t_start=time.perf_counter(), cpu_start=time.process_time(),
                       t_update=0.0, device=torch.device("cpu"))


def test_pooled_and_within_group_gaps_by_hand():
    # group 0: correct 10, 14; wrong 6        -> within 12 - 6 = +6
    # group 1: correct 20; wrong 30, 40       -> within 20 - 35 = -15
    # group 2: all wrong (not mixed)
    # pooled: correct (10 + 14 + 20) / 3 = 14.667; wrong (6 + 30 + 40 + 8 + 9) / 5 = 18.6
    data = _data([10, 14, 6, 20, 30, 40, 8, 9], [1, 1, 0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 2, 2])
    r = _record(data)
    assert r["response_length/gap"] == pytest.approx(44 / 3 - 18.6)
    assert r["response_length/within_group_gap"] == pytest.approx((6 - 15) / 2)


def test_gaps_are_not_written_without_right_and_wrong_answers():
    r = _record(_data([3, 5, 7, 9], [0, 0, 0, 0], [0, 0, 1, 1]))
    assert "response_length/gap" not in r and "response_length/within_group_gap" not in r
    # right and wrong answers, but never in one group: the pooled gap only
    r = _record(_data([3, 5, 7, 9], [1, 1, 0, 0], [0, 0, 1, 1]))
    assert r["response_length/gap"] == pytest.approx(4 - 8) and "response_length/within_group_gap" not in r


def test_gaps_split_by_correctness_not_by_reward():
    """Shaped rewards (a format bonus on wrong answers, an overlong penalty on right ones) do not
    move a response between the correct and the wrong side: the split is ``correct``."""
    data = _data([10, 20, 4, 6], [1, 1, 0, 0], [0, 0, 0, 0])
    data.rewards = torch.tensor([0.8, 0.9, 0.1, 0.1])  # every reward > 0, none >= 1
    r = _record(data)
    assert r["response_length/gap"] == pytest.approx(15 - 5)
    assert r["response_length/within_group_gap"] == pytest.approx(15 - 5)
