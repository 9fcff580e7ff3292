"""Comparison files: parsing, layering and validation before any work."""

from pathlib import Path

import pytest
import yaml

from echotrain.cli import main
from echotrain.compare.config import expand_cells, load_spec
from echotrain.train.config import ConfigError

BASE = {"name": "t", "output_dir": "OUT", "seeds": 2, "baseline": "grpo",
        "base": {"steps": 4, "lr": 1e-4, "model": "x"},
        "arms": {"grpo": {"preset": "grpo"}, "echo_detach": {"preset": "echo", "detach_kappa": True, "lr": 2e-4}}}


def spec(tmp_path, tokens=(), **changes):
    data = {**BASE, "output_dir": str(tmp_path / "cmp"), **changes}
    return load_spec(None, list(tokens), data=data)


def test_cells_layer_base_arm_and_command_line(tmp_path):
    cells = expand_cells(spec(tmp_path, ["steps=7", "seeds=[3,5]"]))
    assert [(c.arm, c.seed) for c in cells] == [("grpo", 3), ("echo_detach", 3), ("grpo", 5), ("echo_detach", 5)]
    grpo, echo = cells[0].config, cells[1].config
    assert grpo.loss_mode == "vanilla" and grpo.kl_coef == 0.04 and grpo.lr == 1e-4  # preset, then base
    assert echo.loss_mode == "echo" and echo.detach_kappa is True and echo.lr == 2e-4  # the arm over base
    assert grpo.steps == echo.steps == 7  # key=value over everything
    assert grpo.num_threads == 1 and grpo.progress is False
    assert cells[2].run_dir == tmp_path / "cmp" / "cells" / "grpo__s5"
    assert cells[2].config.output_dir == str(cells[2].run_dir) and cells[2].config.seed == 5


def test_sweep_expands_every_arm(tmp_path):
    s = spec(tmp_path, arms={"echo": {"preset": "echo"}, "arith": {"preset": "echo", "batch_ratio": "arith"}},
             baseline="echo[band=0.01]",
             sweep={"name": "band", "keys": ["batch_clip_low", "batch_clip_high"], "values": [0.002, 0.01]})
    cells = expand_cells(s)
    assert len(cells) == 2 * 2 * 2
    assert s.arm_labels() == ["echo[band=0.002]", "echo[band=0.01]", "arith[band=0.002]", "arith[band=0.01]"]
    c = cells[-1]
    assert c.arm == "arith[band=0.01]" and c.config.batch_clip_low == c.config.batch_clip_high == 0.01
    assert c.config.batch_ratio == "arith" and c.run_dir.name == "arith__band=0.01__s1"


def test_arm_subset(tmp_path):
    s = spec(tmp_path, ["arms=echo_detach"], baseline=None)
    assert list(s.arms) == ["echo_detach"]


@pytest.mark.parametrize("changes, tokens, match", [
    ({"bogus": 1}, (), "unknown key 'bogus'"),
    ({"arms": {"a": {"learning_rate": 1}}}, (), "did you mean 'lr'"),
    ({"arms": {"a": {"seed": 1}}}, (), "set per cell"),
    ({"baseline": "nope"}, (), "baseline='nope' is not an arm"),
    ({"seeds": 0}, (), "seeds=0"),
    ({"verdict": [{"arm": "nope"}]}, (), r"verdict\[0\].arm='nope'"),
    ({"verdict": [{"arm": "grpo", "statistic": "median"}]}, (), "statistic"),
    ({}, ("arms=grpo,zzz",), "unknown arm"),
    ({}, ("report.colour=1",), "unknown key 'report.colour'"),
    ({"sweep": {"keys": ["batch_clip_low"]}}, (), "values"),
])
def test_bad_files_are_rejected(tmp_path, changes, tokens, match):
    with pytest.raises(ConfigError, match=match):
        spec(tmp_path, tokens, **changes)


def test_every_cell_is_validated_like_train(tmp_path):
    s = spec(tmp_path, arms={"grpo": {"preset": "grpo"}, "bad": {"preset": "echo", "batch_ratio": "harmonic"}})
    with pytest.raises(ConfigError, match="arm 'bad' seed 0: batch_ratio='harmonic'"):
        expand_cells(s)


