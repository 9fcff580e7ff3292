"""Writing checkpoints and resuming from them: atomic writes, keep-last-k, and the RNG states
that make resume exact (reading checkpoint files is :mod:`echotrain.runtime.checkpoints`).

A checkpoint is one ``torch.save`` file ``<run>/checkpoints/step_<step, 8 digits>.pt`` holding the
model, optimizer and scheduler state dicts, every RNG state (python, numpy, torch CPU and CUDA),
the data position and the step. It is written to a temporary file in the same folder, flushed
to disk (``fsync``), renamed over the final name and the folder fsynced, so a run killed at any
moment (or a power loss) leaves either the old or the new checkpoint, never a torn one.

:class:`CheckpointWriter` (the trainer's, ``async_save``) does the writing in a background thread:
``save`` copies the states to CPU memory (:func:`cpu_snapshot`; 0.4-1.1 s for the 1.6 GB of the
default job on a 2-core CPU) and returns, and
training goes on while the copy is serialised, fsynced and renamed; one write at a time, and the
next ``save`` and ``wait`` join the one before and raise its error.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from echotrain.atomic import fsync_dir
from echotrain.runtime.checkpoints import latest_valid_checkpoint, list_checkpoints, load_checkpoint

logger = logging.getLogger("echotrain.train")


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


def checkpoint_state(step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     data_state: dict[str, Any], extra: dict[str, Any] | None = None,
                     model_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint file holds: ``step``, the ``model`` (or ``model_state``: e.g. LoRA, the
    adapter weights only), ``optimizer`` and ``scheduler`` state dicts, every RNG state now
    (:func:`rng_state`), ``data`` (``data_state``: the prompt stream position) and ``extra``
    (trainer data, e.g. ``world_size`` and every data-parallel rank's RNG states). The tensors are
    the live ones (state dicts share storage with the parameters): :func:`cpu_snapshot` them
    before training goes on."""
    return {
        "step": step,
        "model": model.state_dict() if model_state is None else model_state,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        "data": dict(data_state),
        "extra": dict(extra or {}),
    }


def _view_key(x: torch.Tensor) -> tuple:
    """What makes two tensors the same view: device, storage, offset, shape, strides, dtype."""
    return (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)


