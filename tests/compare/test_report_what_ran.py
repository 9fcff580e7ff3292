"""What a compare report says about the runs themselves, through the real CLI on tiny testbed runs:
the seeds and steps that ran (not the description's), the `max_step` actually read, the commit and
the resolved precision of every cell, and the pairs of cells that differ in either."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from echotrain import cli
from echotrain.compare.runner import source_commit

ROOT = Path(__file__).resolve().parents[2]
TINY = ["prompts_per_step=2", "num_generations=2", "max_new_tokens=4", "micro_batch_size=8", "num_mini_batches=1",
        "eval_prompts=2", "eval_every=1", "num_threads=1", "save_final_model=false", "save_every=0", "log_samples=1"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Issue 40's command: configs/compare/testbed.yaml (5 seeds, 80 steps, max_step 80 in the file)
    with arms=grpo,echo seeds=2 steps=2: four 2-step cells (about 30 s on one loaded core)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("PYTHONPATH", str(ROOT / "src"))  # the cells are subprocesses
    mp.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path_factory.mktemp("what_ran") / "study"
    rc = cli.main(["compare", str(ROOT / "configs/compare/testbed.yaml"), "--jobs", "2", "arms=grpo,echo", "seeds=2",
                   "steps=2",
                   *TINY, f"output_dir={out}"])
    mp.undo()
    assert rc == 0
    return out


def test_report_states_what_ran_not_what_the_description_says(study):
    md = (study / "report" / "report.md").read_text()
    # the file's description still says 5 seeds; the report says it was written for other settings
    assert "5 seeds" in md
    assert ("**The description above was written for the comparison file's settings; these runs override them:** "
            "`seeds` [0, 1, 2, 3, 4] in the file, [0, 1] here; `arms` [") in md
    assert "`steps` 80 in the file, 2 here" in md
    assert "What ran: 2 arms x 2 seeds (0, 1), 4 runs configured for 2 steps; `max_step` 80 is beyond the last " \
           "step logged, so every run is read to its end (step 2)." in md
    assert "Every run is read up to step 80" not in md and "read up to step 80" not in md
    s = json.loads((study / "report" / "summary.json").read_text())
    assert s["overridden"]["seeds"] == {"file": [0, 1, 2, 3, 4], "ran": [0, 1]}
    assert s["overridden"]["steps"] == {"file": 80, "ran": 2}
    assert {r["last_step"] for r in s["runs"]} == {2} and {r["config_steps"] for r in s["runs"]} == {2}


def test_report_wording_of_the_seeds_verdicts_are_on(study):
    md = (study / "report" / "report.md").read_text()
    assert "Verdicts on every seed run: 0, 1." in md
    assert "all seeds seeds" not in md and "Verdicts on the all" not in md


def test_report_names_the_commit_and_precision_of_every_cell(study, tmp_path):
    s = json.loads((study / "report" / "summary.json").read_text())
    commit = source_commit()
    assert commit  # the tests run from a git checkout
    assert {tuple(r["commits"]) for r in s["runs"]} == {(commit,)}
    # configs/compare/testbed.yaml pins autocast=off: run_info.json's resolution, per cell
    assert {(r["autocast"], r["autocast_reason"]) for r in s["runs"]} == {("off", "autocast=off is set")}
    md = (study / "report" / "report.md").read_text()
    assert f"Commit of echotrain that ran the cells: {commit} (4 cells)." in md
    assert "Precision of the forward passes (run_info.json `autocast`): off (autocast=off is set) (4 cells)." in md
    assert "Warning" not in md
    # one baseline cell from another commit and in bfloat16: its pair with echo seed 1 is flagged
    copy = tmp_path / "study"
    shutil.copytree(study, copy, ignore=shutil.ignore_patterns("report"))
    cell = copy / "cells" / "grpo__s1"
    info = json.loads((cell / "cell.json").read_text())
    (cell / "cell.json").write_text(json.dumps({**info, "commits": ["0123456789ab"]}))
    ri = json.loads((cell / "run_info.json").read_text())
    (cell / "run_info.json").write_text(json.dumps({**ri, "autocast": "bfloat16", "autocast_reason": "x"}))
    assert cli.main(["compare", "report", str(copy), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert (f"**Warning: 1 compared pair of cells ran with different commits**, so their difference is not only the "
            f"arms' settings: echo vs grpo seed 1 ({commit} vs 0123456789ab).") in md
    assert "**Warning: 1 compared pair of cells ran with different precision**" in md
    assert "echo vs grpo seed 1 (off vs bfloat16)" in md
    prov = json.loads((tmp_path / "rep" / "summary.json").read_text())["provenance"]
    assert prov["commits"] == {commit: 3, "0123456789ab": 1}
    assert [m["seed"] for m in prov["mixed_commits"]] == [1]
