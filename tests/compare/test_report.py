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
    assert verdict == {"echo higher AUC": "holds", "echo fewer flags": "inconclusive"}
    # any_flag diffs (0, 1, 0): mean 1/3, s = sqrt(1/3), t = (1/3) / (sqrt(1/3) / sqrt 3) = 1 on 2 dof:
    # p = 1 - 1 / sqrt(3) = 0.4226; Holm with the AUC claim (p 0, constant difference): 2 x 0 = 0, max(0, 0.4226)
    flags_v = s["verdict"][1]
    assert flags_v["p"] == pytest.approx(1 - 1 / math.sqrt(3)) and flags_v["p_holm"] == pytest.approx(flags_v["p"])
    assert s["verdict"][0]["p"] < 1e-12 and flags_v["m"] == 2 and flags_v["correction"] == "holm"
    assert flags_v["comparison"]["ci_low"] == pytest.approx(1 / 3 - 4.302653 * math.sqrt(1 / 3) / math.sqrt(3))
    # MDE: 80% power at n = 3 is 3.26404 sd (noncentral t); Holm's strictest step at alpha / 2
    assert flags_v["mde"] == pytest.approx(3.26404 * math.sqrt(1 / 3), rel=1e-5)
    assert flags_v["mde_holm"] > flags_v["mde"]
    assert s["verdict_rule"] == {"rule": "paired_t", "correction": "holm", "alpha": 0.05, "power": 0.8,
                                 "seeds": [0, 1, 2], "phase": "all seeds"}
    curves = json.loads((comparison / "report" / "curves.json").read_text())
    assert curves["eval/accuracy"]["grpo"]["steps"] == [0, 2, 4, 6]
    assert curves["eval/accuracy"]["grpo"]["mean"] == pytest.approx([0.0, 0.4 / 3, 0.8 / 3, 1.0 / 3], rel=1e-4)
    assert curves["steps_per_s"]["echo"]["mean"] == pytest.approx([1.0] * 6)
    md = path.read_text()
    assert "| echo | 3 |" in md and "**holds**" in md and "![eval_accuracy](plots/eval_accuracy.png)" in md
    assert "**inconclusive: no difference larger than 1.9 detectable**" in md  # MDE 1.884
    assert "Holm-corrected" in md and "paired t-interval" in md
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


def test_accuracy_collapse_is_flagged_in_the_report(tmp_path):
    root = tmp_path / "cmp"
    make_run(root, "grpo", 0, (0.40, 0.20, 0.10, 0.10))  # from 0.40 to 0.10: below half, 30 points down
    make_run(root, "grpo", 1, (0.40, 0.38, 0.36, 0.35))
    (root / "compare.yaml").write_text(yaml.safe_dump({"name": "t", "arms": {"grpo": {}}}))
    write_report([root], plots=False)
    s = json.loads((root / "report" / "summary.json").read_text())
    assert s["arms"]["grpo"]["flags"]["accuracy_collapse"] == 1
    r0 = next(r for r in s["runs"] if r["seed"] == 0)
    assert r0["stability"]["accuracy_collapse"] is True and r0["any_flag"] == 1.0
    assert r0["stability_values"]["accuracy_collapse"]["start"] == 0.40  # step 0, from eval.jsonl
    md = (root / "report" / "report.md").read_text()
    assert "accuracy_collapse 1" in md and "last held-out accuracy < 0.5 x the first" in md


