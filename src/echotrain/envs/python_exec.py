"""A Python-execution tool: the model's code runs in a fresh, limited subprocess.

:func:`run_python` starts ``python -I -S -c <code>`` (isolated mode, no site packages beyond the
standard library's) with

* a wall-clock limit (the process group is killed at ``timeout_s``) and a CPU-time limit
  (``RLIMIT_CPU``, the same seconds rounded up),
* a memory limit (``RLIMIT_AS``, ``memory_mb``) and no core files,
* no network: a new user + network namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` through
  libc: only a loopback device that is down), and, where the kernel refuses namespaces, the
  ``socket`` module's constructors replaced by a function that raises (best effort; documented in
  docs/design/environments.md),
* stdout + stderr read up to ``max_output_bytes``; a process that writes more is killed and the
  call is an error (10 MB of prints end in milliseconds, never fill the trainer's memory).

Every failure is a message the model reads as the tool's output (``ToolResult.error=True``); the
trainer's process is never at risk: the code runs in another process, so a hang inside one C
call (``9**9**9**9``) is killed like any other.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import select
import signal
import subprocess
import sys
import time

__all__ = ["PYTHON_TOOL_LIMITS", "run_python", "python"]

#: Defaults of :func:`run_python` (seconds, MiB, bytes).
PYTHON_TOOL_LIMITS = {"timeout_s": 5.0, "memory_mb": 512, "max_output_bytes": 4096}

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_NO_SOCKETS = ("import socket as _s\n"
               "def _no_net(*a, **k):\n    raise OSError('network access is disabled in this tool')\n"
               "_s.socket = _s.create_connection = _s.socketpair = _no_net\ndel _s, _no_net\n")


class PythonToolError(Exception):
    """The code failed, overran a limit or printed too much (the message says which)."""


def _limits(timeout_s: float, memory_mb: int) -> None:
    """preexec_fn: own process group, rlimits, and a network namespace where the kernel allows."""
    os.setsid()
    cpu = int(math.ceil(timeout_s)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    mem = int(memory_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    except Exception:  # no libc symbol: the socket guard still applies
        pass


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 4096) -> str:
    """Run ``code`` in a limited subprocess and return what it printed (stdout, then stderr).

    Args:
        code: Python source.
        timeout_s: wall-clock limit in seconds.
        memory_mb: address-space limit of the process in MiB.
        max_output_bytes: the most bytes of stdout + stderr read back.

    Returns:
        The printed text (UTF-8, errors replaced).

    Raises:
        PythonToolError: a non-zero exit (the message ends with the traceback's last lines), the
            time limit, or more than ``max_output_bytes`` of output.
    """
    cmd = [sys.executable, "-I", "-S", "-c", _NO_SOCKETS + code]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: _limits(timeout_s, memory_mb), close_fds=True)
    buf = bytearray()
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    why = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"did not finish within {timeout_s} s"
                break
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > max_output_bytes:
                why = f"printed more than {max_output_bytes} bytes"
                break
    finally:
        if why is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()
        rc = proc.wait()
    if why is not None:
        raise PythonToolError(why)
    text = bytes(buf).decode("utf-8", "replace")
    if rc != 0:
        tail = "\n".join(text.strip().splitlines()[-3:])
        raise PythonToolError(f"exit status {rc}" + (f": {tail}" if tail else
                                                      " (killed: a resource limit, e.g. memory or CPU time)"))
    return text


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, 5 s, 512 MiB) and return what it printed.

    Args:
        code: Python source; print the values you need.
    """
    return run_python(code, **PYTHON_TOOL_LIMITS)
