"""Run a function in a separate process that is killed when it overruns its time limit.

In-process time limits (``call_with_timeout``) stop Python code between bytecodes. They cannot
stop a computation that stays inside one C call while holding the GIL -- sympy evaluating
``9^{9^{9^{9}}}`` spends minutes in CPython's big-integer power and would freeze every thread of
the trainer. ``call_isolated`` sends the call to a long-lived worker process and waits for the
answer with ``select``; on timeout the worker is killed (SIGKILL, which also frees any memory it
was filling) and a fresh one is started on the next call.

The worker is a fresh interpreter (``python -m echotrain.rewards._worker``) talking pickles over
its stdin/stdout: no ``fork`` of a multi-threaded trainer, and the user's ``__main__`` is never
re-imported (as ``multiprocessing``'s spawn/forkserver would do). It imports only this package
(no torch), math-verify on first use. Calls from several threads are serialised by a lock.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from echotrain.rewards.timeout import RewardTimeout, _check_timeout

__all__ = ["IsolatedWorker", "call_isolated"]

T = TypeVar("T")


def _serve() -> None:
    """Worker loop: read ``(fn, args, kwargs)`` pickles from stdin, write ``(ok, value)`` pickles."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # stray prints of the called code must not corrupt the protocol
    # Warm up before reporting ready: importing sympy/math-verify and their first parse take
    # about a second, which must not count against the first call's time limit.
    from echotrain.rewards.math import math_equal

    math_equal("1/2", "0.5")
    pickle.dump(("ready", None), out)
    out.flush()
    while True:
        try:
            fn, args, kwargs = pickle.load(inp)
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(*args, **kwargs))
            data = pickle.dumps(reply)
        except BaseException as exc:
            try:
                data = pickle.dumps((False, exc))
            except Exception:  # the exception itself does not pickle
                data = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
        out.write(data)
        out.flush()


class IsolatedWorker:
    """One killable worker process; see the module docstring.

    Args:
        start_timeout_s: how long to wait for a (re)started worker to report ready.

    Attributes:
        restarts: workers killed after a timeout or found dead.
    """

    def __init__(self, start_timeout_s: float = 120.0):
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _wait_readable(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return bool(ready)

    def _start(self) -> None:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the folder holding the echotrain package
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "echotrain.rewards._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        if not self._wait_readable(self.start_timeout_s):
            self._kill()
            raise RuntimeError(f"reward worker process did not start within {self.start_timeout_s} s")
        try:
            pickle.load(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self._kill()
            raise RuntimeError("reward worker process failed to start (see its stderr above)") from exc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self.restarts += 1
        self._proc = None

    def _exchange(self, request: bytes, fn, timeout_s: float) -> tuple[bool, Any]:
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise RuntimeError("reward worker process died") from exc
        if not self._wait_readable(timeout_s):
            raise RewardTimeout(
                f"{getattr(fn, '__name__', fn)!s} did not finish within {timeout_s} s (worker process killed)"
            )
        try:
            return pickle.load(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            raise RuntimeError("reward worker process died (out of memory?)") from exc

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the worker; ``fn``, arguments and result must pickle.

        Raises:
            RewardTimeout: no result within ``timeout_s`` seconds (the worker is killed).
            RuntimeError: the worker died (e.g. killed for memory) or could not start.
            pickle.PicklingError / AttributeError / TypeError: ``fn`` or an argument does not pickle.
            Any exception ``fn`` raised, re-raised here.
        """
        _check_timeout(timeout_s)
        request = pickle.dumps((fn, args, kwargs))  # fails here, before the worker is involved
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._kill()
                self._start()
            try:
                ok, value = self._exchange(request, fn, timeout_s)
            except BaseException:
                # Timed out, died, or interrupted mid-exchange (an async exception from an outer
                # time limit): a reply may still be in flight, so this worker cannot be reused.
                self._kill()
                raise
        if ok:
            return value
        raise value

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            if self._proc is not None:
                self._kill()
                self.restarts -= 1  # a requested stop is not a restart


_WORKER: IsolatedWorker | None = None
_WORKER_LOCK = threading.Lock()


def _shared_worker() -> IsolatedWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = IsolatedWorker()
            atexit.register(_WORKER.close)
        return _WORKER


def call_isolated(fn: Callable[..., T], *args: Any, timeout_s: float, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` in the shared killable worker process (thread-safe).

    Use it for work that may block inside C code (sympy big integers); ``fn`` must be a
    module-level function and its arguments and result must pickle. The first call starts the
    worker (about a second; not counted in ``timeout_s``), as does the first call after a kill.

    Raises:
        RewardTimeout: ``fn`` did not finish within ``timeout_s`` seconds (the worker was killed).
        RuntimeError: the worker died or could not start.
        ValueError: ``timeout_s`` not a positive finite number.
        Any exception ``fn`` raised.
    """
    return _shared_worker().call(fn, *args, timeout_s=timeout_s, **kwargs)

