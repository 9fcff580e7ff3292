"""Tests of the looped-lr experiment: the CI-sized sweep end to end, resuming, and the analysis."""

from __future__ import annotations

import json
import math

import pytest

from echotrain.cli import main
from echotrain.experiments.looped_lr import (
    LoopedLRArgs,
    best_lrs,
    format_loss_grid,
    load_corpus,
    load_records,
    lr_at,
    run_sweep,
    short_args,
    verdict,
)


def test_short_sweep_via_cli_trains_shares_N1_and_resumes(tmp_path):
    out = tmp_path / "looped"
    assert main(["experiment", "looped-lr", "--short", "--out-dir", str(out)]) == 0
    records = load_records(out)
    # N=1 and N=2 for both rules, 3 learning rates each
    assert len(records) == 12
    by_key = {(r["rule"], r["n_loops"], r["lr"]): r for r in records}
    for r in records:
        assert r["val_loss"] is not None and math.isfinite(r["val_loss"])
        assert r["val_loss"] < math.log(256) - 0.5  # it learned something beyond uniform bytes
        assert r["eps"] == pytest.approx(1 / r["n_loops"] if r["rule"] == "1/N" else 1 / math.sqrt(r["n_loops"]))
    for lr in (1e-3, 4e-3, 1.6e-2):
        # at N = 1 every rule gives eps = 1: one run, shared
        a, b = by_key[("1/N", 1, lr)], by_key[("1/sqrt(N)", 1, lr)]
        assert a["val_loss"] == b["val_loss"] and b["shared_with"] == "1/N"
        # at N = 2 the rules differ, and so do the runs
        assert by_key[("1/N", 2, lr)]["val_loss"] != by_key[("1/sqrt(N)", 2, lr)]["val_loss"]
    # 30 steps: the largest learning rate of the short grid goes furthest
    assert by_key[("1/N", 1, 1.6e-2)]["val_loss"] < by_key[("1/N", 1, 1e-3)]["val_loss"] - 0.5

    summary = json.loads((out / "summary.json").read_text())
    best = summary["best"]["1"]["1/N"]["1"]
    assert best["argmin_lr"] == min((r for r in records if r["rule"] == "1/N" and r["n_loops"] == 1), key=lambda r: r["val_loss"])["lr"]
    assert (out / "loss_vs_lr.png").stat().st_size > 10_000

    # a second call finds every run on disk and trains nothing
    logged = []
    again = run_sweep(short_args(str(out)), log=logged.append)
    assert logged == [] and sorted(r["val_loss"] for r in again) == sorted(r["val_loss"] for r in records)


def test_changed_options_are_not_resumed_from_disk(tmp_path):
    args = LoopedLRArgs(out_dir=str(tmp_path), n_loops=[1], rules=["1/N"], lrs=[1e-3], d_model=16, n_heads=2,
                        seq_len=8, batch_size=2, steps=3, warmup_steps=1, eval_sequences=2)
    first = run_sweep(args, log=lambda s: None)
    args.steps = 4
    logged = []
    second = run_sweep(args, log=logged.append)
    assert len(logged) == 1 and second[0]["fingerprint"]["steps"] == 4 != first[0]["fingerprint"]["steps"]


def records_from(loss_fn, rules=("1/N", "1/sqrt(N)"), ns=(1, 2, 4, 8), lrs=tuple(2.0**k * 1e-3 for k in range(-3, 4))):
    return [
        {"n_layers": 1, "rule": rule, "n_loops": n, "lr": lr, "val_loss": loss_fn(rule, n, lr)}
        for rule in rules for n in ns for lr in lrs
    ]


