"""Running the cells of a comparison: each cell is an ordinary ``echotrain train`` run directory.

Cell states (:func:`cell_status`), decided from the run directory alone, so any scheduler (this
runner, a Slurm array calling ``echotrain compare FILE --cell I``, several machines sharing the
folder) can run cells and a re-invocation picks up where it stopped:

- ``done``     ``stability.json`` is written (the trainer's last act) and ``metrics.jsonl``
               reaches the configured ``steps``: skipped.
- ``resume``   a checkpoint exists but the run did not finish (killed): ``echotrain train
               --resume DIR`` continues exactly from it (model, optimizer, RNG, data position).
- ``new``      no checkpoint: partial logs are removed and the run starts from ``config.yaml``.

A cell whose saved ``config.yaml`` differs from the comparison's (other than ``steps`` and the
output keys) is an error: delete it or use another ``output_dir``.

Cells run as subprocesses (``python -m echotrain.cli train ...``), ``jobs`` at a time, with
``OMP_NUM_THREADS`` etc. set to the cell's ``num_threads`` and an optional ``nice`` increment;
each writes ``train.log`` in its run directory.

One writer per cell: a cell dies with the driver that started it (:mod:`echotrain.lifeline`:
Linux's parent-death signal, else a watcher thread in the cell), so ``kill -9`` of ``echotrain
compare`` leaves no orphan; and the training process holds its run directory's lock
(:mod:`echotrain.train.run_lock`), so a cell that another process is writing (an orphan of an
older driver, a hand-started ``echotrain train --resume``) is refused with that process's pid
before anything in its directory changes (:class:`CellBusy`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from echotrain.compare.config import Cell, CompareSpec
from echotrain.errors import ConfigError
from echotrain.lifeline import child_env, child_preexec
from echotrain.runtime.checkpoints import latest_checkpoint
from echotrain.train.config import save_config
from echotrain.train.metrics import read_jsonl
from echotrain.train.run_lock import LOCK_FILE, lock_holder

#: keys that may differ between a cell's saved config and the comparison's without it being a different run
_MUTABLE_KEYS = ("steps", "output_dir", "progress", "num_threads", "plots", "tensorboard", "wandb", "wandb_project",
                 "device")
_PARTIAL_FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "stability.json")


def cell_status(cell: Cell) -> str:
    """``done``, ``resume`` or ``new`` (see the module docstring)."""
    d = cell.run_dir
    records = read_jsonl(d / "metrics.jsonl")
    last = records[-1]["step"] if records else 0
    if (d / "stability.json").is_file() and last >= cell.config.steps:
        return "done"
    if latest_checkpoint(d) is not None:
        return "resume"
    return "new"


def check_cell_config(cell: Cell) -> None:
    """Raise ``ValueError`` if the cell's run directory holds a run of another configuration."""
    saved_path = cell.run_dir / "config.yaml"
    if not saved_path.is_file() or latest_checkpoint(cell.run_dir) is None:
        return
    saved = yaml.safe_load(saved_path.read_text()) or {}
    want = cell.config.to_dict()
    diff = sorted(k for k in want if k not in _MUTABLE_KEYS and saved.get(k, want[k]) != want[k])
    if diff:
        raise ValueError(f"cell {cell.name}: {cell.run_dir} holds a run with other values of {diff} "
                         f"(e.g. {diff[0]}: saved {saved.get(diff[0])!r}, now {want[diff[0]]!r}); "
                         "delete that directory or use another output_dir")


def cell_command(cell: Cell, status: str, python: str | None = None) -> list[str]:
    """The ``echotrain train`` command that runs (``new``) or resumes (``resume``) the cell."""
    exe = [python or sys.executable, "-m", "echotrain.cli", "train"]
    if status == "resume":
        return exe + ["--resume", str(cell.run_dir), f"steps={cell.config.steps}"]
    return exe + ["--config", str(cell.run_dir / "config.yaml")]


class CellBusy(ConfigError):
    """A cell's run directory is being written by another process (it holds the run lock)."""


def check_cell_free(cell: Cell) -> None:
    """Raise :class:`CellBusy` when another process holds the cell's run directory lock
    (:mod:`echotrain.train.run_lock`): the message names the cell, the holder's pid and the lock."""
    pid = lock_holder(cell.run_dir)
    if pid is not None:
        who = f"process {pid}" if pid else "another process (pid not yet written)"
        raise CellBusy(f"cell {cell.name}: {cell.run_dir} is being written by {who} (lock "
                       f"{cell.run_dir / LOCK_FILE}); a second writer would interleave its metrics and "
                       f"checkpoints: wait for it or stop it{f' (kill {pid})' if pid else ''}, then re-run")


