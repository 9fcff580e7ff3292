"""Stability flags on synthetic curves."""

import math

import pytest

from echotrain.train.stability import StabilityThresholds, format_flags, stability_flags


def records(n=20, length=None, entropy=None, grad=None, extra=None):
    out = []
    for i in range(n):
        r = {"step": i + 1, "response_length/mean": length(i) if length else 20.0,
             "entropy": entropy(i) if entropy else 1.0, "grad_norm": grad(i) if grad else 1.0, "pg_loss": 0.1}
        if extra:
            r.update(extra(i))
        out.append(r)
    return out


def test_a_steady_run_raises_nothing():
    res = stability_flags(records())
    assert res["flags"] == {"nan": False, "length_collapse": False, "entropy_collapse": False,
                            "grad_explosion": False, "accuracy_collapse": None}  # no evaluations: not judged
    assert res["any"] is False and format_flags(res) == "none (not judged: accuracy_collapse)"
    evals = [{"step": 0, "eval/accuracy": 0.3}, {"step": 20, "eval/accuracy": 0.32}]
    assert stability_flags(records(), evals=evals)["flags"]["accuracy_collapse"] is False


def test_length_collapse():
    # first 3 steps (10% of 20 -> min window 3) mean 20; last 3 steps mean 4 < 0.5 * 20
    res = stability_flags(records(length=lambda i: 20.0 if i < 10 else 4.0))
    assert res["flags"]["length_collapse"] is True
    assert res["values"]["length_collapse"]["ratio"] == pytest.approx(0.2)
    # shrinking to 11/20 = 0.55 of the start is not a collapse at ratio 0.5
    assert stability_flags(records(length=lambda i: 20.0 if i < 10 else 11.0))["flags"]["length_collapse"] is False


def test_entropy_collapse():
    res = stability_flags(records(entropy=lambda i: 1.0 if i < 5 else 0.05))
    assert res["flags"]["entropy_collapse"] is True and res["flags"]["length_collapse"] is False
    assert stability_flags(records(entropy=lambda i: 1.0 if i < 5 else 0.2))["flags"]["entropy_collapse"] is False
    # the flag says which knobs a user would turn, in the summary line and stability.json
    from echotrain.train.stability import format_flags

    line = format_flags(res)
    assert line.startswith("entropy_collapse (turn: ") and all(
        k in line for k in ("entropy_coeff", "entropy_coef", "use_adaptive_entropy", "top_entropy_quantile"))
    assert set(res["remedies"]) == {"entropy_collapse"}
    assert stability_flags(records())["remedies"] == {}


def test_grad_explosion_is_relative_to_the_start():
    res = stability_flags(records(grad=lambda i: 50.0 if i == 15 else 2.0))
    assert res["flags"]["grad_explosion"] is True
    assert res["values"]["grad_explosion"] == {"start_median": 2.0, "max": 50.0, "ratio": 25.0}
    assert stability_flags(records(grad=lambda i: 19.0 if i == 15 else 2.0))["flags"]["grad_explosion"] is False
    th = StabilityThresholds(grad_factor=5.0)
    assert stability_flags(records(grad=lambda i: 19.0 if i == 15 else 2.0), th)["flags"]["grad_explosion"] is True


def test_nan_anywhere():
    res = stability_flags(records(extra=lambda i: {"pg_loss": math.nan} if i == 7 else {}))
    assert res["flags"]["nan"] is True and res["values"]["nan_first"] == {"step": 8, "key": "pg_loss"}
    assert "nan" in format_flags(res)


def test_long_runs_use_ten_percent_windows():
    # 100 steps: windows of 10; the length falls at step 95, so the last 10 average 0.5*20 + 0.5*2 = 11 > 10
    res = stability_flags(records(n=100, length=lambda i: 20.0 if i < 95 else 2.0))
    assert res["values"]["length_collapse"]["end"] == pytest.approx(11.0)
    assert res["flags"]["length_collapse"] is False


def test_short_runs_are_not_judged():
    res = stability_flags(records(n=5))
    assert res["flags"]["length_collapse"] is None and res["flags"]["grad_explosion"] is None
    assert res["flags"]["nan"] is False and "not judged" in format_flags(res)


def test_bad_thresholds_raise():
    with pytest.raises(ValueError, match="length_ratio"):
        StabilityThresholds(length_ratio=0)
    with pytest.raises(ValueError, match="grad_factor"):
        StabilityThresholds(grad_factor=1.0)


def evals(*acc, every=5):
    return [{"step": every * i, "eval/accuracy": a, "eval/format_rate": 1.0} for i, a in enumerate(acc)]


def test_accuracy_collapse_needs_half_and_ten_points():
    # the measured off-policy collapse: 0.28 at the start, 0.05 at the end (< 0.14 and 23 points down)
    res = stability_flags(records(), evals=evals(0.28, 0.10, 0.06, 0.05))
    assert res["flags"]["accuracy_collapse"] is True and res["any"] is True
    assert res["values"]["accuracy_collapse"] == {"start_step": 0, "start": 0.28, "end_step": 15, "end": 0.05,
                                                  "drop": pytest.approx(0.23)}
    assert "accuracy_collapse" in format_flags(res)
    # below half but only 6 points down: noise on a few hundred prompts, not a collapse
    assert stability_flags(records(), evals=evals(0.10, 0.04))["flags"]["accuracy_collapse"] is False
    # 30 points down but not below half of the start
    assert stability_flags(records(), evals=evals(0.90, 0.60))["flags"]["accuracy_collapse"] is False
    # exactly 10 points and below half: 0.18 -> 0.08 (ratio 0.44)
    assert stability_flags(records(), evals=evals(0.18, 0.08))["flags"]["accuracy_collapse"] is True
    # the end counts, not the worst point: a dip that recovers is no collapse
    assert stability_flags(records(), evals=evals(0.30, 0.02, 0.29))["flags"]["accuracy_collapse"] is False
    # thresholds are settings
    th = StabilityThresholds(accuracy_ratio=0.8, accuracy_drop=0.05)
    assert stability_flags(records(), th, evals=evals(0.50, 0.38))["flags"]["accuracy_collapse"] is True
    assert "0.8 x the first" in th.describe()["accuracy_collapse"]


def test_accuracy_collapse_reads_the_step_records_without_eval_jsonl():
    recs = records(extra=lambda i: {"eval/accuracy": 0.4 if i == 4 else 0.1} if i in (4, 19) else {})
    res = stability_flags(recs)
    assert res["flags"]["accuracy_collapse"] is True
    assert res["values"]["accuracy_collapse"]["start_step"] == 5 and res["values"]["accuracy_collapse"]["end_step"] == 20
    one = stability_flags(records(), evals=evals(0.3))
    assert one["flags"]["accuracy_collapse"] is None  # one evaluation: not judged


def test_bad_accuracy_thresholds_raise():
    with pytest.raises(ValueError, match="accuracy_ratio"):
        StabilityThresholds(accuracy_ratio=1.5)
    with pytest.raises(ValueError, match="accuracy_drop"):
        StabilityThresholds(accuracy_drop=0)
