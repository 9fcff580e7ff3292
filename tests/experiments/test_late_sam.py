"""Short version of `echotrain experiment late-sam` (the full run is in docs/experiments/late_sam.md)."""

from __future__ import annotations

import json
import math

import pytest

from echotrain.cli import main
from echotrain.experiments.late_sam import LateSamConfig, run_late_sam, summarize


@pytest.fixture(scope="module")
def short_run():
    cfg = LateSamConfig(epochs=4, lanczos_iters=15, trace_samples=3)
    return cfg, run_late_sam(cfg, seeds=[0], switch_epochs=[0, 3, 4], log=lambda *_: None)


def test_arms_switch_at_the_right_epoch_and_sam_costs_two_passes(short_run):
    cfg, results = short_run
    by_switch = {r.switch_epoch: r for r in results}
    assert sorted(by_switch) == [0, 3, 4]
    steps = math.ceil(1347 / cfg.batch_size)  # 1797 digits, 25% held out -> 1347 training images
    assert steps == 22
    assert by_switch[4].grad_evals_per_epoch == [steps] * 4 and by_switch[4].first_sam_epoch is None
    assert by_switch[3].grad_evals_per_epoch == [steps] * 3 + [2 * steps]
    assert by_switch[3].first_sam_epoch == 3 and by_switch[3].sam_start_step == 3 * steps
    assert by_switch[0].grad_evals_per_epoch == [2 * steps] * 4 and by_switch[0].first_sam_epoch == 0
    assert by_switch[0].grad_evals == 2 * by_switch[4].grad_evals


def test_measurements_are_sane(short_run):
    _, results = short_run
    for r in results:
        assert math.isfinite(r.lambda_max) and r.lambda_max > 0 and r.lambda_converged
        assert r.trace is not None and math.isfinite(r.trace) and r.trace > 0
        assert r.test_acc > 0.8  # 4 epochs of SGD/SAM already learn digits
        assert r.cpu_s > 0 and r.wall_s > 0


def test_summary_cost_ratios(short_run):
    cfg, results = short_run
    rows = {row["switch_epoch"]: row for row in summarize(results, cfg.epochs)}
    assert rows[0]["grad_evals_vs_sgd"] == pytest.approx(2.0)
    assert rows[3]["grad_evals_vs_sgd"] == pytest.approx(1.25)
    assert rows[4]["grad_evals_vs_sgd"] == pytest.approx(1.0)
    assert rows[0]["lambda_gap_closed"][0] == pytest.approx(1.0)
    assert rows[4]["lambda_gap_closed"][0] == pytest.approx(0.0)
    assert rows[4]["acc_minus_sgd"] == (0.0, 0.0)
    r3 = {r.switch_epoch: r for r in results}
    expected = (r3[4].lambda_max - r3[3].lambda_max) / (r3[4].lambda_max - r3[0].lambda_max)
    assert rows[3]["lambda_gap_closed"][0] == pytest.approx(expected)


def test_cli_writes_json_table_and_plot(tmp_path):
    rc = main(["experiment", "late-sam", "--seeds", "2", "--epochs", "2", "--switch-epochs", "0,1,2",
               "--lanczos-iters", "5", "--trace-samples", "0", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "late_sam.json").read_text())
    assert len(data["runs"]) == 6 and data["seeds"] == [0, 1]
    assert [row["switch_epoch"] for row in data["summary"]] == [0, 1, 2]
    assert (tmp_path / "late_sam.png").stat().st_size > 10_000
    table = (tmp_path / "late_sam_table.md").read_text()
    assert "full SAM" in table and "SGD only" in table
    (tmp_path / "late_sam_table.md").unlink()
    assert main(["experiment", "late-sam", "--rerender", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "late_sam_table.md").read_text() == table


def test_bad_switch_epoch_is_rejected():
    with pytest.raises(ValueError, match="switch_epochs"):
        run_late_sam(LateSamConfig(epochs=2), seeds=[0], switch_epochs=[3])
