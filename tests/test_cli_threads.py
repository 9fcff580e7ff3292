"""The CLI makes OpenMP threads wait passively unless the user chose a policy (issue 14 item 1)."""

from __future__ import annotations

import os
import subprocess
import sys

from echotrain.cli import set_omp_wait_policy


def test_passive_is_set_only_when_unset():
    env: dict[str, str] = {}
    assert set_omp_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_omp_wait_policy(env) == "ACTIVE" and env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_cli_sets_it_before_torch_loads():
    # a fresh interpreter: importing the CLI must not load torch, and main() sets the policy
    # before the subcommand (which imports torch) is loaded
    code = (
        "import os, sys\n"
        "from echotrain import cli\n"
        "assert 'torch' not in sys.modules, 'echotrain.cli imported torch'\n"
        "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' in sys.modules\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "PASSIVE"
