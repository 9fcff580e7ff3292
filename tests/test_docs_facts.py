"""Facts the shipped files state about the code: the default config's task description, the
package metadata (SPDX licence, so setuptools does not warn at install), and where the tests look
for the benchmark data the README says to supply."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_describes_the_default_task_operands():
    from echotrain.tasks.gym import DEFAULT_TASK

    text = (ROOT / "configs" / "default.yaml").read_text()
    cfg = DEFAULT_TASK["config"]
    # reasoning-gym draws operands from 0 (min_digits=1) up to 10**max_digits inclusive
    assert (cfg["min_digits"], cfg["max_digits"]) == (1, 2)
    assert "operands 0-100" in text and "one-digit" not in text


def test_pyproject_uses_an_spdx_license_string_and_a_setuptools_that_reads_it():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # a string, not the deprecated {text = ...} table
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+)", req).group(1)) >= 77  # PEP 639 strings: setuptools 77+


def test_readme_names_the_variable_the_data_tests_read():
    readme = " ".join((ROOT / "README.md").read_text().split())
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert 'os.environ.get("ECHOTRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")' in conftest
    assert "point `ECHOTRAIN_SHARED_DATA` at it (default: `shared/data` next to the repository folder" in readme
    assert '"shared data folder not found at ..."' in readme and 'f"shared data folder not found at {path}"' in conftest


def test_install_script_installs_verl_last_so_pip_prints_no_resolver_error():
    """pip checks the dependencies of what an install touches: once verl (installed --no-deps, its
    pins unmet on purpose) is present, a later install of a package it depends on prints pip's
    resolver "ERROR" (issue 36, item 18). So verl comes last, and every install from it on is --no-deps."""
    lines = [ln for ln in (ROOT / "scripts" / "install.sh").read_text().splitlines()
             if "pip install" in ln and not ln.lstrip().startswith("#")]
    (at,) = [i for i, ln in enumerate(lines) if "verl==" in ln]
    assert all("--no-deps" in ln for ln in lines[at:]), lines[at:]
    assert at == len(lines) - 1
