"""The comparison report against hand-made run directories."""

import json
import math

import pytest
import yaml

from echotrain.compare.report import write_report


def make_run(root, arm, seed, acc, steps=6, length=20.0, grad=1.0, time_step=0.5, mem=100.0):
    """A run directory: eval accuracy ``acc`` at steps 0, 2, 4, 6 and flat metrics."""
    d = root / "cells" / f"{arm}__s{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"preset": arm, "seed": seed, "steps": steps}))
    (d / "cell.json").write_text(json.dumps({"arm": arm, "seed": seed}))
    recs = [{"step": s, "reward/mean": 0.1 * s, "response_length/mean": length(s) if callable(length) else length,
             "entropy": 1.0, "grad_norm": grad(s) if callable(grad) else grad, "time/step": time_step,
             "memory/peak_mb": mem, "pg_loss": 0.0} for s in range(1, steps + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "stability.json").write_text("{}")  # finished (the trainer's last file)
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/accuracy": a})
                                          + "\n" for s, a in zip((0, 2, 4, 6), acc)))
    return d


@pytest.fixture
def comparison(tmp_path):
    root = tmp_path / "cmp"
    # grpo: AUCs (trapezoid over 0..6 / 6): seed 0 (0,.2,.2,.2) -> (0.2 + 0.4 + 0.4)/6 = 1/6
    make_run(root, "grpo", 0, (0.0, 0.2, 0.2, 0.2))
    make_run(root, "grpo", 1, (0.0, 0.2, 0.4, 0.4))  # (0.2 + 0.6 + 0.8)/6 = 0.2667
    make_run(root, "grpo", 2, (0.0, 0.0, 0.2, 0.4))  # (0 + 0.2 + 0.6)/6 = 0.1333
    # echo: +0.2 everywhere after step 0 -> AUC + (0.2 + 0.4 + 0.4)/6 = +1/6 per seed; twice the step time
    make_run(root, "echo", 0, (0.0, 0.4, 0.4, 0.4), time_step=1.0, mem=150.0)
    make_run(root, "echo", 1, (0.0, 0.4, 0.6, 0.6), time_step=1.0, mem=150.0,
             length=lambda s: 20.0 if s <= 3 else 5.0, grad=lambda s: 30.0 if s == 5 else 1.0)
    make_run(root, "echo", 2, (0.0, 0.2, 0.4, 0.6), time_step=1.0, mem=150.0)
    spec = {"name": "t", "baseline": "grpo", "arms": {"grpo": {}, "echo": {}}, "report": {"threshold": 0.4},
            "verdict": [{"claim": "echo higher AUC", "arm": "echo", "baseline": "grpo", "statistic": "auc",
                         "direction": "greater", "margin": 0.0},
                        {"claim": "echo fewer flags", "arm": "echo", "baseline": "grpo", "statistic": "any_flag",
                         "direction": "less", "margin": 0.0}]}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


