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
                            "grad_explosion": False}
    assert res["any"] is False and format_flags(res) == "none"


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