def test_cli_dry_run_and_errors(tmp_path, capsys):
    import yaml

    cfg = tmp_path / "c.yaml"
    data = {**BASE, "output_dir": str(tmp_path / "cmp"), "base": {"steps": 2, "task": "default"}}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["compare", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[3] echo_detach" in out and "new" in out
    assert (tmp_path / "cmp" / "compare.yaml").is_file()
    assert (tmp_path / "cmp" / "commands.sh").read_text().count("echotrain train --config") == 4
    assert main(["compare", str(cfg), "--dry-run", "seeds=1"]) == 0  # key=value after an option
    assert "[1] echo_detach" in capsys.readouterr().out  # seed-major order
    assert main(["compare", str(cfg), "lr=-1", "--dry-run"]) == 2
    assert "lr=-1.0: must be > 0" in capsys.readouterr().err
    assert main(["compare", str(cfg), "task=nope", "--dry-run"]) == 2
    assert main(["compare", "report"]) == 2


# ---------------------------------------------------------------- arms selection and the claims
SHIPPED = sorted(Path(__file__).resolve().parents[2].glob("configs/compare/*.yaml"))
#: per shipped config: an arm selection that keeps its baseline
SELECTIONS = {"testbed": "grpo,echo", "smollm": "grpo,echo", "balanced_testbed": "token-mean,balanced",
              "echo_band": "geo", "testbed_length": "grpo,echo", "staleness_length": "grpo_nokl,echo",
              "balanced_length": "token_mean,balanced", "echo_choices_length": "echo,echo_arith",
              "staleness_length_gspo": "grpo_nokl,echo,gspo", "staleness_length_gspo_claim5": "gspo",
              "staleness_dose": "grpo_nokl,echo", "distill_testbed": "rl,distill", "echo_grpo_pilot": "grpo_nokl",
              "echo_grpo_trust": "grpo_nokl", "staleness_k1": "grpo_nokl",
              "staleness_k4": "grpo_nokl,decoupled_tis", "calc_tool": "tool_grpo,tool_echo",
              "balanced_calc": "token_mean,balanced", "lr_fair_pilot": "echo_k8", "lr_fair": "cispo_k8,echo_k8", "smollm_length": "grpo,echo",
              "echo_token_clip": "echo_no_token_clip,echo",
              "echo_token_clip_k0": "echo_no_token_clip,echo"}


def test_every_shipped_config_is_covered():
    assert {p.stem for p in SHIPPED} == set(SELECTIONS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configs_validate_whole_and_under_arms_selection(path, tmp_path, capsys):
    raw = yaml.safe_load(path.read_text())
    whole = load_spec(path)
    assert len(whole.verdict) == len(raw["verdict"]) and whole.dropped_verdicts == []
    out = tmp_path / "cmp"
    sel = SELECTIONS[path.stem]
    assert main(["compare", str(path), f"arms={sel}", f"output_dir={out}", "--dry-run"]) == 0
    captured = capsys.readouterr()
    plan = yaml.safe_load((out / "compare.yaml").read_text())
    kept, dropped = plan["verdict"], plan.get("dropped_verdicts", [])
    assert len(kept) + len(dropped) == len(raw["verdict"])
    if not raw["verdict"]:  # a regime pilot: no claims, nothing dropped, no claim line
        assert kept == [] and dropped == [] and "not evaluated" not in captured.err
        return
    cells = expand_cells(load_spec(path, [f"arms={sel}"]))
    labels = {c.arm for c in cells}
    assert all(c[k] in labels for c in kept for k in ("arm", "baseline", "arm_ref", "baseline_ref") if k in c)
    assert sum(line.startswith("[") for line in captured.out.splitlines()) == len(cells)
    if set(sel.split(",")) == set(raw["arms"]):  # a two-arm study: its selection is every arm, every claim stays
        assert dropped == [] and len(kept) == len(raw["verdict"]) and "not evaluated" not in captured.err
        return
    for d in dropped:  # each dropped claim names an unselected arm, and the command said so in one line
        assert "not selected" in d["reason"]
        assert all(arm in captured.err for arm in d["missing"])
    assert captured.err.count("not evaluated") == 1
    assert f"{len(dropped)} of {len(raw['verdict'])} claim" in captured.err
    assert dropped, "the selection should leave out some claims"


def test_cli_arms_selection_of_the_testbed_study(tmp_path, capsys):
    path = next(p for p in SHIPPED if p.stem == "testbed")
    assert main(["compare", str(path), "arms=grpo,echo", f"output_dir={tmp_path / 'c'}", "--dry-run"]) == 0
    plan = yaml.safe_load((tmp_path / "c" / "compare.yaml").read_text())
    # the claims between grpo and echo stay: AUC, final accuracy, worst gradient norm
    assert [c["statistic"] for c in plan["verdict"]] == ["auc", "final", "worst_grad_norm"]
    assert {d["reason"] for d in plan["dropped_verdicts"]} >= {"arm(s) dapo not selected",
                                                               "arm(s) gspo not selected"}
    assert len(plan["dropped_verdicts"]) == 7


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_verdict_none_skips_every_claim(path, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", str(path), "verdict=none", "seeds=1", f"output_dir={out}", "--dry-run"]) == 0
    plan = yaml.safe_load((out / "compare.yaml").read_text())
    err = capsys.readouterr().err
    if not yaml.safe_load(path.read_text())["verdict"]:  # a regime pilot: no claim to skip
        assert plan["verdict"] == [] and "dropped_verdicts" not in plan and "not evaluated" not in err
        return
    assert plan["verdict"] == [] and all(d["reason"] == "verdict=none" for d in plan["dropped_verdicts"])
    assert f"{len(plan['dropped_verdicts'])} of {len(plan['dropped_verdicts'])} claim" in err
    assert "not evaluated: verdict=none" in err and err.count("not evaluated") == 1


def test_verdict_override_accepts_only_none(tmp_path, capsys):
    path = next(p for p in SHIPPED if p.stem == "smollm")
    assert main(["compare", str(path), "verdict=yes", "--dry-run", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "verdict='yes': only verdict=none" in err and len(err.strip().splitlines()) == 1


def test_an_unselected_baseline_is_a_clear_error(tmp_path, capsys):
    path = next(p for p in SHIPPED if p.stem == "testbed")
    assert main(["compare", str(path), "arms=echo,dapo", "--dry-run", f"output_dir={tmp_path}"]) == 2
    assert "baseline='grpo' is not an arm (not among arms=echo,dapo: add it there or set baseline=ARM)" \
        in capsys.readouterr().err
    s = load_spec(path, ["arms=echo,dapo", "baseline=dapo"])
    # written claims keep their baseline: only echo vs dapo is left
    assert [(c["arm"], c["baseline"]) for c in s.verdict] == [("echo", "dapo")]


def test_claims_without_baseline_keep_the_files_baseline(tmp_path):
    s = spec(tmp_path, ["baseline=echo_detach"], verdict=[{"arm": "echo_detach"}])
    assert s.baseline == "echo_detach" and s.verdict[0]["baseline"] == "grpo"


def test_a_misspelt_claim_arm_is_still_an_error_under_selection(tmp_path):
    with pytest.raises(ConfigError, match=r"verdict\[0\].arm='ech' is not valid"):
        spec(tmp_path, ["arms=grpo"], verdict=[{"arm": "ech"}])


# ---------------------------------------------------------------- confirmation seeds, rule keys
def test_confirmation_seeds(tmp_path):
    s = spec(tmp_path, seeds=[0, 1], confirm_seeds=[10, 11, 12])
    assert s.seeds == [0, 1] and s.confirm_seeds == [10, 11, 12]
    cells = expand_cells(s)
    assert [c.seed for c in cells] == [0, 0, 1, 1, 10, 10, 11, 11, 12, 12]  # exploration first
    assert spec(tmp_path, seeds=5, confirm_seeds=3).confirm_seeds == [5, 6, 7]  # an int: the next seeds
    assert spec(tmp_path, ["confirm_seeds=[20,21]"], seeds=3).confirm_seeds == [20, 21]
    assert spec(tmp_path, ["confirm_seeds=none"], confirm_seeds=[9]).confirm_seeds == []
    assert spec(tmp_path).confirm_seeds == []


@pytest.mark.parametrize("changes, tokens, match", [
    ({"seeds": [0, 1], "confirm_seeds": [1, 2]}, (), r"seed\(s\) \[1\] are also exploration seeds"),
    ({"confirm_seeds": 0}, (), "confirm_seeds=0"),
    ({"confirm_seeds": "ten"}, (), "confirm_seeds='ten'"),
    ({"report": {"rule": "percentile"}}, (), "report.rule='percentile' is not valid; valid: paired_t, bca"),
    ({"report": {"correction": "bonferroni"}}, (), "report.correction='bonferroni'"),
    ({"report": {"alpha": 5}}, (), r"report.alpha=5 must be a number in \(0, 1\)"),
    ({"verdict": [{"arm": "grpo", "margin": -0.1}]}, (), r"margin=-0.1 must be a number >= 0"),
    ({"verdict": [{"arm": "echo_detach"}], "report": {"rule": "bca"}}, (),
     r"report.rule=bca needs >= 30 seeds, got 2"),
    ({"verdict": [{"arm": "echo_detach"}], "report": {"rule": "bca"}, "seeds": 40, "confirm_seeds": 10}, (),
     r"needs >= 30 confirmation seeds, got 10"),
])
def test_bad_confirmation_and_rule_settings(tmp_path, changes, tokens, match):
    with pytest.raises(ConfigError, match=match):
        spec(tmp_path, tokens, **changes)


def test_rule_defaults_are_written_into_the_plan(tmp_path):
    s = spec(tmp_path, ["report.correction=none"], verdict=[{"arm": "echo_detach"}],
             report={"rule": "bca"}, seeds=2, confirm_seeds=30)
    assert s.report["rule"] == "bca" and s.report["correction"] == "none"
    assert s.report["alpha"] == 0.05 and s.report["power"] == 0.8
    assert spec(tmp_path).report == {"rule": "paired_t", "correction": "holm", "alpha": 0.05, "power": 0.8}


def test_phase_runs_the_screening_or_the_confirmation_alone(tmp_path, capsys):
    assert [c.seed for c in expand_cells(spec(tmp_path, ["phase=exploration"], seeds=2, confirm_seeds=[7]))] \
        == [0, 0, 1, 1]
    assert [c.seed for c in expand_cells(spec(tmp_path, ["phase=confirmation"], seeds=2, confirm_seeds=[7]))] \
        == [7, 7]
    with pytest.raises(ConfigError, match="phase=exploration: the comparison declares no confirm_seeds"):
        spec(tmp_path, ["phase=exploration"])
    with pytest.raises(ConfigError, match="phase='screen' is not valid"):
        spec(tmp_path, ["phase=screen"], confirm_seeds=[7])
    # through the CLI: the plan keeps the confirmation seeds, so the report still judges only them
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "cmp"), "confirm_seeds": [10, 11],
                                   "base": {"steps": 2, "task": "default"}}))
    assert main(["compare", str(cfg), "phase=exploration", "--dry-run"]) == 0
    assert "4 cells" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "cmp" / "compare.yaml").read_text())["confirm_seeds"] == [10, 11]


