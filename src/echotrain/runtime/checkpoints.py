"""Reading checkpoint files: find a run's checkpoints, check they are complete, load one.

A checkpoint is one ``torch.save`` file ``<run>/checkpoints/step_<step, 8 digits>.pt`` (written
atomically by :func:`echotrain.train.checkpoint.save_checkpoint`). Training reads it to resume,
evaluation to load a policy, preflight to check a ``--resume`` or ``--model`` path; all of them
read it through these functions.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "checkpoint_step", "is_readable_checkpoint", "latest_checkpoint",
           "latest_valid_checkpoint", "list_checkpoints", "load_checkpoint"]


_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read (truncated, corrupted); the message names the file."""


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint file of a run, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint file written by :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is damaged (names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} not found")
    # our own files: they hold numpy RNG state and python tuples, so not weights_only
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged (truncated or not a torch archive): {exc}") from exc


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step in a checkpoint file name ``step_<step, 8 digits>.pt``.

    Raises:
        ValueError: the name does not follow that pattern.
    """
    m = _NAME.match(Path(path).name)
    if not m:
        raise ValueError(f"{str(path)!r} is not a checkpoint file name (step_<step, 8 digits>.pt)")
    return int(m.group(1))


def is_readable_checkpoint(path: str | os.PathLike) -> bool:
    """Cheap integrity check: ``path`` is a complete zip archive (what ``torch.save`` writes).

    A truncated file loses the zip central directory at its end, so this catches it without
    reading the tensors.
    """
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            return bool(zf.namelist())
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def latest_valid_checkpoint(run_dir: str | os.PathLike) -> tuple[Path | None, list[Path]]:
    """``(newest readable checkpoint or None, damaged files newer than it)``, newest first."""
    damaged: list[Path] = []
    for p in reversed(list_checkpoints(run_dir)):
        if is_readable_checkpoint(p):
            return p, damaged
        damaged.append(p)
    return None, damaged
