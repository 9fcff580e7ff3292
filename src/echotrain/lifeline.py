"""A child process that dies with its parent: the cells of ``echotrain compare`` (``echotrain
train`` subprocesses) must not outlive a driver killed with ``kill -9``, or a re-run resumes the
same cell beside the orphan (two writers in one run directory; issue 40 item 6).

Two guards, both set up by the parent through :func:`child_preexec` and :func:`child_env`:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` in the child between ``fork`` and ``exec`` (the
  kernel signals the child the moment the parent dies; ``prctl(2)``). The parent's pid is checked
  right after, so a parent that died before the call is caught too.
- Everywhere (the fallback where ``prctl`` does not exist, and a second guard where it does):
  ``$ECHOTRAIN_PARENT_PID`` names the parent; :func:`watch_parent`, called by ``echotrain``'s
  entry point, starts a daemon thread that sends SIGTERM to its own process once its parent is no
  longer that process (a dead parent's children are re-parented), checked every 0.5 s.

SIGTERM, not SIGKILL: the trainer installs no handler, so it ends at once either way, and a
handler added later may still clean up. A ground-floor module: it imports nothing from echotrain.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

#: environment variable: the pid of the process the child must not outlive
PARENT_ENV = "ECHOTRAIN_PARENT_PID"
#: prctl(2) option: the signal the calling process gets when its parent dies
PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), resolved in the parent: the child between fork and exec only calls
    it (no ``dlopen`` there). None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):  # pragma: no cover - a libc without prctl
        return None


def child_preexec(nice: int = 0, *, parent_death_signal: bool = True) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: in the child, before ``exec``, asks for
    SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``; ``parent_death_signal=False`` skips
    it, leaving the :func:`watch_parent` fallback), ends the child at once if the parent is already
    gone, then adds ``nice`` to its niceness. None when there is nothing to do.

    The parent is the calling *thread*'s process: Linux sends the signal when the thread that
    forked the child ends, so call Popen from a thread that lives as long as the child should."""
    prctl = _prctl() if parent_death_signal else None
    if prctl is None and not nice:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(128 + int(signal.SIGTERM))
        if nice:
            os.nice(nice)

    return preexec


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`PARENT_ENV` set to this process's pid (for :func:`watch_parent`)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def watch_parent(interval: float = 0.5) -> threading.Thread | None:
    """If ``$ECHOTRAIN_PARENT_PID`` is set: remove it from the environment (grandchildren do not
    inherit the watch), and start a daemon thread that sends SIGTERM to this process as soon as
    its parent is no longer that pid (at once if it already is not). Returns the thread, or None
    when the variable is unset or not a pid.

    Args:
        interval: seconds between two looks at ``os.getppid()``.
    """
    raw = os.environ.pop(PARENT_ENV, "")
    try:
        parent = int(raw)
    except ValueError:
        return None
    if parent <= 1:
        return None

    def watch() -> None:
        stop = threading.Event()
        while os.getppid() == parent:
            stop.wait(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="echotrain-parent-watch", daemon=True)
    thread.start()
    return thread
