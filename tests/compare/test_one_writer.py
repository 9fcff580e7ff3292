"""One writer per cell (issue 40 item 6): ``kill -9`` of ``echotrain compare`` takes the cell it
was running with it (echotrain/lifeline.py), and a run directory that a process is writing
(train/run_lock.py) is refused to a second ``echotrain compare`` or ``echotrain train`` with the
holder's pid, exit 2, nothing in the directory changed. Through the real CLI in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import echotrain
from echotrain.train import run_lock

REPO = Path(__file__).resolve().parents[2]
SRC = str(Path(echotrain.__file__).resolve().parents[1])
TESTBED = str(REPO / "configs" / "compare" / "testbed.yaml")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a dead child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_kill_9_of_compare_takes_its_cell_with_it(tmp_path):
    """The issue's command (testbed, one arm, one seed, 80 steps, --jobs 1): once the cell's
    training process holds its run directory, the driver is killed with SIGKILL; the cell is gone
    within 5 s, the directory's lock is free, and its metrics stop growing."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "echotrain.cli", "compare", TESTBED, "arms=grpo", "seeds=1", "steps=80",
           f"output_dir={out}", "--jobs", "1", "--no-report"]
    driver = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cell = out / "cells"
    pid = None
    try:
        def cell_pid() -> int | None:
            for lock in cell.glob(f"*/{run_lock.LOCK_FILE}"):
                pid = run_lock.lock_holder(lock.parent)
                if pid:
                    return pid
            return None

        assert _wait(lambda: cell_pid() is not None or driver.poll() is not None, 240), "no cell started"
        pid = cell_pid()
        assert pid is not None, driver.stderr.read()
        assert _parent_of(pid) == driver.pid  # the cell is the driver's child, an `echotrain train`
        run_dir = next(cell.iterdir())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        assert _wait(lambda: not _alive(pid), 5.0), f"cell {pid} outlived its driver"
        assert _wait(lambda: run_lock.lock_holder(run_dir) is None, 5.0)
        metrics = run_dir / "metrics.jsonl"
        size = metrics.stat().st_size if metrics.exists() else 0
        time.sleep(1.0)
        assert (metrics.stat().st_size if metrics.exists() else 0) == size
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if pid is not None and _alive(pid):  # an orphan (the test failed): do not leave it running
            os.kill(pid, signal.SIGKILL)


_MIDDLE = textwrap.dedent("""
    import os, subprocess, sys
    from echotrain.lifeline import child_env, child_preexec
    guard = sys.argv[1]
    child = [sys.executable, "-c", "import sys, time; from echotrain.lifeline import watch_parent; "
             "watch_parent(0.05); time.sleep(120)"]
    env = child_env(dict(os.environ)) if guard == "watch" else dict(os.environ)
    preexec = child_preexec(parent_death_signal=True) if guard == "prctl" else None
    proc = subprocess.Popen(child, env=env, preexec_fn=preexec)
    print(proc.pid, flush=True)
    sys.stdin.readline()  # killed by the test (SIGKILL) while waiting here
""")


@pytest.mark.parametrize("guard", ["prctl", "watch", "none"])
def test_each_guard_alone_ends_an_orphan(guard):
    """A middle process starts a child with one guard (Linux's parent-death signal; the portable
    watcher thread of ``$ECHOTRAIN_PARENT_PID``) or none, and is killed with SIGKILL: with either
    guard the child ends within 3 s; with none it lives on (what compare's cells did)."""
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE, guard], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    pid = int(middle.stdout.readline())
    try:
        assert _wait(lambda: _alive(pid), 5.0) and _parent_of(pid) == middle.pid
        time.sleep(0.5)  # the child's watcher thread is running
        middle.kill()
        middle.wait()
        assert _wait(lambda: not _alive(pid), 3.0) == (guard != "none")
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _held(run_dir: Path):
    """Hold ``run_dir``'s lock in a separate process (as a running cell would); returns it."""
    code = ("import sys; from echotrain.train.run_lock import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path, capsys):
    """While a process writes a cell's run directory: ``echotrain compare`` (a subprocess) and
    ``echotrain train --resume`` / ``output_dir=`` on it (the CLI's ``main`` in this process) exit 2
    naming the cell or directory and the holder's pid, and change nothing there; once the holder
    is gone the lock is free."""
    from echotrain.cli import main

    out = tmp_path / "cmp"
    compare = [sys.executable, "-m", "echotrain.cli", "compare", TESTBED, "arms=grpo", "seeds=1", "steps=2",
               f"output_dir={out}", "--no-report"]
    run_dir = out / "cells" / "grpo__s0"  # the cell's directory (`--dry-run` lists it)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("steps: 2\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _held(run_dir)
    try:
        got = subprocess.run(compare, env=_env(), capture_output=True, text=True, timeout=300)
        assert got.returncode == 2, got.stderr
        assert f"cell grpo__s0: {run_dir} is being written by process {holder.pid}" in got.stderr
        assert "Traceback" not in got.stderr
        for args in (["--resume", str(run_dir)], [f"output_dir={run_dir}", "model=testbed", "task=testbed"]):
            assert main(["train", *args]) == 2
            err = capsys.readouterr().err
            assert (f"echotrain train: error: output_dir={str(run_dir)!r} is being written by another process "
                    f"(pid {holder.pid}, lock {run_dir / run_lock.LOCK_FILE})") in err, err
        assert (run_dir / "config.yaml").read_text() == "steps: 2\n"
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert sorted(p.name for p in run_dir.iterdir()) == [run_lock.LOCK_FILE, "config.yaml", "metrics.jsonl"]
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.lock_holder(run_dir) is None
