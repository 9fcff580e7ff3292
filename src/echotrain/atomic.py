"""Atomic file writes: a temporary file in the same folder, then ``os.replace`` onto the target.

A reader (or a killed process) never sees half a file: the target is either the old content or
the new. ``fsync=True`` also flushes the data to disk before the rename and the folder after it
(checkpoints), so a power loss cannot leave the renamed file empty or the rename undone. The temporary name is
``.<name>.tmp-<pid><suffix>`` (hidden, per process, and with the target's suffix, so tools that
pick a format by extension, e.g. matplotlib's ``savefig``, keep working); it is removed when
the write fails. :func:`replace_dir` swaps a whole folder the same way. This module imports nothing
from echotrain.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator


def fsync_dir(folder: str | os.PathLike) -> None:
    """``fsync`` a directory, so the entries renamed or removed in it survive a power loss (POSIX:
    a rename is durable only once its directory is synced). A no-op where directories cannot be
    opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """Context manager yielding the temporary path to write; on a clean exit it is (optionally
    fsynced and) renamed onto ``path``, on an exception removed. The parent folder is created.

    Raises:
        OSError: the folder cannot be created or the rename fails (the temporary file is removed).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}{target.suffix}")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
        if fsync:
            fsync_dir(target.parent)  # the rename itself is durable only once its folder is synced
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, fsync: bool = False) -> None:
    """Write ``obj`` as JSON (``indent``, a trailing newline) to ``path`` atomically.

    Raises:
        TypeError: ``obj`` is not JSON-serialisable (nothing is written).
    """
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n", fsync=fsync)


#: renameat2(2) flag: exchange the two paths atomically (Linux >= 3.15, glibc >= 2.28)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths (files or folders) in one atomic step: Linux ``renameat2`` with
    ``RENAME_EXCHANGE`` through ctypes. Returns False, changing nothing, where that is unavailable
    (another OS, an old glibc or kernel, a filesystem without it).

    Raises:
        OSError: the exchange was attempted and failed for another reason (a missing path,
            permissions).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc < 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move the complete folder ``src`` onto ``dst`` (same filesystem), replacing a folder there.

    Where :func:`exchange_paths` works (Linux) ``dst`` is never absent: the two folders are
    exchanged in one step and the old one (now at ``src``) is removed afterwards. Elsewhere the
    old folder is renamed aside (``.<name>.old-<pid>``), ``src`` renamed into place and the old
    one removed: ``dst`` is absent only between the two renames (never during a removal), and
    put back if the second rename fails. Unlike ``rmtree(dst)`` + ``os.replace``, a concurrent
    reader or a kill never meets a half-deleted folder.

    Raises:
        OSError: ``src`` is missing, or a rename fails (``dst`` then holds its old content).
    """
    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.rename(src, dst)
        return
    if exchange_paths(src, dst):
        shutil.rmtree(src, ignore_errors=True)  # the old folder, now at src
        return
    aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(dst, aside)
    try:
        os.rename(src, dst)
    except OSError:
        os.rename(aside, dst)
        raise
    shutil.rmtree(aside, ignore_errors=True)
