"""The pre-registered choice of claims to confirm (``echotrain compare select``)."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from echotrain.cli import main
from echotrain.compare.config import expand_cells, load_spec
from echotrain.compare.select import (arms_of, check_selection, confirmation_command, rank_claims,
                                      select_claims)

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "compare"


def _row(claim, p, diff, direction="greater", n=5, **labels):
    return {"claim": claim, "p": p, "direction": direction, "comparison": {"n": n, "diff_mean": diff},
            "arm": labels.pop("arm", "a"), **labels}


ROWS = [
    _row("1. headline", 0.40, 0.01, arm="echo[k=8]", arm_ref="echo[k=0]", baseline="grpo[k=8]", baseline_ref="grpo[k=0]"),
    _row("2. wrong way", 0.001, -0.05, arm="dapo"),                 # smallest p, but points against the claim
    _row("3. less, right way", 0.03, -0.02, direction="less", arm="cispo", baseline="echo"),
    _row("4. tie with 5", 0.10, 0.02, arm="x"),
    _row("5. tie with 4", 0.10, 0.03, arm="y"),
    _row("6. one seed", 0.0, 0.2, n=1, arm="z"),                    # n < 2: no test
    _row("7. no p", float("nan"), 0.1, arm="w"),
]


def test_ranking_keeps_claims_pointing_the_claimed_way_by_p():
    assert [r["claim"][:2] for r in rank_claims(ROWS)] == ["3.", "4.", "5.", "1."]  # ties keep file order


def test_selection_rule_by_hand():
    chosen, fell_back = select_claims(ROWS)
    assert [r["claim"] for r in chosen] == ["3. less, right way"] and not fell_back
    assert [r["claim"][:2] for r in select_claims(ROWS, claims=3)[0]] == ["3.", "4.", "5."]
    assert [r["claim"][:2] for r in select_claims(ROWS, p_max=0.1, claims=3)[0]] == ["3."]  # p < p_max, strict
    assert select_claims(ROWS, p_max=0.02) == ([ROWS[0]], True)  # none qualifies: the headline
    assert select_claims(ROWS, p_max=0.02, fallback="none") == ([], True)
    with pytest.raises(ValueError, match="no claims"):
        select_claims([])


def test_arms_and_the_confirmation_command():
    assert arms_of([ROWS[0]]) == ["echo", "grpo"]  # sweep suffixes removed, first-seen order
    assert arms_of([ROWS[2], ROWS[0]]) == ["cispo", "echo", "grpo"]
    cmd = confirmation_command("c.yaml", [ROWS[0]], "grpo[k=0]", ["lr=1e-4"])
    assert shlex.split(cmd) == ["echotrain", "compare", "c.yaml", "lr=1e-4", "phase=confirmation", "arms=echo,grpo",
                                "baseline=grpo[k=0]"]  # the file's baseline is selected: kept
    cmd = confirmation_command("c.yaml", [ROWS[0]], "dapo", [])
    assert shlex.split(cmd)[-1] == "baseline=grpo[k=0]"  # not selected: the claim's own reference
    assert shlex.split(confirmation_command("c.yaml", [ROWS[2]], None))[-1] == "baseline=echo"


@pytest.mark.parametrize("bad, match", [({"p": 1}, "unknown key"), ({"p_max": 0}, "p_max"), ({"p_max": 1.5}, "p_max"),
                                        ({"claims": 0}, "claims"), ({"claims": True}, "claims"),
                                        ({"fallback": "all"}, "fallback"), ([0.2], "mapping")])
def test_bad_selection_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        check_selection(bad)
    assert check_selection(None) == {"p_max": 0.2, "claims": 1, "fallback": "first"}


def _summary(out: Path, runs, verdict=()):
    (out / "report").mkdir(parents=True)
    (out / "report" / "summary.json").write_text(json.dumps({"runs": runs, "verdict": list(verdict)}))


def _runs(labels, seeds, auc):
    """Per-seed statistics as a report writes them: ``auc(label, seed)``, final = auc, no flags."""
    return [{"arm": lab, "seed": s, "auc": auc(lab, s), "final": auc(lab, s), "any_flag": 0}
            for lab in labels for s in seeds]


def test_select_through_the_cli_on_a_shipped_study(tmp_path, capsys):
    """The shipped study (a) file and a screening's per-seed numbers in which only ECHO vs CISPO
    (claim 5) points the claimed way clearly: the command printed is the one its pre-registered
    rule gives, and compare accepts it (validated, cells listed)."""
    path = SHIPPED / "staleness_length.yaml"
    raw = yaml.safe_load(path.read_text())
    spec = load_spec(path)
    out = tmp_path / "cmp"
    noise = [0.004, -0.003, 0.001, -0.002, 0.0]

    def auc(label, seed):  # cispo loses 0.05 from k 0 to 8 (+- noise), every other arm 0.01
        i = raw["seeds"].index(seed) if seed in raw["seeds"] else 0
        lost = 0.05 + noise[i] if label == "cispo[staleness=8]" else 0.01 if label.endswith("=8]") else 0.0
        return 0.2 - lost + 0.001 * i

    # a confirmation report's summary: its own 'verdict' holds only the selected arms' claim, and
    # the confirmation seeds' runs are there too; select reads the exploration seeds of every claim
    _summary(out, _runs(spec.arm_labels(), raw["seeds"] + raw["confirm_seeds"], auc), verdict=[{"claim": "x"}])
    assert main(["compare", "select", str(path), f"output_dir={out}", "arms=echo", "verdict=none"]) == 0
    captured = capsys.readouterr()
    assert "chosen: 5. ECHO loses less than CISPO" in captured.err
    assert "1. p " in captured.err and "(n 5)  5. ECHO loses less than CISPO" in captured.err
    cmd = shlex.split(captured.out.strip())
    assert cmd == ["echotrain", "compare", str(path), f"output_dir={out}", "phase=confirmation", "arms=echo,cispo",
                   "baseline=cispo[staleness=0]"]
    assert main(cmd[1:] + ["--dry-run"]) == 0
    cells = expand_cells(load_spec(path, cmd[3:]))
    assert {c.seed for c in cells} == set(raw["confirm_seeds"]) and len(cells) == 2 * 2 * 10  # 2 arms x k x seeds


def test_select_on_nothing_to_confirm_and_bad_input(tmp_path, capsys):
    path = SHIPPED / "echo_choices_length.yaml"  # fallback: none
    out = tmp_path / "cmp"
    raw = yaml.safe_load(path.read_text())
    flat = _runs(load_spec(path).arm_labels(), raw["seeds"], lambda lab, s: 0.2 + 0.001 * s)  # no differences
    _summary(out, flat)
    assert main(["compare", "select", str(path), f"output_dir={out}"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "nothing to confirm" in captured.err
    assert main(["compare", "select", str(path), f"output_dir={tmp_path / 'none'}"]) == 2
    assert "run the screening first" in capsys.readouterr().err
    assert main(["compare", "select"]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**raw, "selection": {"p_max": 2}}))
    assert main(["compare", "select", str(bad)]) == 2
    assert "selection.p_max=2" in capsys.readouterr().err
    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "confirm_seeds"}))
    assert main(["compare", "select", str(single)]) == 2
    assert "declares no confirm_seeds" in capsys.readouterr().err
