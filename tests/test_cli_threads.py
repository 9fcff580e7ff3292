"""The CLI makes OpenMP threads wait passively when the machine is busy at start, unless the user
chose a policy (issue 14 item 1)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from echotrain import cli, omp
from echotrain.cli import set_omp_wait_policy


def test_passive_only_when_busy_and_unset():
    env: dict[str, str] = {}
    assert set_omp_wait_policy(env, load=1.2) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {}
    assert set_omp_wait_policy(env, load=0.5) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}  # the threshold
    env = {}
    assert set_omp_wait_policy(env, load=0.1) == "GOMP_SPINCOUNT=3000" and env == {"GOMP_SPINCOUNT": "3000"}  # quiet
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_omp_wait_policy(env, load=3.0) == "ACTIVE" and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}
    assert set_omp_wait_policy(env, load=3.0) == "GOMP_SPINCOUNT=1000" and env == {"GOMP_SPINCOUNT": "1000"}


def test_unreadable_load_means_passive(monkeypatch):
    monkeypatch.setattr(omp, "other_cpu_load", lambda *a, **k: None)
    env: dict[str, str] = {}
    assert set_omp_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_load_sample_sees_a_busy_thread():
    import threading

    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    spinner.start()
    try:
        load = cli.other_cpu_load(0.3)
    finally:
        stop.set()
        spinner.join()
    if load is None:  # not Linux
        return
    assert 0.5 <= load <= (os.cpu_count() or 1) + 0.1


def test_the_cli_sets_it_before_torch_loads():
    # a fresh interpreter: importing the CLI must not load torch, and main() sets the policy
    # before the subcommand (which imports torch) is loaded
    code = (
        "import os, sys\n"
        "from echotrain import cli, omp\n"
        "calls = []\n"
        "omp.other_cpu_load = lambda *a, **k: calls.append('torch' in sys.modules) or 1.5\n"  # as if busy
        "assert 'torch' not in sys.modules, 'echotrain.cli imported torch'\n"
        "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' in sys.modules\n"
        "assert calls == [False], f'load sampled {len(calls)} times, torch already imported: {calls}'\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "PASSIVE"


# Two /proc/stat snapshots: cpu0 spends 15 ticks in user (all of them running a guest, which
# the kernel also counts in guest) and 5 idle; cpu1 is quiet, 10 idle + 10 iowait.
STAT0 = ("cpu  100 0 50 800 50 0 0 0 30 0\n"
         "cpu0 60 0 20 400 20 0 0 0 30 0\n"
         "cpu1 40 0 30 400 30 0 0 0 0 0\n"
         "intr 1 2 3\n")
STAT1 = ("cpu  115 0 50 815 60 0 0 0 45 0\n"
         "cpu0 75 0 20 405 20 0 0 0 45 0\n"
         "cpu1 40 0 30 410 40 0 0 0 0 0\n"
         "intr 1 2 3\n")


def test_cpu_ticks_by_hand():
    # total = user..steal (guest left out: already in user); busy = total - idle - iowait
    assert cli.cpu_ticks(STAT0) == (150, 1000, 2)  # aggregate line, 2 CPUs
    assert cli.cpu_ticks(STAT0, {0}) == (80, 500, 1)
    assert cli.cpu_ticks(STAT0, {0, 1}) == (150, 1000, 2)
    assert cli.cpu_ticks(STAT0, {7}) == (150, 1000, 2)  # CPUs without a line: the aggregate
    assert cli.cpu_ticks("cpu  1 2 3 4\n") == (6, 10, 1)  # old kernels: 4 fields
    for bad in ("intr 1 2\n", "cpu  1 2 3\n"):
        with pytest.raises(ValueError, match="/proc/stat"):
            cli.cpu_ticks(bad)


@pytest.mark.parametrize("cpus, want", [({0, 1}, 15 / 40 * 2), ({0}, 15 / 20), ({1}, 0.0), (None, 15 / 40 * 2)])
def test_other_cpu_load_counts_only_this_process_cpus(monkeypatch, cpus, want):
    snapshots = iter([STAT0, STAT1])
    monkeypatch.setattr(omp, "open", lambda path, *a, **k: io.StringIO(next(snapshots)), raising=False)
    monkeypatch.setattr("time.sleep", lambda s: None)
    if cpus is None:
        monkeypatch.delattr(os, "sched_getaffinity")
    else:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    assert cli.other_cpu_load() == pytest.approx(want)


def test_other_cpu_load_none_when_unreadable(monkeypatch):
    def no_proc(path, *a, **k):
        raise FileNotFoundError(path)

    monkeypatch.setattr(omp, "open", no_proc, raising=False)
    assert cli.other_cpu_load(0.0) is None
    snapshots = iter([STAT0, STAT0])  # no time passed: no answer rather than a division by zero
    monkeypatch.setattr(omp, "open", lambda path, *a, **k: io.StringIO(next(snapshots)), raising=False)
    assert cli.other_cpu_load(0.0) is None
