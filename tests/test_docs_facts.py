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


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def test_default_config_times_are_the_current_figures_of_readme_and_benchmarks():
    """configs/default.yaml's header quotes the default job's wall times; each must be a current
    figure: in README's table under "Set up" and in docs/benchmarks.md's "Current figures"."""
    header = " ".join(ln.lstrip("# ") for ln in (ROOT / "configs" / "default.yaml").read_text().splitlines()
                      if ln.startswith("#"))
    times = re.findall(r"\d+ min \d+ s", header)
    assert len(times) >= 3, header
    readme = _section((ROOT / "README.md").read_text(), "## Set up")
    current = _section((ROOT / "docs" / "benchmarks.md").read_text(), "## Current figures")
    for t in times:
        assert t in readme and t in current, t
    assert "7-22 min" not in header


def test_readme_says_how_long_both_set_up_commands_take():
    """The two set-up commands, each with its duration on 2 cores, and the test command .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands == ["python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh && echotrain train",
                        ". .venv/bin/activate && python -m pytest -q"]
    comments = [ln for ln in block.splitlines() if ln.startswith("#")]
    assert re.search(r"~\d+ min on 2 cores", comments[0]) and re.search(r"~\d+-\d+ min on 2 cores", comments[1])
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
    table = _section(readme, "## Set up")
    assert "Intel Xeon with AVX-512 and AMX" in table and "5 min 24 s" in table  # the Intel row


def test_readme_first_screen_shows_the_default_runs_picture():
    """README's set-up section shows the picture of a default run (a committed PNG, small)."""
    readme = _section((ROOT / "README.md").read_text(), "## Set up")
    (path,) = re.findall(r"!\[[^\]]*\]\((docs/[^)]+\.png)\)", readme)
    png = ROOT / path
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    lines = (ROOT / "README.md").read_text().splitlines()
    assert next(i for i, ln in enumerate(lines) if path in ln) < 40  # within the first screen
