"""call_isolated: math-verify in a killable worker process (stops work stuck in C code)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from echotrain.rewards import IsolatedWorker, RewardFunction, RewardTimeout, call_isolated, math_equal
from echotrain.tasks import JsonlMathTask

# sympy evaluates this in CPython's big-integer power, inside one C call holding the GIL: no
# in-process timeout (signal or thread) can stop it; only killing a process can.
BLOWUP = "9^{9^{9^{9}}}"


@pytest.fixture(scope="module")
def worker():
    w = IsolatedWorker()
    yield w
    w.close()


def test_results_and_exceptions_come_back(worker):
    assert worker.call(math_equal, "0.5", r"\frac{1}{2}", timeout_s=10.0) is True
    assert worker.call(math_equal, "2", "3", timeout_s=10.0) is False
    with pytest.raises(ValueError, match="gold answer is empty"):
        worker.call(math_equal, "1", " ", timeout_s=10.0)
    with pytest.raises((AttributeError, TypeError, Exception), match="pickle|lambda"):
        worker.call(lambda: 1, timeout_s=1.0)
    assert worker.restarts == 0  # neither an exception nor a bad request costs the worker


@pytest.mark.parametrize("in_thread", [False, True])
def test_blowup_is_killed_and_the_worker_restarts(worker, in_thread):
    def run():
        t0 = time.monotonic()
        with pytest.raises(RewardTimeout, match="worker process killed"):
            worker.call(math_equal, BLOWUP, "7", timeout_s=0.5)
        return time.monotonic() - t0

    restarts = worker.restarts
    if in_thread:
        with ThreadPoolExecutor(max_workers=1) as pool:
            elapsed = pool.submit(run).result()
    else:
        elapsed = run()
    assert elapsed < 1.5
    assert worker.restarts == restarts + 1
    assert worker.call(math_equal, "1,000", "1000", timeout_s=10.0) is True  # a fresh worker answers


def test_math_task_reward_survives_a_blowup_in_a_worker_thread():
    task = JsonlMathTask("t", [{"question": "q", "answer": "7"}], verify_timeout_s=0.5)
    completions = [rf"\boxed{{{BLOWUP}}}", r"\boxed{7}", r"\boxed{\frac{14}{2}}"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        rewards, info = pool.submit(RewardFunction(task, timeout_s=30.0), completions, [task[0]] * 3).result()
    assert torch.equal(rewards, torch.tensor([0.0, 1.0, 1.0]))
    assert info["n_timeouts"] == 1 and info["n_exceptions"] == 0
    assert call_isolated(math_equal, "0.5", "1/2", timeout_s=10.0) is True