def test_a_baseline_override_fills_in_for_a_file_without_one(tmp_path):
    s = spec(tmp_path, ["baseline=grpo"], baseline=None, verdict=[{"arm": "echo_detach"}])
    assert s.verdict[0]["baseline"] == "grpo"
    with pytest.raises(ConfigError, match=r"verdict\[0\].baseline=None is not valid"):
        spec(tmp_path, baseline=None, verdict=[{"arm": "echo_detach"}])


def test_a_difference_claim_needs_both_references(tmp_path, capsys):
    from echotrain.cli import main

    spec = {"name": "t", "base": {"model": "testbed", "task": "testbed"}, "baseline": "a",
            "arms": {"a": {}, "b": {}}, "verdict": [{"arm": "a", "baseline": "b", "arm_ref": "b"}]}
    path = tmp_path / "c.yaml"
    path.write_text(__import__("yaml").safe_dump(spec))
    assert main(["compare", str(path), "--dry-run"]) == 2
    assert "verdict[0]: arm_ref and baseline_ref come together" in capsys.readouterr().err
    spec["verdict"][0]["baseline_ref"] = "c"
    path.write_text(__import__("yaml").safe_dump(spec))
    assert main(["compare", str(path), "--dry-run"]) == 2
    assert "verdict[0].baseline_ref='c' is not valid" in capsys.readouterr().err