def cpu_snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that later in-place updates of its tensors cannot change: dicts, lists
    and tuples rebuilt, every tensor copied to CPU memory (detached, same dtype, shape and
    strides), other leaves deep-copied (a dict keeps its type and attributes, e.g. the
    ``_metadata`` of a state dict). Tensors that are the same view of one storage (tied
    weights: a model's embedding and LM head) stay one tensor, so ``torch.save`` still writes
    them once."""
    memo: dict[tuple, torch.Tensor] = {}

    def snap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = _view_key(x) if x.numel() else None
            if key is not None and key in memo:
                return memo[key]
            out = x.detach().to("cpu", copy=True)
            if key is not None:
                memo[key] = out
            return out
        if isinstance(x, dict):
            out = copy.copy(x)  # the same type, its attributes kept (a state dict's ``_metadata``)
            for k, v in x.items():
                out[k] = snap(v)
            for name, value in list(getattr(out, "__dict__", {}).items()):
                setattr(out, name, copy.deepcopy(value))
            return out
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(snap(v) for v in x)
        return copy.deepcopy(x)

    return snap(obj)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists and tuples searched; a storage shared by
    several views counted once): what :func:`cpu_snapshot` of it allocates."""
    seen: set[tuple] = set()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = _view_key(x)
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return total


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux ``MemAvailable`` of
    /proc/meminfo), or None where that is not known."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def write_checkpoint(state: dict[str, Any], run_dir: str | os.PathLike, keep_last: int = 1) -> Path:
    """Write ``state`` (:func:`checkpoint_state`) as ``<run_dir>/checkpoints/step_<state["step"]>.pt``
    atomically (:func:`atomic_torch_save`), then delete all but the last ``keep_last``.

    Returns:
        The checkpoint path.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    _check_keep_last(keep_last)
    path = checkpoint_path(run_dir, int(state["step"]))
    atomic_torch_save(state, path)
    removed = False
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
        removed = True
    if removed:
        fsync_dir(path.parent)
    return path


def _check_keep_last(keep_last: int) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step, 8 digits>.pt``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}.pt"


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, data_state: dict[str, Any], keep_last: int = 1,
                    extra: dict[str, Any] | None = None, model_state: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` now, atomically, then delete all but the last ``keep_last``
    (:func:`checkpoint_state` says what it holds; :class:`CheckpointWriter` writes in the background).

    Returns:
        The checkpoint path.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    state = checkpoint_state(step, model=model, optimizer=optimizer, scheduler=scheduler, data_state=data_state,
                             extra=extra, model_state=model_state)
    return write_checkpoint(state, run_dir, keep_last)


#: the largest share of the available memory a background checkpoint's CPU copy may take
MAX_COPY_SHARE = 0.5


class CheckpointWriter:
    """Writes checkpoints, in a background thread when ``background`` (the ``async_save`` setting).

    :meth:`save` builds the checkpoint's state (:func:`checkpoint_state`; RNG states of this
    moment) and, in the background mode, copies it to CPU memory (:func:`cpu_snapshot`: memory of
    the checkpoint's size while the write lasts) and starts a thread that runs
    :func:`write_checkpoint` (``torch.save``, fsync, rename, keep-last-k), then returns; training
    goes on meanwhile. At most one write runs: :meth:`save` first waits for the one before. When
    the copy would take more than :data:`MAX_COPY_SHARE` of the available memory (a large model on
    a small host), the writer warns once and writes within the step from then on.
    :meth:`wait` blocks until the write in flight is done; the trainer calls it before a run ends
    (also when it fails), so a run that raises still finishes the checkpoint it started. The thread
    is not a daemon: the interpreter waits for it at exit. A write that fails raises from the next
    :meth:`save` or :meth:`wait` (``RuntimeError`` naming the file, the write's error as its cause);
    the file is then the old checkpoint or absent, never torn (atomic writes).
    """

    def __init__(self, background: bool = True):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None

    @property
    def pending(self) -> Path | None:
        """The path being written in the background, or None."""
        return self._path if self._thread is not None and self._thread.is_alive() else None

    def save(self, run_dir: str | os.PathLike, step: int, *, keep_last: int = 1, **state_args: Any) -> Path:
        """Checkpoint ``step`` (keyword arguments of :func:`checkpoint_state`); returns its path,
        which holds the file once :meth:`wait` returns (at once when not ``background``).

        Raises:
            ValueError: ``keep_last < 1``.
            RuntimeError: the previous background write failed.
        """
        _check_keep_last(keep_last)  # here, not in the thread: the caller gets the error
        self.wait()
        state = checkpoint_state(step, **state_args)
        if not self.background or not self._copy_fits(state):
            return write_checkpoint(state, run_dir, keep_last)
        state = cpu_snapshot(state)
        path = checkpoint_path(run_dir, step)

        def write() -> None:
            try:
                write_checkpoint(state, run_dir, keep_last)
            except BaseException as err:  # handed to the training thread by wait()
                self._error = err

        self._path, self._error = path, None
        self._thread = threading.Thread(target=write, name=f"echotrain-checkpoint-{step}", daemon=False)
        self._thread.start()
        return path

    def _copy_fits(self, state: dict[str, Any]) -> bool:
        """Whether the CPU copy of ``state`` takes at most half of the available memory
        (:func:`available_memory`; unknown: yes). If not, this and later checkpoints are written
        within the step (``self.background`` turns False) and a warning says so once."""
        need, avail = tensor_bytes(state), available_memory()
        if avail is None or need <= avail * MAX_COPY_SHARE:
            return True
        logger.warning("async_save: a checkpoint's CPU copy (%.1f GB) would take more than half of the available "
                       "memory (%.1f GB); checkpoints of this run are written within the step", need / 1e9, avail / 1e9)
        self.background = False
        return False

    def wait(self) -> None:
        """Block until the write in flight (if any) is done.

        Raises:
            RuntimeError: that write failed (its exception is the cause).
        """
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"writing checkpoint {self._path} failed: {error}") from error


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


@dataclass(frozen=True)
class Resumed:
    """Where :func:`resume_from` continued a run: the checkpoint file, its step, and the steps
    logged after it that were dropped (recomputed by the resumed run), per file."""

    checkpoint: Path
    step: int
    dropped: dict[str, list[int]] = field(default_factory=dict)  #: file name -> dropped steps (rank 0)

    def describe(self) -> str:
        """One line for the startup output: ``resumed from <file> (step s); dropped steps a-b
        logged after it from metrics.jsonl (and samples.jsonl, eval.jsonl): they are run again``."""
        text = f"resumed from {self.checkpoint} (step {self.step})"
        steps = self.dropped.get("metrics.jsonl") or sorted({s for v in self.dropped.values() for s in v})
        if not steps:
            return text + "; nothing was logged after it"
        span = f"step {steps[0]}" if len(steps) == 1 else (
            f"steps {steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else
            "steps " + ", ".join(map(str, steps)))
        return f"{text}; dropped {span} logged after it from {', '.join(self.dropped)}: they are run again"


def resume_from(run_dir: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any, data: Any, dist: Any,
                extra_state: Callable[[dict[str, Any]], None] | None = None) -> Resumed:
    """Restore a run from the latest valid checkpoint in ``run_dir``: model (or LoRA adapters),
    optimizer, scheduler, ``data`` (``load_state_dict``: the prompt stream position) and this
    rank's RNG state; the file is read into host memory (a CUDA run included) and each tensor
    moved by ``load_state_dict`` to its parameter's device. Rank 0 then drops the metrics / samples / eval lines after it (they are
    recomputed). ``dist``: the run's :class:`echotrain.train.dist.DistContext`;
    ``extra_state(extra)`` restores the trainer's own part of the checkpoint (``extra``, e.g. the
    rollout queue of ``staleness > 0``) and may raise to refuse it.

    Returns:
        :class:`Resumed`: the checkpoint, its step and the dropped steps of each file (on rank 0;
        empty on the others).

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
    # read into host memory whatever the run's device: the RNG states must stay CPU byte tensors
    # (torch.set_rng_state and torch.cuda.set_rng_state_all refuse others), and load_state_dict
    # moves the model's and the optimizer's tensors to their parameters' devices
    state = load_checkpoint(path, map_location="cpu")
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
    dropped: dict[str, list[int]] = {}
    if dist.is_main:
        for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
            steps = truncate_jsonl(run_dir / name, step)
            if steps:
                dropped[name] = steps
    return Resumed(checkpoint=path, step=step, dropped=dropped)