def prepare_cell(cell: Cell) -> str:
    """Check the cell (another run's config, another writer), write its ``config.yaml`` and
    ``cell.json``, clean partial logs of a ``new`` cell; return its status (a ``new`` cell whose
    earlier run logged steps but wrote no checkpoint: ``"new: ..."`` saying where it stopped).

    Raises:
        ValueError: the run directory holds a run of another configuration.
        CellBusy: another process is writing the run directory (nothing is changed).
    """
    check_cell_config(cell)
    check_cell_free(cell)
    status = cell_status(cell)
    if status == "done":
        return status
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    if status == "new":
        partial = read_jsonl(cell.run_dir / "metrics.jsonl")
        if partial:  # killed before its first checkpoint: its steps are lost, say so (was silent)
            status = f"new: the earlier run stopped at step {partial[-1]['step']} before its first checkpoint, restarting from step 1"
        for name in _PARTIAL_FILES:
            (cell.run_dir / name).unlink(missing_ok=True)
        save_config(cell.config, cell.run_dir / "config.yaml")
    info = {"arm": cell.arm, "base_arm": cell.base_arm, "seed": cell.seed, "sweep": cell.sweep}
    old = json.loads((cell.run_dir / "cell.json").read_text()) if (cell.run_dir / "cell.json").is_file() else {}
    commit = source_commit()
    # every commit that ran part of the cell, in order (a resume by another commit adds one)
    info["commits"] = list(dict.fromkeys((old.get("commits") or [] if status == "resume" else [])
                                         + ([commit] if commit else [])))
    (cell.run_dir / "cell.json").write_text(json.dumps(info, indent=2) + "\n")
    return status


def source_commit() -> str | None:
    """The git commit of the echotrain source that runs the cells (``git rev-parse --short=12 HEAD``
    in its folder), with ``+dirty`` when tracked files differ from it; None outside a git checkout
    (an installed wheel) or without git. The report compares it across the cells of a pair."""
    src = Path(__file__).resolve().parents[1]  # the echotrain package: its files decide "+dirty"
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def _env(threads: int) -> dict[str, str]:
    """The cell's environment: thread counts, this echotrain first on ``PYTHONPATH``, and the
    driver's pid for the cell's parent watch (:func:`echotrain.lifeline.watch_parent`)."""
    env = child_env(dict(os.environ))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    src = str(Path(__file__).resolve().parents[2])  # the echotrain being run, for the children
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _preexec(nice: int):
    """The cells' ``preexec_fn``: die with this process (Linux ``PR_SET_PDEATHSIG``), then ``nice``."""
    return child_preexec(nice)


def suite_available() -> bool:
    """Whether ``echotrain eval`` has a ``--suite`` option (the eval-suite module is installed)."""
    import importlib.util

    return importlib.util.find_spec("echotrain.evalsuite.cli") is not None


def suite_command(cell: Cell, suite: dict[str, Any], python: str | None = None) -> list[str]:
    """``echotrain eval --suite NAME --model RUN_DIR [args...]`` for a finished cell."""
    args = suite.get("args") or []
    if not isinstance(args, list):
        raise ValueError("suite.args must be a list of command-line arguments")
    return [python or sys.executable, "-m", "echotrain.cli", "eval", "--suite", str(suite.get("name", "math")),
            "--model", str(cell.run_dir), *map(str, args)]


def run_suite(cell: Cell, suite: dict[str, Any] | None, nice: int = 0) -> str:
    """The optional end-of-cell suite evaluation; a no-op (returns why) when not configured,
    already done, or when ``echotrain eval --suite`` does not exist in this install."""
    if not suite:
        return "not configured"
    marker = cell.run_dir / "suite" / "done"
    if marker.is_file():
        return "done before"
    if not suite_available():
        return "skipped: echotrain eval has no --suite in this install"
    out = cell.run_dir / "suite"
    out.mkdir(exist_ok=True)
    threads = int(cell.config.num_threads or 1)
    with open(out / "stdout.txt", "w") as fh:
        rc = subprocess.call(suite_command(cell, suite), stdout=fh, stderr=subprocess.STDOUT, env=_env(threads),
                             preexec_fn=_preexec(nice))
    if rc == 0:
        marker.write_text("ok\n")
    return f"exit {rc}"


