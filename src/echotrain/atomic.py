"""Atomic file writes: a temporary file in the same folder, then ``os.replace`` onto the target.

A reader (or a killed process) never sees half a file: the target is either the old content or
the new. ``fsync=True`` also flushes the data to disk before the rename and the folder after it
(checkpoints), so a power loss cannot leave the renamed file empty or the rename undone. The temporary name is
``.<name>.tmp-<pid><suffix>`` (hidden, per process, and with the target's suffix, so tools that
pick a format by extension, e.g. matplotlib's ``savefig``, keep working); it is removed when
the write fails. This module imports nothing from echotrain.
"""

from __future__ import annotations

import contextlib
import json
import os
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
