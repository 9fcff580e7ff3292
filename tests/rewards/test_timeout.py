"""call_with_timeout on the main thread (signal path) and in worker threads (thread path)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from echotrain.rewards import RewardTimeout, call_with_timeout


def _spin_forever():
    while True:
        pass


def _spin_swallowing_everything_once():
    """Swallows the first interrupt (as a broad `except BaseException` in a library would)."""
    swallowed = False
    while True:
        try:
            while True:
                pass
        except BaseException:
            if swallowed:
                raise
            swallowed = True


def _wait(seconds):
    threading.Event().wait(seconds)
    return "done"


def _boom():
    raise ZeroDivisionError("boom")


def test_returns_value_and_passes_arguments():
    assert call_with_timeout(lambda a, b=0: a + b, 2, b=3, timeout_s=1.0) == 5
    assert call_with_timeout(lambda: 7, timeout_s=None) == 7


def test_main_thread_interrupts_a_busy_loop_and_restores_the_handler():
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match="did not finish within 0.2 s"):
        call_with_timeout(_spin_forever, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_main_thread_interrupt_survives_a_swallowing_except():
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout):
        call_with_timeout(_spin_swallowing_everything_once, timeout_s=0.1)
    assert time.monotonic() - t0 < 1.5


def _reward_threads():
    return {t for t in threading.enumerate() if t.name == "echotrain-reward"}


def _new_reward_threads_after(before, limit_s=2.0):
    """Reward worker threads not in ``before`` still alive after up to ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while _reward_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return _reward_threads() - before


def test_worker_thread_times_out_without_signals():
    def run():
        t0 = time.monotonic()
        with pytest.raises(RewardTimeout, match="worker thread told to stop"):
            call_with_timeout(_wait, 5.0, timeout_s=0.1)
        fast = call_with_timeout(_wait, 0.0, timeout_s=1.0)
        return time.monotonic() - t0, fast

    with ThreadPoolExecutor(max_workers=1) as pool:
        elapsed, fast = pool.submit(run).result()
    assert elapsed < 1.5
    assert fast == "done"


def test_worker_thread_busy_loop_is_stopped_not_left_spinning():
    """The timed-out worker gets an async exception and ends (no core left burning)."""
    before = _reward_threads()
    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(RewardTimeout):
            pool.submit(call_with_timeout, _spin_forever, timeout_s=0.1).result()
    assert _new_reward_threads_after(before) == set()


@pytest.mark.parametrize("in_worker", [False, True])
def test_exceptions_propagate_unchanged(in_worker):
    def run():
        with pytest.raises(ZeroDivisionError, match="boom"):
            call_with_timeout(_boom, timeout_s=1.0)
        return True

    if in_worker:
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(run).result()
    else:
        assert run()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bad_timeout_is_rejected(bad):
    with pytest.raises(ValueError, match="timeout_s must be a positive finite"):
        call_with_timeout(lambda: 1, timeout_s=bad)
