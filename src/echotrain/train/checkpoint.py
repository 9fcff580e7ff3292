"""Writing checkpoints and resuming from them: atomic writes, keep-last-k, and the RNG states
that make resume exact (reading checkpoint files is :mod:`echotrain.runtime.checkpoints`).

A checkpoint is one ``torch.save`` file ``<run>/checkpoints/step_<step, 8 digits>.pt`` holding the
model, optimizer and scheduler state dicts, every RNG state (python, numpy, torch CPU and CUDA),
the data position and the step. It is written to a temporary file in the same folder, flushed
to disk (``fsync``), renamed over the final name and the folder fsynced, so a run killed at any
moment (or a power loss) leaves either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from echotrain.atomic import fsync_dir
from echotrain.runtime.checkpoints import latest_valid_checkpoint, list_checkpoints, load_checkpoint


def rng_state() -> dict[str, Any]:
    """The states of python's, numpy's and torch's (CPU and all CUDA devices) global RNGs."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states returned by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temp file in the same folder, fsync it, ``os.replace`` it onto
    ``path``, then fsync the folder (:func:`echotrain.atomic.fsync_dir`): after a crash at any
    moment ``path`` is the old file or the complete new one, and once this returns the new one is
    on disk."""
    from echotrain.atomic import atomic_path

    with atomic_path(path, fsync=True) as tmp:
        torch.save(obj, tmp)


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, data_state: dict[str, Any], keep_last: int = 1,
                    extra: dict[str, Any] | None = None, model_state: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the last ``keep_last``.

    ``model_state`` replaces ``model.state_dict()`` (e.g. LoRA: the adapter weights only);
    ``extra`` holds trainer data (e.g. ``world_size`` and every data-parallel rank's RNG states).

    Returns:
        The checkpoint path.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    path = Path(run_dir) / "checkpoints" / f"step_{step:08d}.pt"
    state = {
        "step": step,
        "model": model.state_dict() if model_state is None else model_state,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        "data": dict(data_state),
        "extra": dict(extra or {}),
    }
    atomic_torch_save(state, path)
    removed = False
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
        removed = True
    if removed:
        fsync_dir(path.parent)
    return path


def restart_schedule(scheduler: Any, saved: dict[str, Any]) -> None:
    """Continue ``scheduler`` (a ``LambdaLR`` built for *this* run: its multiplier functions and
    peak LRs come from the resumed config, e.g. a larger ``steps``) from a checkpoint's scheduler
    state ``saved``: only the count of optimizer steps taken (``last_epoch``) is taken from the
    checkpoint. Each parameter group's ``lr`` is then set to ``base_lr * lr_lambda(last_epoch)``
    of the new schedule, so the first resumed update already uses it, not the LR the optimizer
    state stored (with cosine over the old ``steps`` that is 0 at the end of a finished run).

    A scheduler that is not a ``LambdaLR`` is restored as saved (``load_state_dict``).
    """
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.load_state_dict(saved)
        return
    scheduler.last_epoch = int(saved["last_epoch"])
    groups = scheduler.optimizer.param_groups
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() returns, as after a step()


def resume_from(run_dir: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any, data: Any, dist: Any, device: torch.device,
                extra_state: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Restore a run from the latest valid checkpoint in ``run_dir``: model (or LoRA adapters),
    optimizer, scheduler, ``data`` (``load_state_dict``: the prompt stream position) and this
    rank's RNG state. Rank 0 then drops the metrics / samples / eval lines after it (they are
    recomputed). ``dist``: the run's :class:`echotrain.train.dist.DistContext`;
    ``extra_state(extra)`` restores the trainer's own part of the checkpoint (``extra``, e.g. the
    rollout queue of ``staleness > 0``) and may raise to refuse it.

    Returns:
        the checkpoint's step.

    Raises:
        FileNotFoundError: no readable checkpoint (names the damaged ones).
        echotrain.train.dist.WorldSizeMismatch: written by another number of processes.
    """
    from echotrain.train.dist import WorldSizeMismatch
    from echotrain.runtime.lora import load_model_state
    from echotrain.train.metrics import truncate_jsonl

    run_dir = Path(run_dir)
    path, damaged = latest_valid_checkpoint(run_dir)
    if path is None:
        extra = f"; damaged: {', '.join(map(str, damaged))}" if damaged else ""
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}{extra}")
    state = load_checkpoint(path, map_location=device)
    saved_world = int(state.get("extra", {}).get("world_size", 1))
    if saved_world != dist.world_size:
        raise WorldSizeMismatch(
            f"--resume: {path} was written by a run of {saved_world} process(es) and this run has "
            f"{dist.world_size}; resume with the same number (torchrun --nproc_per_node {saved_world}): "
            "each rank's RNG stream is part of the checkpoint, so another world size cannot continue it exactly")
    load_model_state(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if state.get("scheduler") is not None:
        restart_schedule(scheduler, state["scheduler"])
    data.load_state_dict(state["data"])
    if extra_state is not None:
        extra_state(state.get("extra", {}))
    rngs = state.get("extra", {}).get("rng_ranks")
    set_rng_state(rngs[dist.rank] if rngs else state["rng"])
    step = int(state["step"])
    if dist.is_main:
        for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
            truncate_jsonl(run_dir / name, step)
    return step