def write_plan(spec: CompareSpec, cells: Sequence[Cell]) -> Path:
    """``<output_dir>/compare.yaml`` (the comparison as run, verdict rule included) and
    ``commands.sh`` (one ``echotrain train`` line per cell, for other schedulers)."""
    out = spec.output_dir
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(spec.raw)
    raw.update(name=spec.name, output_dir=str(spec.output_dir), seeds=spec.seeds, baseline=spec.baseline,
               arms=spec.arms, verdict=spec.verdict, report=spec.report)
    raw.pop("confirm_seeds", None)
    raw.pop("dropped_verdicts", None)
    raw.pop("overridden", None)
    if spec.overridden():
        raw["overridden"] = spec.overridden()
    if spec.confirm_seeds:
        raw["confirm_seeds"] = spec.confirm_seeds
    if spec.dropped_verdicts:
        raw["dropped_verdicts"] = spec.dropped_verdicts
    if spec.sweep:
        raw["sweep"] = spec.sweep
    if spec.overrides:
        raw["base"] = {**spec.base, **spec.overrides}
    (out / "compare.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    lines = ["#!/bin/sh", "# one line per cell; each is an ordinary echotrain train run (resume with --resume DIR)"]
    for i, c in enumerate(cells):
        lines.append(f"# [{i}] {c.arm} seed {c.seed}")
        lines.append(f"echotrain train --config {c.run_dir / 'config.yaml'}")
    (out / "commands.sh").write_text("\n".join(lines) + "\n")
    return out / "compare.yaml"


class ComparisonBusy(RuntimeError):
    """Another ``echotrain compare`` holds the comparison directory's lock."""


def lock_comparison(output_dir: Path):
    """Take ``<output_dir>/.compare.lock`` (``fcntl.flock``, non-blocking) for this process's life;
    returns the open lock file (keep a reference). Two local drivers on one comparison would run
    the same cells into the same run directories.

    Raises:
        ComparisonBusy: another process holds the lock.
    """
    import fcntl

    output_dir.mkdir(parents=True, exist_ok=True)
    fh = open(output_dir / ".compare.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise ComparisonBusy(f"{output_dir} is being run by another echotrain compare (lock "
                             f"{output_dir / '.compare.lock'}); wait for it or stop it") from None
    return fh


def run_cells(spec: CompareSpec, cells: Sequence[Cell], jobs: int = 1, nice: int = 0,
              log=print, lock: Any = None) -> dict[str, str]:
    """Run the cells that are not done, ``jobs`` at a time; returns ``{cell name: outcome}``
    (``done before``, ``ok``, ``failed (exit N, see train.log)``). Every cell is checked before
    any starts. Call it from a thread that outlives the cells (the parent-death signal follows the
    thread that started them).

    ``lock``: the comparison's lock when the caller took it already (:func:`lock_comparison`;
    ``echotrain compare`` takes it before writing the plan), else it is taken here.

    Raises:
        ComparisonBusy: another local driver is running this comparison.
        CellBusy: another process is writing one of the cells (none is started).
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs!r} must be >= 1")
    _lock = lock if lock is not None else lock_comparison(spec.output_dir)  # noqa: F841 - held until return
    outcomes: dict[str, str] = {}
    queue: list[tuple[Cell, str]] = []
    for c in cells:  # before any cell is prepared or started
        check_cell_free(c)
    for c in cells:
        status = prepare_cell(c)
        if status == "done":
            outcomes[c.name] = "done before"
            suite = run_suite(c, spec.suite, nice)
            if spec.suite:
                log(f"compare: {c.name}: suite {suite}")
        else:
            queue.append((c, status))
    log(f"compare: {len(cells)} cells: {len(cells) - len(queue)} done, "
        f"{sum(s == 'resume' for _, s in queue)} to resume, {sum(s.startswith('new') for _, s in queue)} new; jobs={jobs}")
    running: list[tuple[Cell, subprocess.Popen, Any, float]] = []
    t0 = time.perf_counter()
    try:
        _drive(queue, running, outcomes, cells, jobs, nice, spec, log, t0)
    finally:  # interrupted (Ctrl-C, SIGTERM as KeyboardInterrupt): stop our children; they resume later
        for c, proc, fh, _start in running:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            fh.close()
    return outcomes


def _drive(queue, running, outcomes, cells, jobs, nice, spec, log, t0) -> None:
    while queue or running:
        while queue and len(running) < jobs:
            c, status = queue.pop(0)
            fh = open(c.run_dir / "train.log", "a")
            fh.write(f"\n# compare: {status} {' '.join(cell_command(c, status))}\n")
            fh.flush()
            proc = subprocess.Popen(cell_command(c, status), stdout=fh, stderr=subprocess.STDOUT,
                                    env=_env(int(c.config.num_threads or 1)), preexec_fn=_preexec(nice))
            running.append((c, proc, fh, time.perf_counter()))
            log(f"compare: start {c.name} ({status})")
        time.sleep(0.2)
        still = []
        for c, proc, fh, start in running:
            rc = proc.poll()
            if rc is None:
                still.append((c, proc, fh, start))
                continue
            fh.close()
            ok = rc == 0 and cell_status(c) == "done"
            outcomes[c.name] = "ok" if ok else f"failed (exit {rc}, see {c.run_dir / 'train.log'})"
            log(f"compare: {'done' if ok else 'FAILED'} {c.name} in {time.perf_counter() - start:.0f} s "
                f"[{len(outcomes)}/{len(cells)}, {time.perf_counter() - t0:.0f} s elapsed]")
            if ok and spec.suite:
                log(f"compare: {c.name}: suite {run_suite(c, spec.suite, nice)}")
        running[:] = still