def test_best_lr_parabola_fit_recovers_the_vertex():
    # loss exactly quadratic in log2(lr) with its minimum at 3e-3 (between grid points 2e-3 and 4e-3)
    recs = records_from(lambda rule, n, lr: 2.0 + 0.1 * (math.log2(lr) - math.log2(3e-3)) ** 2)
    best = best_lrs(recs)[1]["1/N"][4]
    assert best["argmin_lr"] == pytest.approx(4e-3)
    assert best["fit_lr"] == pytest.approx(3e-3, rel=1e-9)
    # minimum on the grid's edge: no fit beyond the grid
    edge = best_lrs(records_from(lambda rule, n, lr: -math.log(lr)))[1]["1/N"][1]
    assert edge["fit_lr"] == edge["argmin_lr"] == pytest.approx(8e-3)


def test_best_lr_leaves_out_incomplete_grids():
    recs = [r for r in records_from(lambda rule, n, lr: lr) if not (r["n_loops"] == 8 and r["lr"] > 5e-3)]
    best = best_lrs(recs)[1]
    assert sorted(best["1/N"]) == [1, 2, 4] and sorted(best["1/sqrt(N)"]) == [1, 2, 4]


def test_best_lr_skips_diverged_runs():
    recs = records_from(lambda rule, n, lr: None if lr > 3e-3 else 2.0 - lr)
    best = best_lrs(recs)[1]["1/N"][1]
    assert best["argmin_lr"] == pytest.approx(2e-3) and best["fit_lr"] == pytest.approx(2e-3)
    grid = format_loss_grid(recs)
    assert "| 8 | 2.000 | 2.000 | 2.000 | 1.999 | 1.998 | div. | div. |" in grid  # rows N, columns lr
    assert grid.count("| N |") == 2


def test_verdict_holds_only_when_the_optimum_stays_put_under_1_over_N():
    def bowl(opt_of):
        return lambda rule, n, lr: (math.log2(lr) - math.log2(opt_of(rule, n))) ** 2

    # 1/N: optimum fixed at 2e-3; 1/sqrt(N): moves down like 1/sqrt(N) (1.5 log2 units at N = 8)
    good = verdict(best_lrs(records_from(bowl(lambda rule, n: 2e-3 if rule == "1/N" else 2e-3 / math.sqrt(n)))))
    assert good[1]["claim_holds"] is True
    assert good[1]["rules"]["1/N"]["shift_grid"] == 0
    assert good[1]["rules"]["1/sqrt(N)"]["spread_fit"] == pytest.approx(1.5, abs=1e-6)
    assert good[1]["rules"]["1/sqrt(N)"]["slope_fit"] == pytest.approx(-0.5, abs=1e-6)
    assert good[1]["rules"]["1/N"]["slope_fit"] == pytest.approx(0.0, abs=1e-9)
    # the reverse: the optimum drifts under 1/N
    bad = verdict(best_lrs(records_from(bowl(lambda rule, n: 2e-3 / n if rule == "1/N" else 2e-3 / math.sqrt(n)))))
    assert bad[1]["claim_holds"] is False


def test_lr_schedule_warms_up_then_decays_to_zero():
    assert lr_at(0, 1.0, warmup=4, total=20) == 0.25
    assert lr_at(3, 1.0, warmup=4, total=20) == 1.0
    assert lr_at(4, 1.0, warmup=4, total=20) == 1.0
    assert lr_at(12, 1.0, warmup=4, total=20) == pytest.approx(0.5)
    assert lr_at(20, 1.0, warmup=4, total=20) == pytest.approx(0.0, abs=1e-12)


def test_corpus_is_the_pydoc_topics_bytes():
    train, val = load_corpus()
    assert len(train) > 300_000 and len(val) == int((len(train) + len(val)) * 0.1)
    assert bytes(train[:22].tolist()) == b'The "assert" statement'  # the first topic in sorted order


def test_bad_options_raise():
    with pytest.raises(ValueError, match=r"rules: '1/L' is unknown"):
        run_sweep(LoopedLRArgs(rules=["1/L"]))
    with pytest.raises(ValueError, match="lrs"):
        run_sweep(LoopedLRArgs(lrs=[0.0]))


def test_cli_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "looped-lr", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--n-loops", "--rules", "--lrs", "--short", "--summarize-only", "--eval-sequences"):
        assert flag in text
