"""Cell states, commands, the config-mismatch guard and the suite hook, on hand-made directories."""

import json

import pytest
import yaml

from echotrain.compare import runner
from echotrain.compare.config import expand_cells, load_spec


@pytest.fixture
def cell(tmp_path):
    data = {"output_dir": str(tmp_path / "cmp"), "seeds": 1, "base": {"steps": 3, "model": "m"},
            "arms": {"echo": {"preset": "echo"}}}
    return expand_cells(load_spec(None, [], data=data))[0]


def write_metrics(cell, steps):
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    (cell.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))


def test_states(cell):
    assert runner.cell_status(cell) == "new"
    assert runner.prepare_cell(cell) == "new"
    saved = yaml.safe_load((cell.run_dir / "config.yaml").read_text())
    assert saved["seed"] == 0 and saved["output_dir"] == str(cell.run_dir) and saved["loss_mode"] == "echo"
    assert json.loads((cell.run_dir / "cell.json").read_text())["arm"] == "echo"
    write_metrics(cell, [1, 2])
    (cell.run_dir / "checkpoints").mkdir()
    (cell.run_dir / "checkpoints" / "step_00000002.pt").write_bytes(b"x")
    assert runner.cell_status(cell) == "resume"
    cmd = runner.cell_command(cell, "resume")
    assert cmd[-4:] == ["train", "--resume", str(cell.run_dir), "steps=3"]
    write_metrics(cell, [1, 2, 3])
    assert runner.cell_status(cell) == "resume"  # no stability.json: the run did not close
    (cell.run_dir / "stability.json").write_text("{}")
    assert runner.cell_status(cell) == "done"
    assert runner.cell_command(cell, "new")[-2:] == ["--config", str(cell.run_dir / "config.yaml")]


def test_a_new_cell_loses_partial_logs_and_says_so(cell):
    write_metrics(cell, [1, 2])  # killed before its first checkpoint
    status = runner.prepare_cell(cell)
    assert status == "new: the earlier run stopped at step 2 before its first checkpoint, restarting from step 1"
    assert not (cell.run_dir / "metrics.jsonl").exists()
    assert runner.cell_command(cell, status)[-2:] == ["--config", str(cell.run_dir / "config.yaml")]
    assert runner.prepare_cell(cell) == "new"  # nothing logged since: a plain new cell


def test_a_cell_holding_another_run_is_refused(cell):
    runner.prepare_cell(cell)
    (cell.run_dir / "checkpoints").mkdir()
    (cell.run_dir / "checkpoints" / "step_00000001.pt").write_bytes(b"x")
    saved = yaml.safe_load((cell.run_dir / "config.yaml").read_text())
    (cell.run_dir / "config.yaml").write_text(yaml.safe_dump({**saved, "lr": 0.5, "steps": 99}))
    with pytest.raises(ValueError, match=r"other values of \['lr'\]"):
        runner.check_cell_config(cell)


def test_suite_hook_is_a_no_op_without_the_suite(cell, monkeypatch):
    assert runner.run_suite(cell, None) == "not configured"
    monkeypatch.setattr(runner, "suite_available", lambda: False)
    assert runner.run_suite(cell, {"name": "math"}).startswith("skipped")
    cmd = runner.suite_command(cell, {"name": "math", "args": ["--limit", 5]})
    assert cmd[-7:] == ["eval", "--suite", "math", "--model", str(cell.run_dir), "--limit", "5"]


def test_a_second_driver_is_refused(cell, tmp_path):
    held = runner.lock_comparison(cell.run_dir.parents[1])
    try:
        with pytest.raises(runner.ComparisonBusy, match="another echotrain compare"):
            runner.lock_comparison(cell.run_dir.parents[1])
    finally:
        held.close()
    runner.lock_comparison(cell.run_dir.parents[1]).close()  # free again


def test_a_cell_another_process_writes_is_left_alone(cell, monkeypatch):
    """``run_cells`` checks every cell's run lock before preparing any: a held one raises
    ``CellBusy`` naming the cell and the pid, and its partial logs stay."""
    write_metrics(cell, [1, 2])
    monkeypatch.setattr(runner, "lock_holder", lambda run_dir: 4321 if run_dir == cell.run_dir else None)
    spec = load_spec(None, [], data={"output_dir": str(cell.run_dir.parents[1]), "seeds": 1,
                                     "base": {"steps": 3, "model": "m"}, "arms": {"echo": {"preset": "echo"}}})
    with pytest.raises(runner.CellBusy, match=r"cell echo__s0: .* is being written by process 4321 .*kill 4321"):
        runner.run_cells(spec, [cell], log=lambda m: None)
    assert (cell.run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_cell_json_records_every_commit_that_ran_the_cell(cell, monkeypatch):
    """Issue 35: the report compares the commits of paired cells; a resume by another commit adds one."""
    monkeypatch.setattr(runner, "source_commit", lambda: "aaaaaaaaaaaa")
    assert runner.prepare_cell(cell) == "new"
    read = lambda: json.loads((cell.run_dir / "cell.json").read_text())["commits"]  # noqa: E731
    assert read() == ["aaaaaaaaaaaa"]
    write_metrics(cell, [1, 2])
    (cell.run_dir / "checkpoints").mkdir()
    (cell.run_dir / "checkpoints" / "step_00000002.pt").write_bytes(b"x")
    monkeypatch.setattr(runner, "source_commit", lambda: "bbbbbbbbbbbb+dirty")
    assert runner.prepare_cell(cell) == "resume"
    assert read() == ["aaaaaaaaaaaa", "bbbbbbbbbbbb+dirty"]
    assert runner.prepare_cell(cell) == "resume" and read() == ["aaaaaaaaaaaa", "bbbbbbbbbbbb+dirty"]
    (cell.run_dir / "checkpoints" / "step_00000002.pt").unlink()
    monkeypatch.setattr(runner, "source_commit", lambda: None)  # not a git checkout: nothing recorded
    assert runner.prepare_cell(cell).startswith("new: the earlier run stopped at step") and read() == []


def test_source_commit_is_the_checkout_head():
    import subprocess
    from pathlib import Path

    src = Path(runner.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert runner.source_commit().split("+")[0] == head and len(head) == 12


def test_a_refused_command_leaves_the_running_studys_plan_alone(tmp_path, capsys):
    """``echotrain compare`` on a comparison another driver is running exits 2 before writing its
    plan: the running study's compare.yaml (here: all arms, no dropped claim) is not replaced by the
    refused command's (an arm selection that drops claims)."""
    from pathlib import Path

    from echotrain.cli import main

    config = Path(__file__).resolve().parents[2] / "configs" / "compare" / "staleness_k4.yaml"
    out = tmp_path / "cmp"
    assert main(["compare", str(config), f"output_dir={out}", "--dry-run"]) == 0
    plan = (out / "compare.yaml").read_text()
    assert "dropped_verdicts" not in plan
    held = runner.lock_comparison(out)
    try:
        for extra in ([], ["--dry-run"]):
            assert main(["compare", str(config), f"output_dir={out}", "arms=echo,cispo", "baseline=echo[staleness=0]",
                         *extra]) == 2
            assert "being run by another echotrain compare" in capsys.readouterr().err
            assert (out / "compare.yaml").read_text() == plan
    finally:
        held.close()
    assert main(["compare", str(config), f"output_dir={out}", "arms=echo,cispo", "baseline=echo[staleness=0]",
                 "--dry-run"]) == 0
    assert "dropped_verdicts" in (out / "compare.yaml").read_text()  # free again: the selection's plan
