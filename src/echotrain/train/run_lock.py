"""One writer per run directory: the training process holds an exclusive lock on
``<run_dir>/.echotrain.lock`` (``fcntl.flock``, non-blocking) from the moment it knows its run
directory until ``Trainer.train`` returns. A second ``echotrain train`` (or ``--resume``, or an
``echotrain compare`` cell) on the same directory is refused with the pid of the holder instead
of interleaving its metrics lines and checkpoints with the first (issue 40 item 6: a compare cell
orphaned by ``kill -9`` of its driver and the same cell resumed beside it).

The lock is the kernel's: it ends with the process however that ends (a crash, ``kill -9``), so a
stale lock file never blocks anything. The file holds the holder's pid (written after the lock
is taken; a reader may find it empty for an instant: pid unknown). It is left in place on
release (removing a lock file races with the next locker). Within one process the lock is
re-entrant (a second ``Trainer`` on the same directory in the same process, as tests build).
Where ``fcntl`` does not exist (Windows) or the filesystem has no locks, nothing is locked.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from echotrain.errors import ConfigError

#: the lock file's name inside a run directory
LOCK_FILE = ".echotrain.lock"
#: realpath of a run directory -> [open lock file, holders in this process]
_HELD: dict[str, list[Any]] = {}


class RunDirBusy(ConfigError):
    """Another process holds the run directory's lock (the CLI: one line, exit 2).

    Attributes:
        run_dir: the run directory; ``pid``: the holder's pid (0: not yet written).
    """

    def __init__(self, run_dir: str | os.PathLike, pid: int, key: str = "output_dir"):
        self.run_dir, self.pid = Path(run_dir), pid
        who = f"pid {pid}" if pid else "pid not yet written"
        stop = f"stop it (kill {pid})" if pid else "stop it"
        super().__init__(f"{key}={str(run_dir)!r} is being written by another process ({who}, lock "
                         f"{self.run_dir / LOCK_FILE}); two writers would interleave its metrics and "
                         f"checkpoints: wait for it, {stop}, or choose another output_dir")


def _key(run_dir: str | os.PathLike) -> str:
    return os.path.realpath(run_dir)


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _busy(exc: OSError) -> bool:
    return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def lock_holder(run_dir: str | os.PathLike) -> int | None:
    """The pid of the process writing ``run_dir`` (this process's own when it holds the lock; 0
    when the holder has not written its pid yet), or None when no process holds its lock."""
    if _key(run_dir) in _HELD:
        return os.getpid()
    path = Path(run_dir) / LOCK_FILE
    try:
        import fcntl

        fh = open(path, "rb")
    except (ImportError, OSError):  # no fcntl, or no lock file: nobody has locked it
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            return _read_pid(path) if _busy(exc) else None
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


class RunLock:
    """This process's hold on a run directory (:func:`lock_run_dir`); :meth:`release` once."""

    def __init__(self, key: str | None):
        self._key = key

    def release(self) -> None:
        """Give the hold back; the last holder in this process unlocks and closes the file."""
        key, self._key = self._key, None
        if key is None or key not in _HELD:
            return
        _HELD[key][1] -= 1
        if _HELD[key][1] <= 0:
            _HELD.pop(key)[0].close()  # closing the file drops the flock

    @property
    def held(self) -> bool:
        """Whether this hold is still in force."""
        return self._key is not None


def lock_run_dir(run_dir: str | os.PathLike, key: str = "output_dir") -> RunLock:
    """Create ``run_dir`` if needed and take its lock for this process (re-entrant within it),
    writing this pid into the lock file.

    Raises:
        RunDirBusy: another process holds the lock (the message names the directory, the
            holder's pid and the lock file).
        OSError: the directory or the lock file cannot be created.
    """
    k = _key(run_dir)
    if k in _HELD:
        _HELD[k][1] += 1
        return RunLock(k)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        return RunLock(None)
    path = Path(run_dir) / LOCK_FILE
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        fh.close()
        if _busy(exc):
            raise RunDirBusy(run_dir, _read_pid(path), key) from None
        return RunLock(None)  # a filesystem without locks (ENOLCK): run unlocked, as before
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    _HELD[k] = [fh, 1]
    return RunLock(k)
