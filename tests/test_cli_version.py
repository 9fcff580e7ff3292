"""The top-level options of ``echotrain`` (issue 40 item 7): ``--version`` prints the version
(the one pyproject.toml declares) and exits 0; an unknown option is a usage error, exit 2,
not the help with exit 0. Through the real command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _echotrain(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "echotrain.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=120)


def test_version_prints_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = _echotrain("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"echotrain {version}\n", "")


def test_an_unknown_option_exits_2_without_the_help():
    for argv in (["--foo"], ["experiment", "--foo"], ["--foo", "train"]):
        done = _echotrain(*argv)
        assert done.returncode == 2, argv
        assert done.stdout == "" and done.stderr.splitlines()[-1] == "echotrain: error: unrecognized arguments: --foo"
    done = _echotrain()  # no command at all: the help, as before
    assert done.returncode == 0 and "COMMAND" in done.stdout and "--version" in done.stdout