def test_a_difference_claim_whose_reference_arm_is_not_selected_is_dropped(tmp_path):
    """arms=a,b keeps a claim on a vs b, but drops (a - c) vs (b - d): c and d are not run."""
    arms = {k: {"preset": "grpo"} for k in ("a", "b", "c", "d")}
    claims = [{"arm": "a", "baseline": "b"}, {"claim": "dd", "arm": "a", "arm_ref": "c", "baseline": "b",
                                               "baseline_ref": "d"}]
    s = spec(tmp_path, ["arms=a,b"], arms=arms, baseline="a", verdict=claims)
    assert [c["arm"] for c in s.verdict] == ["a"] and "arm_ref" not in s.verdict[0]
    assert s.dropped_verdicts == [{"claim": "dd", "missing": ["c", "d"], "reason": "arm(s) c, d not selected"}]
    whole = spec(tmp_path, arms=arms, baseline="a", verdict=claims)  # all arms: both claims stay
    assert [c.get("arm_ref") for c in whole.verdict] == [None, "c"] and whole.dropped_verdicts == []


def test_overridden_lists_the_file_settings_the_command_line_changed(tmp_path):
    """What a description written for the file no longer describes (the report warns about it)."""
    s = spec(tmp_path, ["seeds=1", "steps=10", "lr=1e-4", "arms=grpo", "max_new_tokens=4"])
    assert s.overridden() == {"seeds": {"file": [0, 1], "ran": [0]}, "arms": {"file": ["grpo", "echo_detach"],
                                                                           "ran": ["grpo"]},
                              "steps": {"file": 4, "ran": 10}, "max_new_tokens": {"file": "default", "ran": 4}}
    assert spec(tmp_path, ["seeds=2", "steps=4", "lr=0.0001"]).overridden() == {}  # the file's own values
    from echotrain.compare.runner import write_plan

    s = spec(tmp_path, ["seeds=1"])
    written = yaml.safe_load(write_plan(s, expand_cells(s)).read_text())
    assert written["overridden"] == {"seeds": {"file": [0, 1], "ran": [0]}}
    assert load_spec(None, [], data=written).overridden() == {}  # compare.yaml is a valid file; informational key
