"""echotrain.compare.stats against hand-computed values."""

import itertools
import math

import numpy as np
import pytest

from echotrain.compare.stats import (
    auc,
    bootstrap_ci,
    evaluate_claim,
    mean_std_ci,
    paired_comparison,
    steps_to_threshold,
)


def test_mean_std_of_a_vector():
    out = mean_std_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert out["n"] == 5 and out["mean"] == 3.0
    assert out["std"] == pytest.approx(math.sqrt(2.5))  # sample std, ddof 1: sum sq dev 10 / 4
    assert out["ci_low"] < 3.0 < out["ci_high"]


def test_bootstrap_interval_of_two_points_is_their_range():
    # resampled means of (0, 1): 0 (p 1/4), 0.5 (1/2), 1 (1/4) -> 2.5% and 97.5% percentiles are 0 and 1
    lo, hi = bootstrap_ci([0.0, 1.0])
    assert float(lo) == 0.0 and float(hi) == 1.0


def test_bootstrap_interval_matches_the_exact_resampling_distribution():
    x = [0.0, 0.0, 3.0, 6.0]
    means = sorted(np.mean(s) for s in itertools.product(x, repeat=len(x)))  # all 256 equally likely resamples
    cdf = np.arange(1, len(means) + 1) / len(means)
    exact_lo = means[int(np.searchsorted(cdf, 0.025))]
    exact_hi = means[int(np.searchsorted(cdf, 0.975))]
    lo, hi = bootstrap_ci(x)
    assert float(lo) == pytest.approx(exact_lo, abs=0.26)  # resampled means are on a grid of 0.75
    assert float(hi) == pytest.approx(exact_hi, abs=0.26)


def test_curves_are_aggregated_per_step():
    out = mean_std_ci([[1.0, 2.0], [3.0, 2.0], [5.0, 2.0]])
    assert out["mean"] == [3.0, 2.0]
    assert out["std"] == pytest.approx([2.0, 0.0])
    assert out["ci_low"][1] == out["ci_high"][1] == 2.0  # a constant column: the interval is the point


def test_one_seed_has_no_interval_and_zero_std():
    out = mean_std_ci([0.7])
    assert out["std"] == 0.0 and math.isnan(out["ci_low"]) and math.isnan(out["ci_high"])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="no values"):
        mean_std_ci([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="increasing"):
        auc([0, 0], [1, 1])
    with pytest.raises(ValueError, match="equal length"):
        steps_to_threshold([0, 1], [1], 0.5)


def test_auc_is_the_trapezoid_area_over_the_span():
    # area = (0+1)/2*10 + (1+1)/2*20 = 25 over a span of 30
    assert auc([0, 10, 30], [0.0, 1.0, 1.0]) == pytest.approx(25 / 30)
    assert auc([0, 10, 30], [0.0, 1.0, 1.0], normalize=False) == pytest.approx(25.0)
    assert auc([5], [0.4]) == 0.4


def test_steps_to_threshold():
    assert steps_to_threshold([0, 10, 20, 30], [0.1, 0.3, 0.5, 0.2], 0.3) == 10
    assert steps_to_threshold([0, 10, 20, 30], [0.1, 0.3, 0.5, 0.2], 0.45) == 20
    assert steps_to_threshold([0, 10], [0.1, 0.2], 0.9) is None


def test_paired_comparison_pairs_by_seed():
    arm = {0: 2.0, 1: 4.0, 2: 6.0, 9: 100.0}  # seed 9 has no baseline: dropped
    base = {0: 1.0, 1: 2.0, 2: 3.0}
    c = paired_comparison(arm, base)
    assert c["seeds"] == [0, 1, 2] and c["n"] == 3
    assert c["diff_mean"] == pytest.approx(2.0) and c["diff_std"] == pytest.approx(1.0)
    # paired t: t = 2 / (1 / sqrt 3) = 3.4641 with 2 dof; two-sided p = 1 - t / sqrt(2 + t^2) for 2 dof
    t = 2 / (1 / math.sqrt(3))
    assert c["p_paired_t"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)
    assert c["ci_low"] >= 1.0 and c["ci_high"] <= 3.0
    assert 0 < c["p_welch"] < 1


def test_verdict_rule():
    def comp(lo, hi, n=5):
        return {"n": n, "ci_low": lo, "ci_high": hi}

    assert evaluate_claim(comp(0.01, 0.2), "greater") == "holds"
    assert evaluate_claim(comp(0.01, 0.2), "greater", margin=0.05) == "inconclusive"
    assert evaluate_claim(comp(-0.3, -0.1), "greater") == "contradicted"
    assert evaluate_claim(comp(-0.1, 0.2), "greater") == "inconclusive"
    assert evaluate_claim(comp(-0.3, -0.1), "less") == "holds"
    assert evaluate_claim(comp(0.1, 0.3), "less") == "contradicted"
    assert evaluate_claim(comp(0.1, 0.3, n=1), "greater") == "insufficient data"
    with pytest.raises(ValueError, match="direction"):
        evaluate_claim(comp(0, 1), "bigger")