def _study(root, confirm=True, **extra):
    # exploration seeds 0-2: echo +0.2, +0.22, +0.24 over grpo at every evaluation after step 0 (AUC
    # + 5/6 of that; unequal, so the t-test decides: equal differences get the sign test, no verdict at n = 3)
    for seed in range(3):
        make_run(root, "grpo", seed, (0.0, 0.2, 0.2, 0.2))
        make_run(root, "echo", seed, (0.0,) + (0.4 + 0.02 * seed,) * 3)
    # confirmation seeds 10-14: echo = grpo + c after step 0, c = (0.1, -0.1, 0.05, -0.05, 0): AUC + 5c/6
    for seed, c in zip(range(10, 15), (0.1, -0.1, 0.05, -0.05, 0.0)):
        make_run(root, "grpo", seed, (0.0, 0.3, 0.3, 0.3))
        make_run(root, "echo", seed, (0.0, 0.3 + c, 0.3 + c, 0.3 + c))
    spec = {"name": "t", "baseline": "grpo", "arms": {"grpo": {}, "echo": {}}, "seeds": [0, 1, 2],
            "verdict": [{"claim": "echo higher AUC", "arm": "echo", "baseline": "grpo", "statistic": "auc",
                         "direction": "greater", "margin": 0.0}], **extra}
    if confirm:
        spec["confirm_seeds"] = list(range(10, 15))
    (root / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def test_verdicts_use_only_the_confirmation_seeds(tmp_path):
    root = tmp_path / "cmp"
    _study(root)
    write_report([root], plots=False)
    s = json.loads((root / "report" / "summary.json").read_text())
    v = s["verdict"][0]
    assert v["comparison"]["seeds"] == [10, 11, 12, 13, 14] and v["comparison"]["diff_mean"] == pytest.approx(0.0)
    assert v["result"] == "inconclusive"
    # sd of 5c/6 = (5/6) sqrt(0.025 / 4); MDE at n = 5: 1.681997 sd
    sd = 5 / 6 * math.sqrt(0.025 / 4)
    assert v["comparison"]["diff_std"] == pytest.approx(sd) and v["mde"] == pytest.approx(1.681997 * sd, rel=1e-5)
    assert s["verdict_rule"]["seeds"] == [10, 11, 12, 13, 14] and s["verdict_rule"]["phase"] == "confirmation"
    assert s["arms"]["echo"]["seeds"] == [10, 11, 12, 13, 14]  # the summary is the confirmation's
    assert s["paired"]["echo"]["auc"]["n"] == 5
    ex = s["exploration"]
    assert ex["seeds"] == [0, 1, 2] and ex["arms"]["echo"]["n"] == 3
    assert ex["arms"]["echo"]["steps_per_s_ratio"] == pytest.approx(1.0)  # ratios to the baseline there too
    assert ex["verdict"][0]["result"] == "holds" and ex["verdict"][0]["comparison"]["seeds"] == [0, 1, 2]
    assert {r["phase"] for r in s["runs"] if r["seed"] < 3} == {"exploration"}
    md = (root / "report" / "report.md").read_text()
    assert "Seeds: exploration 0-2; confirmation 10-14." in md
    assert "Verdicts on the confirmation seeds 10-14." in md
    assert "## Exploration seeds 0-2 (exploration: not verdicts)" in md
    assert f"**inconclusive: no difference larger than {1.681997 * sd:.2g} detectable**" in md


def test_confirmation_seeds_not_run_yet(tmp_path):
    root = tmp_path / "cmp"
    _study(root)
    for seed in range(10, 15):
        for arm in ("grpo", "echo"):
            (root / "cells" / f"{arm}__s{seed}" / "stability.json").unlink()  # not finished
    write_report([root], plots=False)
    s = json.loads((root / "report" / "summary.json").read_text())
    assert s["verdict"][0]["result"] == "insufficient data (confirmation seeds not run)"
    assert s["exploration"]["verdict"][0]["result"] == "holds"


def test_without_confirmation_seeds_every_seed_decides(tmp_path):
    root = tmp_path / "cmp"
    _study(root, confirm=False)
    write_report([root], plots=False)
    s = json.loads((root / "report" / "summary.json").read_text())
    assert "exploration" not in s and s["verdict"][0]["comparison"]["n"] == 8


def test_dropped_claims_are_listed_in_the_report(tmp_path):
    root = tmp_path / "cmp"
    _study(root, confirm=False, dropped_verdicts=[{"claim": "echo beats dapo", "reason": "arm(s) dapo not selected"}])
    md = write_report([root], plots=False).read_text()
    assert "- not evaluated (arm(s) dapo not selected): echo beats dapo" in md


def test_bca_rule_with_too_few_seeds_is_insufficient_data(tmp_path):
    root = tmp_path / "cmp"
    _study(root, confirm=False, report={"rule": "bca"})
    write_report([root], plots=False)
    s = json.loads((root / "report" / "summary.json").read_text())
    assert s["verdict"][0]["result"] == "insufficient data (the bca rule needs >= 30 paired seeds, got 8)"


def test_cli_report_of_a_study_with_confirmation_seeds(tmp_path, capsys):
    from echotrain.cli import main

    root = tmp_path / "cmp"
    _study(root)
    assert main(["compare", "report", str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Verdicts on the confirmation seeds 10-14." in md and "## Exploration seeds 0-2" in md
    (root / "compare.yaml").write_text((root / "compare.yaml").read_text() + "report: {correction: sidak}\n")
    assert main(["compare", "report", str(root), "--out", str(tmp_path / "out")]) == 2
    assert "correction='sidak' is not valid" in capsys.readouterr().err


def test_difference_of_differences_claim(tmp_path):
    """arm_ref / baseline_ref: per seed (a8 - a0) - (b8 - b0), by hand. AUC over steps 0..6 of
    (0, x, x, x) is 5x/6. echo loses 0.1 / 0.2 / 0.3 of x from k0 to k8, grpo 0.2 / 0.4 / 0.6."""
    root = tmp_path / "cmp"
    for seed, (e_loss, g_loss) in enumerate([(0.1, 0.2), (0.2, 0.4), (0.3, 0.6)]):
        make_run(root, "echo_k0", seed, (0.0, 0.6, 0.6, 0.6))
        make_run(root, "echo_k8", seed, (0.0,) + (0.6 - e_loss,) * 3)
        make_run(root, "grpo_k0", seed, (0.0, 0.6, 0.6, 0.6))
        make_run(root, "grpo_k8", seed, (0.0,) + (0.6 - g_loss,) * 3)
    claim = {"claim": "echo loses less AUC than grpo from k0 to k8", "arm": "echo_k8", "arm_ref": "echo_k0",
             "baseline": "grpo_k8", "baseline_ref": "grpo_k0", "statistic": "auc", "direction": "greater",
             "margin": 0.0}
    spec = {"name": "t", "baseline": "grpo_k0", "arms": {a: {} for a in ("grpo_k0", "grpo_k8", "echo_k0", "echo_k8")},
            "verdict": [claim]}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    write_report([root], plots=False)
    v = json.loads((root / "report" / "summary.json").read_text())["verdict"][0]
    # diffs: -(5/6)(0.1 - 0.2) = +0.0833, +0.1667, +0.25 -> mean 1/6, sd 1/12
    assert v["comparison"]["diffs"] == pytest.approx([5 / 60, 10 / 60, 15 / 60])
    assert v["comparison"]["diff_std"] == pytest.approx(1 / 12)
    from scipy import stats

    assert v["p"] == pytest.approx(stats.ttest_1samp([5 / 60, 10 / 60, 15 / 60], 0).pvalue)  # two-sided
    md = (root / "report" / "report.md").read_text()
    assert "| (echo_k8 - echo_k0) vs (grpo_k8 - grpo_k0) | auc |" in md
    # one reference missing: not run, naming it
    import shutil

    for seed in range(3):
        shutil.rmtree(root / "cells" / f"grpo_k0__s{seed}")
    write_report([root], plots=False)
    v = json.loads((root / "report" / "summary.json").read_text())["verdict"][0]
    assert v["result"] == "not run (grpo_k0 missing)"


def test_difference_of_differences_pairs_each_arm_with_its_own_reference(tmp_path):
    """Unequal references and a seed missing from one: per seed (e8 - e0) - (g8 - g0) in AUC
    units 5/6 of x for (0, x, x, x), only over the seeds all four arms have.
    e0: x = .6, .7 (no seed 2); e8: .5, .5, .5; g0: .3, .3, .3; g8: .1, .2, .3
    -> e8 - e0 = -.1, -.2; g8 - g0 = -.2, -.1; diffs (5/6)(+.1, -.1) on seeds 0, 1."""
    root = tmp_path / "cmp"
    xs = {"echo_k0": (0.6, 0.7), "echo_k8": (0.5, 0.5, 0.5), "grpo_k0": (0.3, 0.3, 0.3), "grpo_k8": (0.1, 0.2, 0.3)}
    for arm, per_seed in xs.items():
        for seed, x in enumerate(per_seed):
            make_run(root, arm, seed, (0.0, x, x, x))
    claim = {"claim": "dd", "arm": "echo_k8", "arm_ref": "echo_k0", "baseline": "grpo_k8", "baseline_ref": "grpo_k0",
             "statistic": "auc", "direction": "greater", "margin": 0.0}
    spec = {"name": "t", "baseline": "grpo_k0", "arms": {a: {} for a in xs}, "verdict": [claim]}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    write_report([root], plots=False)
    comp = json.loads((root / "report" / "summary.json").read_text())["verdict"][0]["comparison"]
    assert comp["n"] == 2 and comp["seeds"] == [0, 1]
    assert comp["diffs"] == pytest.approx([5 / 60, -5 / 60])
    assert comp["arm_mean"] == pytest.approx(5 / 6 * -0.15) and comp["base_mean"] == pytest.approx(5 / 6 * -0.15)


def test_samples_per_step_counts_every_generate_round(tmp_path):
    """Dynamic sampling's cost: completions generated a step = mean sampling_rounds x B x G."""
    root = tmp_path / "cmp"
    for arm, rounds in (("grpo", [1, 1, 1, 1, 1, 1]), ("dapo", [1, 2, 3, 2, 1, 3])):
        d = make_run(root, arm, 0, (0.0, 0.2, 0.2, 0.2))
        (d / "config.yaml").write_text(yaml.safe_dump({"preset": arm, "seed": 0, "steps": 6, "prompts_per_step": 4,
                                                       "num_generations": 8}))
        recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        (d / "metrics.jsonl").write_text("".join(json.dumps({**r, "sampling_rounds": k}) + "\n"
                                                 for r, k in zip(recs, rounds)))
    (root / "compare.yaml").write_text(yaml.safe_dump({"name": "t", "baseline": "grpo",
                                                       "arms": {"grpo": {}, "dapo": {}}}))
    path = write_report([root], plots=False)
    arms = json.loads((root / "report" / "summary.json").read_text())["arms"]
    assert arms["grpo"]["samples_per_step"]["mean"] == 32.0
    assert arms["dapo"]["samples_per_step"]["mean"] == pytest.approx(32 * 12 / 6)  # 64
    row = next(line for line in path.read_text().splitlines() if line.startswith("| dapo | 1 |"))
    assert row.split(" | ")[-2] == "64"


def test_paired_table_names_arms_without_a_common_seed_instead_of_rows_of_na(comparison):
    make_run(comparison, "dapo", 7, (0.0, 0.2, 0.2, 0.2))  # seed 7: the baseline has no run of it
    spec = yaml.safe_load((comparison / "compare.yaml").read_text())
    spec["arms"]["dapo"] = {}
    (comparison / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    text = write_report([comparison], plots=False).read_text()
    paired = text.split("## Paired comparison")[1].split("## ")[0]
    assert "| echo | auc | 3 |" in paired and "| dapo |" not in paired
    assert "No seed in common with the baseline here: dapo." in paired


def test_any_flag_claim_on_three_seeds_is_not_a_verdict(tmp_path):
    """Every echo run flagged, no grpo run: differences (1, 1, 1). Was p = 0, "holds" at n = 3."""
    for seed in range(3):
        make_run(tmp_path / "f", "grpo", seed, (0.0, 0.2, 0.2, 0.2))
        make_run(tmp_path / "f", "echo", seed, (0.4, 0.1, 0.1, 0.1))  # accuracy collapse: flagged
    spec = {"name": "f", "baseline": "grpo", "arms": {"grpo": {}, "echo": {}},
            "verdict": [{"claim": "echo raises more flags", "arm": "echo", "baseline": "grpo",
                         "statistic": "any_flag", "direction": "greater", "margin": 0.0}]}
    (tmp_path / "f" / "compare.yaml").write_text(yaml.safe_dump(spec))
    md = write_report([tmp_path / "f"], plots=False).read_text()
    v = json.loads((tmp_path / "f" / "report" / "summary.json").read_text())["verdict"][0]
    assert v["comparison"]["diffs"] == [1.0, 1.0, 1.0] and v["p"] == 0.25 and v["result"] == "inconclusive"
    assert "**inconclusive: every paired difference is equal (no variation to test)**" in md
    assert "the p-value is the exact sign test's, 2^(1-n): no verdict below 6 seeds." in md


def test_a_difference_within_float_noise_prints_as_zero(tmp_path):
    """Final accuracy 0.1 + 0.2 against 0.3 on every seed: a difference of 5.55e-17, printed 0."""
    root = tmp_path / "n"
    for seed in range(3):
        make_run(root, "grpo", seed, (0.0, 0.1, 0.2, 0.3))
        make_run(root, "echo", seed, (0.0, 0.1, 0.2, 0.1 + 0.2))
    spec = {"name": "n", "baseline": "grpo", "arms": {"grpo": {}, "echo": {}},
            "verdict": [{"claim": "echo ends higher", "arm": "echo", "baseline": "grpo", "statistic": "final",
                         "direction": "greater", "margin": 0.0}]}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec))
    md = write_report([root], plots=False).read_text()
    s = json.loads((root / "report" / "summary.json").read_text())
    assert s["paired"]["echo"]["final"]["diff_mean"] == pytest.approx(5.551115123125783e-17, rel=1e-6)
    assert "e-17" not in md
    assert "| echo | final | 3 | 0.3 | 0.3 | 0 [0, 0] |" in md
    assert "| echo ends higher | echo vs grpo | final | greater (0.0) | 3 | 0 [0, 0] |" in md


def test_study_whose_confirmation_has_not_run_opens_with_the_exploration(tmp_path):
    """Issue 36: no empty summary / comparison tables before the screening's results."""
    from echotrain.cli import main

    root = tmp_path / "cmp"
    _study(root)
    for seed in range(10, 15):
        for arm in ("grpo", "echo"):
            (root / "cells" / f"{arm}__s{seed}" / "stability.json").unlink()  # not finished
    assert main(["compare", "report", str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Summary" not in md and "## Paired comparison" not in md
    assert ("Seeds: exploration 0-2; the confirmation seeds 10-14 have not run yet. Below: the exploration results "
            "(a screening, not verdicts); the verdicts wait for the confirmation seeds.") in md
    explo, rule = md.index("## Exploration seeds 0-2"), md.index("## Verdict rule")
    assert explo < rule
    table = md[explo:rule]
    assert "| grpo | 3 |" in table and "| echo | 3 |" in table  # the exploration rows, first
    assert "**insufficient data (confirmation seeds not run)**" in md[rule:]
    # once the confirmation seeds have run: summary first, exploration at the end (as before)
    _study(tmp_path / "done")
    md = write_report([tmp_path / "done"], plots=False).read_text()
    assert md.index("## Summary (confirmation seeds)") < md.index("## Verdict rule") < md.index("## Exploration seeds")


def test_a_confirmation_without_exploration_runs_has_no_empty_exploration_section(tmp_path):
    """A study that confirms a screening run elsewhere (only its confirmation seeds ran here): no empty
    "Exploration seeds none" section, and the seeds line says so."""
    root = tmp_path / "cmp"
    _study(root)
    import shutil

    for seed in range(3):
        for arm in ("grpo", "echo"):
            shutil.rmtree(root / "cells" / f"{arm}__s{seed}")
    md = write_report([root], plots=False).read_text()
    assert "Exploration seeds" not in md
    assert "Seeds: confirmation 10-14 only (no exploration seed ran in this comparison)." in md
    assert md.index("## Summary (confirmation seeds)") < md.index("## Verdict rule")


def test_sweep_report_has_a_dose_response_figure_and_table(tmp_path, monkeypatch):
    """Issue 36: every report of a sweep plots AUC and final against the sweep value, one line per
    arm, with the mean's t-interval and the change from the first value, paired by seed (numbers by
    hand: final = x, AUC = 5x/6 for the accuracies (0, x, x, x) at steps 0, 2, 4, 6)."""
    from echotrain.cli import main
    from tests.train.test_plots import _spy_figures

    root = tmp_path / "sw"
    finals = {("grpo", 0): (0.30, 0.36, 0.33), ("grpo", 2): (0.30, 0.30, 0.30), ("grpo", 8): (0.24, 0.30, 0.21),
              ("echo", 0): (0.40, 0.40, 0.40), ("echo", 2): (0.42, 0.44, 0.40), ("echo", 8): (0.40, 0.40, 0.40)}
    for (arm, k), xs in finals.items():
        for seed, x in enumerate(xs):
            make_run(root, f"{arm}[staleness={k}]", seed, (0.0, x, x, x))
    spec = {"name": "sw", "baseline": "grpo[staleness=0]", "arms": {"grpo": {}, "echo": {}},
            "sweep": {"name": "staleness", "keys": ["staleness"], "values": [0, 2, 8]}}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    seen = _spy_figures(monkeypatch)
    assert main(["compare", "report", str(root), "--out", str(tmp_path / "out")]) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    dose = s["dose_response"]
    assert dose["sweep"] == "staleness" and dose["values"] == [0, 2, 8] and dose["seeds"] == [0, 1, 2]
    g = dose["statistics"]["final"]["grpo"]
    assert [p["value"] for p in g] == [0, 2, 8]
    half = 4.302653 * 0.03 / math.sqrt(3)  # t_{0.975, 2} x sd 0.03 / sqrt(3)
    assert g[0]["mean"] == pytest.approx(0.33) and g[0]["ci_low"] == pytest.approx(0.33 - half, rel=1e-5)
    assert g[0]["change"] == {"n": 3, "diff_mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    # k = 2 - k = 0 per seed: (0, -0.06, -0.03): mean -0.03, sd 0.03
    assert g[1]["change"]["diff_mean"] == pytest.approx(-0.03)
    assert g[1]["change"]["ci_low"] == pytest.approx(-0.03 - half, rel=1e-5)
    assert g[1]["change"]["ci_high"] == pytest.approx(-0.03 + half, rel=1e-5)
    a = dose["statistics"]["auc"]["grpo"]
    assert a[1]["change"]["diff_mean"] == pytest.approx(-0.025) and a[2]["mean"] == pytest.approx(0.75 * 5 / 6 / 3)
    assert dose["statistics"]["final"]["echo"][2]["change"]["diff_mean"] == 0.0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Dose-response: the statistics against `staleness` (every seed run)" in md
    assert "Per arm, on seeds 0-2 (every seed run): the mean over seeds and, in parentheses, the change from " \
           "`staleness=0` paired by seed [95% paired t-interval]." in md
    assert "![dose_response](plots/dose_response.png)" in md
    assert "| grpo | final | 0.33 | 0.3 (-0.03 [-0.105, 0.0445]) | 0.25 (-0.08 [" in md
    assert "| echo | final | 0.4 | 0.42 (+0.02 [" in md and "| 0.4 (0 [0, 0]) |" in md
    assert (tmp_path / "out" / "plots" / "dose_response.png").is_file()
    (fig,) = [f for p, f in seen.items() if p.endswith("dose_response.png")]
    assert len(fig.axes) == 4  # (level, change) x (AUC, final)
    top = fig.axes[0]
    assert [t.get_text() for t in top.get_xticklabels()] == ["0", "2", "8"]
    assert sorted(c.get_label() for c in top.containers) == ["echo (n=3)", "grpo (n=3)"]
    # the curves of the sweep: grpo's three values share a colour, echo has another
    (curve,) = [f for p, f in seen.items() if p.endswith("eval_accuracy.png")]
    colours = {ln.get_label().split("[")[0]: set() for ln in curve.axes[0].get_lines()}
    for ln in curve.axes[0].get_lines():
        colours[ln.get_label().split("[")[0]].add(ln.get_color())
    assert len(colours["grpo"]) == 1 and len(colours["echo"]) == 1 and colours["grpo"] != colours["echo"]


def test_report_without_a_sweep_has_no_dose_response(comparison):
    md = write_report([comparison], plots=False).read_text()
    assert "Dose-response" not in md
    assert "dose_response" not in json.loads((comparison / "report" / "summary.json").read_text())


def test_dose_response_of_a_confirmed_study_is_on_the_confirmation_seeds(tmp_path):
    """With confirmation seeds run: the dose-response is on them; the screening's goes with the
    exploration section. grpo's final: x at k = 0, x - 0.1 at k = 8 on the exploration seeds
    (change -0.1), x - 0.02 on the confirmation seeds (change -0.02)."""
    root = tmp_path / "c"
    for seed, x in zip((0, 1, 2, 10, 11, 12), (0.30, 0.32, 0.34, 0.40, 0.42, 0.44)):
        make_run(root, "grpo[k=0]", seed, (0.0, x, x, x))
        make_run(root, "grpo[k=8]", seed, (0.0,) + (x - (0.1 if seed < 10 else 0.02),) * 3)
    spec = {"name": "c", "baseline": "grpo[k=0]", "arms": {"grpo": {}}, "seeds": [0, 1, 2],
            "confirm_seeds": [10, 11, 12], "sweep": {"name": "k", "keys": ["staleness"], "values": [0, 8]}}
    (root / "compare.yaml").write_text(yaml.safe_dump(spec))
    md = write_report([root]).read_text()
    s = json.loads((root / "report" / "summary.json").read_text())
    conf, expl = s["dose_response"], s["exploration"]["dose_response"]
    assert conf["seeds"] == [10, 11, 12] and expl["seeds"] == [0, 1, 2]
    assert conf["statistics"]["final"]["grpo"][1]["change"]["diff_mean"] == pytest.approx(-0.02)
    assert expl["statistics"]["final"]["grpo"][1]["change"]["diff_mean"] == pytest.approx(-0.1)
    assert (root / "report" / "plots" / "dose_response_exploration.png").is_file()
    first = md.index("## Dose-response: the statistics against `k` (confirmation seeds)")
    second = md.index("## Dose-response: the statistics against `k` (exploration seeds)")
    assert md.index("## Summary") < first < md.index("## Exploration seeds") < second
    assert "![dose_response](plots/dose_response_exploration.png)" in md[second:]
