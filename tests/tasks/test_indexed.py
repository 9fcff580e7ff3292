"""IndexedTask's shared sequence part: length from ``size``, one bounds check naming the task."""

from __future__ import annotations

import pytest

from echotrain.tasks.testbed import TestbedTask
from echotrain.tasks.testbed_length import LengthTestbedTask


@pytest.mark.parametrize("cls,name", [(TestbedTask, "testbed"), (LengthTestbedTask, "testbed-length")])
def test_length_iteration_and_the_bounds_check(cls, name):
    task = cls(split="train", size=5, seed=0)
    assert len(task) == 5 and [e.index for e in task] == [0, 1, 2, 3, 4] and task[4].task == name
    for bad in (5, -1):
        with pytest.raises(IndexError, match=rf"^index {bad} out of range for task {name} of size 5$"):
            task[bad]
