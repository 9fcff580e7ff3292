"""A time limit for reward calls that works on the main thread and in worker threads.

math-verify (and most "timeout" decorators) arm ``SIGALRM``, which Python only allows on the main
thread; a trainer that scores rewards in a thread pool then crashes with ``ValueError: signal
only works in main thread``. ``call_with_timeout`` picks the mechanism that works where it runs:

* main thread, POSIX, no other interval timer armed: ``signal.setitimer(ITIMER_REAL)``; the
  handler raises inside the call, so the stuck work is really interrupted (between Python
  bytecodes; sympy is pure Python). If the call swallows the interrupt (a broad ``except``), the
  timer fires again every 50 ms until the call returns.
* anywhere else: the call runs in a daemon thread that we wait for at most ``timeout_s``. On
  timeout the caller gets ``RewardTimeout`` at once, and the worker is asked to stop with
  CPython's ``PyThreadState_SetAsyncExc`` (an exception raised in that thread at its next
  bytecode). That is best effort: a call stuck inside one long C function, or one that swallows
  the exception, keeps running in the background until it returns (a daemon thread, so the
  process can still exit).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import threading
from typing import Any, Callable, TypeVar

__all__ = ["RewardTimeout", "call_with_timeout"]

T = TypeVar("T")

_REFIRE_S = 0.05


class RewardTimeout(Exception):
    """Raised by ``call_with_timeout`` when the call did not finish within ``timeout_s``."""


class _Interrupt(BaseException):
    """Raised by the SIGALRM handler; a ``BaseException`` so ``except Exception`` won't eat it."""


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number or None, got {type(timeout_s).__name__}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive finite number of seconds or None, got {timeout_s}")


def _can_use_signal() -> bool:
    return (
        os.name == "posix"
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # don't clobber someone's timer
    )


def _call_with_signal(fn: Callable[..., T], timeout_s: float, args, kwargs) -> T:
    done = False

    def handler(signum, frame):
        if done:
            return
        signal.setitimer(signal.ITIMER_REAL, _REFIRE_S)  # fire again if the interrupt is swallowed
        raise _Interrupt()

    old_handler = signal.signal(signal.SIGALRM, handler)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return fn(*args, **kwargs)
        finally:
            done = True
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Interrupt:
        raise RewardTimeout(f"{getattr(fn, '__name__', fn)!s} did not finish within {timeout_s} s") from None
    finally:
        signal.signal(signal.SIGALRM, old_handler)


def _stop_thread(thread: threading.Thread) -> None:
    """Ask ``thread`` to stop by raising ``_Interrupt`` in it (CPython; best effort)."""
    if thread.ident is None:
        return
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    if set_async_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupt)) > 1:
        set_async_exc(ctypes.c_ulong(thread.ident), None)  # more than one thread hit: undo (never expected)


def _call_in_thread(fn: Callable[..., T], timeout_s: float, args, kwargs) -> T:
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="echotrain-reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        _stop_thread(worker)
        raise RewardTimeout(
            f"{getattr(fn, '__name__', fn)!s} did not finish within {timeout_s} s (worker thread told to stop)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_with_timeout(fn: Callable[..., T], *args: Any, timeout_s: float | None, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` and raise ``RewardTimeout`` if it takes over ``timeout_s``.

    Safe to call from any thread (see the module docstring for the two mechanisms).

    Args:
        fn: the function to call.
        *args, **kwargs: its arguments.
        timeout_s: time limit in seconds (wall clock); ``None`` calls ``fn`` directly, unbounded.

    Returns:
        What ``fn`` returns.

    Raises:
        RewardTimeout: ``fn`` did not return within ``timeout_s`` seconds.
        ValueError / TypeError: ``timeout_s`` is not a positive finite number or ``None``.
        Any exception ``fn`` raises, unchanged.
    """
    _check_timeout(timeout_s)
    if timeout_s is None:
        return fn(*args, **kwargs)
    if _can_use_signal():
        return _call_with_signal(fn, float(timeout_s), args, kwargs)
    return _call_in_thread(fn, float(timeout_s), args, kwargs)