def test_report_numbers(comparison):
    path = write_report([comparison])
    assert path == comparison / "report" / "report.md"
    s = json.loads((comparison / "report" / "summary.json").read_text())
    grpo, echo = s["arms"]["grpo"], s["arms"]["echo"]
    assert list(s["arms"]) == ["grpo", "echo"]  # the comparison's arm order
    g_auc = [1 / 6, 1.6 / 6, 0.8 / 6]
    assert grpo["auc"]["mean"] == pytest.approx(sum(g_auc) / 3)
    # sample std of (1, 1.6, 0.8)/6: deviations (-0.4, 1.4, -1.0)/18 -> sqrt((0.16 + 1.96 + 1) / 2) / 18
    assert grpo["auc"]["std"] == pytest.approx(math.sqrt(3.12 / 2) / 18)
    assert echo["auc"]["mean"] == pytest.approx(sum(g_auc) / 3 + 1 / 6)
    assert grpo["final"]["mean"] == pytest.approx(1.0 / 3)
    assert grpo["auc"]["ci_low"] <= grpo["auc"]["mean"] <= grpo["auc"]["ci_high"]
    # steps to 0.4: grpo seeds never, 4, 6 -> 2/3 reached, mean 5; echo 2, 2, 4
    assert grpo["threshold_reached"] == "2/3" and grpo["steps_to_threshold_mean_reached"] == pytest.approx(5.0)
    assert echo["threshold_reached"] == "3/3" and echo["steps_to_threshold_mean_reached"] == pytest.approx(8 / 3)
    # ratios to grpo: half the steps per second, 1.5x the memory
    assert echo["steps_per_s_ratio"] == pytest.approx(0.5) and echo["peak_memory_mb_ratio"] == pytest.approx(1.5)
    assert echo["worst_grad_norm_max"] == 30.0
    # flags: echo seed 1 collapses in length (5 < 0.5 * 20) and its grad norm spikes 30x
    assert echo["flags"]["length_collapse"] == 1 and echo["flags"]["grad_explosion"] == 1
    assert grpo["flags"]["length_collapse"] == 0
    paired = s["paired"]["echo"]["auc"]
    assert paired["n"] == 3 and paired["diff_mean"] == pytest.approx(1 / 6)
    assert paired["ci_low"] == pytest.approx(1 / 6) and paired["ci_high"] == pytest.approx(1 / 6)
    verdict = {v["claim"]: v["result"] for v in s["verdict"]}
    assert verdict == {"echo higher AUC": "holds", "echo fewer flags": "inconclusive"}  # diffs (0, 1, 0): CI [0, 1]
    curves = json.loads((comparison / "report" / "curves.json").read_text())
    assert curves["eval/accuracy"]["grpo"]["steps"] == [0, 2, 4, 6]
    assert curves["eval/accuracy"]["grpo"]["mean"] == pytest.approx([0.0, 0.4 / 3, 0.8 / 3, 1.0 / 3], rel=1e-4)
    assert curves["steps_per_s"]["echo"]["mean"] == pytest.approx([1.0] * 6)
    md = path.read_text()
    assert "| echo | 3 |" in md and "**holds**" in md and "![eval_accuracy](plots/eval_accuracy.png)" in md
    assert (comparison / "report" / "plots" / "eval_accuracy.png").stat().st_size > 1000


def test_unfinished_cells_are_left_out_unless_asked(comparison):
    (comparison / "cells" / "echo__s2" / "stability.json").unlink()
    write_report([comparison])
    s = json.loads((comparison / "report" / "summary.json").read_text())
    assert s["arms"]["echo"]["n"] == 2 and s["unfinished_cells"] == ["echo__s2"]
    assert "Unfinished cells (not included): echo__s2" in (comparison / "report" / "report.md").read_text()
    write_report([comparison], include_partial=True)
    assert json.loads((comparison / "report" / "summary.json").read_text())["arms"]["echo"]["n"] == 3


def test_max_step_reads_a_common_horizon(comparison):
    write_report([comparison], max_step=4)
    s = json.loads((comparison / "report" / "summary.json").read_text())
    # grpo seed 0 up to step 4: (0, .2, .2) at 0, 2, 4 -> AUC (0.2 + 0.4) / 4 = 0.15, final 0.2
    run = next(r for r in s["runs"] if r["arm"] == "grpo" and r["seed"] == 0)
    assert run["auc"] == pytest.approx(0.15) and run["final"] == pytest.approx(0.2) and run["steps"] == 4
    assert s["max_step"] == 4


def test_report_of_plain_run_directories(comparison, tmp_path):
    dirs = [comparison / "cells" / n for n in ("grpo__s0", "grpo__s1", "echo__s0")]
    path = write_report(dirs, out_dir=tmp_path / "out", baseline="grpo", threshold=0.2)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["arms"]["echo"]["n"] == 1 and s["arms"]["grpo"]["n"] == 2
    assert s["verdict"] == []  # no compare.yaml given: no rule
    assert path.is_file()


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        write_report([tmp_path])
