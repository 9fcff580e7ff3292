"""The CLI makes OpenMP threads wait passively when the machine is busy at start, unless the user
chose a policy (issue 14 item 1)."""

from __future__ import annotations

import os
import subprocess
import sys

from echotrain import cli
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
    monkeypatch.setattr(cli, "other_cpu_load", lambda *a, **k: None)
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
        "from echotrain import cli\n"
        "cli.other_cpu_load = lambda *a, **k: 1.5\n"  # as if another process were busy
        "assert 'torch' not in sys.modules, 'echotrain.cli imported torch'\n"
        "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' in sys.modules\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "PASSIVE"
