"""Re-stating written verdicts under the current rule (``echotrain compare restate``)."""

import json
import math
from pathlib import Path

import pytest

from echotrain.cli import main
from echotrain.compare.restate import restate
from echotrain.compare.stats import min_detectable_effect

DOCS = Path(__file__).resolve().parents[2] / "docs" / "experiments"
STUDIES = ("testbed", "smollm", "balanced_testbed", "echo_band")


def test_restate_the_committed_testbed_study():
    rows = {r["claim"]: r for r in restate(DOCS / "testbed" / "summary.json")}
    assert len(rows) == 10 and all(r["m"] == 10 for r in rows.values())  # every claim has 5 paired seeds
    gspo = rows["ECHO beats a stabilised GSPO (higher AUC)"]
    # per-seed AUC differences from the summary's runs: paired t p = 0.00489; the smallest of 10, so Holm x 10
    assert gspo["old_result"] == "holds" and gspo["result"] == "holds"
    assert gspo["p"] == pytest.approx(0.00489, abs=5e-5) and gspo["p_holm"] == pytest.approx(10 * gspo["p"])
    dapo = rows["ECHO learns faster than DAPO (higher AUC)"]
    assert dapo["old_result"] == "contradicted" and dapo["result"] == "inconclusive"
    assert dapo["p"] == pytest.approx(0.062, abs=5e-4)
    c = dapo["comparison"]
    assert dapo["mde"] == pytest.approx(min_detectable_effect(c["diff_std"], 5))
    assert c["diff_mean"] == pytest.approx(dapo["old_comparison"]["diff_mean"])  # same numbers, new rule


def test_restate_every_committed_study_through_the_cli(capsys):
    paths = [str(DOCS / s / "summary.json") for s in STUDIES]
    assert main(["compare", "restate", *paths]) == 0
    out = capsys.readouterr().out
    assert out.count("### ") == 4
    assert out.count("| **holds** |") == 1  # of the ten written "holds"/"contradicted", one survives Holm
    assert "**inconclusive: no difference larger than 0.026 detectable**" in out  # echo vs dapo, testbed
    assert "every paired difference is equal" in out  # echo vs gspo flags: no run of either raised one


def test_restate_agrees_with_the_report_it_reads(tmp_path):
    import importlib.util

    from echotrain.compare.report import write_report

    spec = importlib.util.spec_from_file_location("_report_tests", Path(__file__).with_name("test_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the hand-made study of the report tests
    _study = mod._study

    root = tmp_path / "cmp"
    _study(root)
    write_report([root], plots=False)
    written = json.loads((root / "report" / "summary.json").read_text())["verdict"]
    again = restate(root / "report" / "summary.json")
    assert [r["result"] for r in again] == [v["result"] for v in written] == ["inconclusive"]
    assert again[0]["comparison"]["seeds"] == [10, 11, 12, 13, 14]  # the confirmation seeds again
    assert math.isclose(again[0]["mde"], written[0]["mde"])


def test_restate_errors(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    assert main(["compare", "restate", str(bad)]) == 2
    assert "not a comparison report summary" in capsys.readouterr().err
    assert main(["compare", "restate"]) == 2
    assert main(["compare", "restate", str(tmp_path / "none.json")]) == 2


def test_restate_keeps_a_difference_of_differences(tmp_path):
    """A claim with arm_ref / baseline_ref is re-judged on (a8 - a0) - (b8 - b0) per seed, not on a8 - b8."""
    seeds = [10, 11, 12]
    auc = {"a8": [0.30, 0.31, 0.33], "a0": [0.20, 0.20, 0.21], "b8": [0.10, 0.12, 0.11], "b0": [0.05, 0.06, 0.04]}
    runs = [{"arm": arm, "seed": s, "auc": v[i]} for arm, v in auc.items() for i, s in enumerate(seeds)]
    claim = {"claim": "a gains more", "arm": "a8", "arm_ref": "a0", "baseline": "b8", "baseline_ref": "b0",
             "statistic": "auc", "direction": "greater", "margin": 0.0, "result": "inconclusive"}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"runs": runs, "verdict": [claim], "baseline": "b0",
                                "verdict_rule": {"phase": "confirmation", "seeds": seeds}}))
    row = restate(path)[0]
    did = [(a8 - a0) - (b8 - b0) for a8, a0, b8, b0 in zip(auc["a8"], auc["a0"], auc["b8"], auc["b0"])]
    assert row["comparison"]["n"] == 3
    assert row["comparison"]["diff_mean"] == pytest.approx(sum(did) / 3)  # 0.0433, not a8 - b8 = 0.203
