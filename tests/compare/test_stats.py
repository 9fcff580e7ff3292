"""echotrain.compare.stats against hand-computed values."""

import itertools
import math

import numpy as np
import pytest

from echotrain.compare.stats import (
    BCA_MIN_N,
    auc,
    bca_bootstrap,
    bootstrap_ci,
    claim_pvalue,
    evaluate_claim,
    evaluate_claims,
    holm_adjust,
    mean_std_ci,
    min_detectable_effect,
    paired_comparison,
    steps_to_threshold,
    t_interval,
    t_pvalue,
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
    assert c["seeds"] == [0, 1, 2] and c["n"] == 3 and c["diffs"] == [1.0, 2.0, 3.0]
    assert c["diff_mean"] == pytest.approx(2.0) and c["diff_std"] == pytest.approx(1.0)
    # paired t: t = 2 / (1 / sqrt 3) = 3.4641 with 2 dof; two-sided p = 1 - t / sqrt(2 + t^2) for 2 dof
    t = 2 / (1 / math.sqrt(3))
    assert c["p_paired_t"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)
    # t interval: 2 -+ t_{0.975, 2} / sqrt 3 with t_{0.975, 2} = 4.302653 (the t table)
    assert c["ci_low"] == pytest.approx(2 - 4.302653 / math.sqrt(3), abs=1e-6)
    assert c["ci_high"] == pytest.approx(2 + 4.302653 / math.sqrt(3), abs=1e-6)
    assert 0 < c["p_welch"] < 1
    assert c["mde"] == pytest.approx(min_detectable_effect(1.0, 3))
    only = paired_comparison(arm, base, seeds=[1, 2])  # e.g. the confirmation seeds
    assert only["seeds"] == [1, 2] and only["diff_mean"] == pytest.approx(2.5)


def test_t_interval_and_p_value_by_hand():
    # d = (0.1, 0.3, 0.2, 0.6): mean 0.3, sum sq dev 0.14, s = sqrt(0.14 / 3); t_{0.975, 3} = 3.182446
    d = [0.1, 0.3, 0.2, 0.6]
    s = math.sqrt(0.14 / 3)
    lo, hi = t_interval(d)
    assert float(lo) == pytest.approx(0.3 - 3.182446 * s / 2, abs=1e-6)
    assert float(hi) == pytest.approx(0.3 + 3.182446 * s / 2, abs=1e-6)
    lo90, hi90 = t_interval(d, 0.9)  # t_{0.95, 3} = 2.353363
    assert float(hi90) == pytest.approx(0.3 + 2.353363 * s / 2, abs=1e-6)
    from scipy import stats

    assert float(t_pvalue(d)) == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue)
    assert float(t_pvalue(d, 0.1)) == pytest.approx(stats.ttest_1samp(d, 0.1).pvalue)
    # vectorised over leading axes, equal to row by row
    rows = np.array([d, [0.0, 0.1, -0.1, 0.05], [1.0, 1.0, 1.0, 1.0]])
    lo_v, hi_v = t_interval(rows)
    assert lo_v.shape == (3,) and float(lo_v[0]) == pytest.approx(float(lo))
    assert lo_v[2] == hi_v[2] == 1.0  # all equal: the point
    assert t_pvalue(rows)[2] == 0.0 and float(t_pvalue([1.0, 1.0], 1.0)) == 1.0
    assert math.isnan(float(t_interval([0.4])[0])) and math.isnan(float(t_pvalue([0.4])))
    with pytest.raises(ValueError, match="finite"):
        t_interval([0.1, float("inf")])


def test_min_detectable_effect():
    # the study audit's numbers: SD 0.0186 of per-seed AUC differences, 80% power, two-sided 5%
    for n, want in ((3, 0.061), (5, 0.031), (10, 0.019), (20, 0.012), (30, 0.0098)):
        assert min_detectable_effect(0.0186, n) == pytest.approx(want, abs=6e-4 if n < 30 else 1e-4)
    # larger than the normal approximation (z_0.975 + z_0.8) sd / sqrt n, converging to it
    assert min_detectable_effect(1.0, 5) / (2.8016 / math.sqrt(5)) == pytest.approx(1.342, abs=2e-3)
    assert min_detectable_effect(1.0, 400) / (2.8016 / math.sqrt(400)) == pytest.approx(1.0, abs=5e-3)
    assert min_detectable_effect(2.0, 7) == pytest.approx(2 * min_detectable_effect(1.0, 7))  # linear in sd
    assert min_detectable_effect(1.0, 5, alpha=0.01) > min_detectable_effect(1.0, 5)
    assert min_detectable_effect(0.0, 5) == 0.0 and math.isnan(min_detectable_effect(1.0, 1))
    with pytest.raises(ValueError, match="power"):
        min_detectable_effect(1.0, 5, power=1.0)


def test_min_detectable_effect_has_its_power_by_simulation():
    # independent of scipy's noncentral t: simulate paired studies with true difference = MDE (sd 1)
    rng = np.random.default_rng(7)
    for n in (3, 5, 10):
        delta = min_detectable_effect(1.0, n)
        d = rng.standard_normal((20_000, n)) + delta
        power = float(np.mean(t_pvalue(d) < 0.05))
        assert power == pytest.approx(0.80, abs=0.012), n  # binomial SE 0.003


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01 = 0.03, max(0.03, 2 x 0.03) = 0.06, max(0.06, 1 x 0.04) = 0.06
    assert holm_adjust([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjust([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    np.testing.assert_allclose(holm_adjust([[0.01, 0.04, 0.03], [0.2, 0.001, 0.02]]),
                               [[0.03, 0.06, 0.06], [0.2, 0.003, 0.04]])
    assert holm_adjust([0.02]) == pytest.approx([0.02])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        holm_adjust([0.1, float("nan")])


def test_claim_pvalue_side_and_null():
    d = [0.1, 0.3, 0.2, 0.6]  # mean 0.3
    p, side = claim_pvalue(d, "greater")
    assert side == 1 and float(p) == pytest.approx(float(t_pvalue(d, 0.0)))
    p, side = claim_pvalue(d, "greater", margin=0.1)  # tested against the margin
    assert side == 1 and float(p) == pytest.approx(float(t_pvalue(d, 0.1)))
    p, side = claim_pvalue(d, "greater", margin=0.5)  # between 0 and the margin: can be neither
    assert side == 0 and float(p) == 1.0
    p, side = claim_pvalue(d, "less", margin=0.1)  # the other side: contradicted is tested against 0
    assert side == -1 and float(p) == pytest.approx(float(t_pvalue(d, 0.0)))
    with pytest.raises(ValueError, match="rule"):
        claim_pvalue(d, "greater", rule="percentile")


def _shifted(p_target, n=5):
    """Differences whose paired t-test p-value is p_target (a fixed shape plus a mean)."""
    from scipy import stats

    v = np.linspace(-1, 1, n)
    se = v.std(ddof=1) / math.sqrt(n)
    return (v + stats.t.isf(p_target / 2, n - 1) * se).tolist()


def test_verdicts_are_holm_corrected_across_claims():
    claims = [{"direction": "greater"}, {"direction": "greater"}]
    a, b = paired_comparison(dict(enumerate(_shifted(0.03))), dict.fromkeys(range(5), 0.0)), \
        paired_comparison(dict(enumerate(_shifted(0.04))), dict.fromkeys(range(5), 0.0))
    assert a["p_paired_t"] == pytest.approx(0.03) and b["p_paired_t"] == pytest.approx(0.04)
    alone = evaluate_claims([a, b], claims, correction="none")
    assert [r["result"] for r in alone] == ["holds", "holds"]
    holm = evaluate_claims([a, b], claims)  # adjusted 0.06, 0.06
    assert [r["result"] for r in holm] == ["inconclusive", "inconclusive"]
    assert [r["p_holm"] for r in holm] == pytest.approx([0.06, 0.06]) and holm[0]["m"] == 2
    c = paired_comparison(dict(enumerate(_shifted(0.01))), dict.fromkeys(range(5), 0.0))
    mixed = evaluate_claims([c, b], claims)  # 2 x 0.01 = 0.02, max(0.02, 0.04) = 0.04: both hold
    assert [r["result"] for r in mixed] == ["holds", "holds"]
    flipped = evaluate_claims([c, b], [{"direction": "less"}, {"direction": "greater"}])
    assert [r["result"] for r in flipped] == ["contradicted", "holds"]
    # a claim without data stays out of the family
    empty = paired_comparison({0: 1.0}, {0: 0.0})
    out = evaluate_claims([c, empty], claims)
    assert [r["result"] for r in out] == ["holds", "insufficient data"] and out[0]["m"] == 1


def test_verdict_rule():
    def comp(*diffs):
        return paired_comparison(dict(enumerate(diffs)), dict.fromkeys(range(len(diffs)), 0.0))

    up = comp(0.10, 0.12, 0.09, 0.11, 0.13)  # t-interval about [0.090, 0.130]
    assert evaluate_claim(up, "greater") == "holds"
    assert evaluate_claim(up, "greater", margin=0.05) == "holds"
    assert evaluate_claim(up, "greater", margin=0.1) == "inconclusive"  # interval not beyond the margin
    assert evaluate_claim(up, "less") == "contradicted"
    assert evaluate_claim(up, "less", margin=0.5) == "contradicted"  # contradicted is judged against 0
    noisy = comp(0.10, -0.12, 0.09, -0.11, 0.13)
    assert evaluate_claim(noisy, "greater") == "inconclusive"
    assert evaluate_claim(comp(0.3), "greater") == "insufficient data"
    with pytest.raises(ValueError, match="direction"):
        evaluate_claim(up, "bigger")
    with pytest.raises(ValueError, match="margin"):
        evaluate_claim(up, "greater", margin=-1)
    # with one claim the rule is the interval: holds <=> ci_low > margin
    lo, _ = t_interval([0.10, 0.12, 0.09, 0.11, 0.13])
    assert evaluate_claim(up, "greater", margin=float(lo) - 1e-9) == "holds"
    assert evaluate_claim(up, "greater", margin=float(lo) + 1e-9) == "inconclusive"


def test_bca_matches_scipy_and_inverts_to_its_p_value():
    from scipy import stats

    x = np.random.default_rng(3).gamma(2.0, 1.0, size=40) - 1.5  # skewed: BCa differs from percentile
    ours = bca_bootstrap(x, nulls=(0.0,))
    ref = stats.bootstrap((x,), np.mean, method="BCa", n_resamples=10_000,
                          random_state=np.random.default_rng(11)).confidence_interval
    width = ref.high - ref.low
    assert ours["ci_low"] == pytest.approx(ref.low, abs=0.03 * width)
    assert ours["ci_high"] == pytest.approx(ref.high, abs=0.03 * width)
    # the p-value of the interval's own endpoint is 1 - its level
    at_low = bca_bootstrap(x, nulls=(ours["ci_low"], ours["ci_high"]))["p"]
    assert at_low == pytest.approx([0.05, 0.05], abs=0.004)
    c = paired_comparison(dict(enumerate(x)), dict.fromkeys(range(40), 0.0), rule="bca")
    assert c["ci_low"] == ours["ci_low"] and c["rule"] == "bca"
    few = paired_comparison(dict(enumerate(x[:BCA_MIN_N - 1])), dict.fromkeys(range(40), 0.0), rule="bca")
    assert math.isnan(few["ci_low"]) and f">= {BCA_MIN_N}" in few["rule_error"]
    assert evaluate_claims([few], [{"direction": "greater"}])[0]["result"] == "insufficient data"
    with pytest.raises(ValueError, match=f">= {BCA_MIN_N} paired seeds"):
        bca_bootstrap(x[:5])


@pytest.mark.parametrize("n", [5, 10, 20])
def test_no_true_difference_gives_at_most_six_percent_false_verdicts(n):
    """The verdict rule simulated: 4,000 studies with no true difference (normal per-seed
    differences, SD 1), one claim "greater" with margin 0. A false verdict is "holds" or
    "contradicted"; the interval should cover 0 in 95% of studies."""
    rng = np.random.default_rng(1000 + n)
    d = rng.standard_normal((4000, n))
    p, side = claim_pvalue(d, "greater")
    false = float(np.mean((p < 0.05) & (side != 0)))
    assert 0.04 <= false <= 0.06, false  # nominal 5%; binomial SE 0.0034
    lo, hi = t_interval(d)
    coverage = float(np.mean((lo <= 0) & (hi >= 0)))
    assert coverage == pytest.approx(0.95, abs=0.01)
    # the dict path (paired_comparison + evaluate_claim) decides exactly like the vectorised one
    for row, pv, sd in zip(d[:40], p[:40], side[:40]):
        comp = paired_comparison(dict(enumerate(row)), dict.fromkeys(range(n), 0.0))
        want = ("holds" if sd == 1 else "contradicted") if pv < 0.05 and sd != 0 else "inconclusive"
        assert evaluate_claim(comp, "greater") == want


def test_holm_keeps_the_familywise_false_rate_of_a_study():
    # 4,000 studies of 5 claims each, all without a true difference, 10 seeds: the chance of any
    # false verdict in a study is <= 5% with Holm (about 23% uncorrected: 1 - 0.95^5)
    rng = np.random.default_rng(5)
    d = rng.standard_normal((4000, 5, 10))
    p, side = claim_pvalue(d, "greater")
    any_false = np.any((holm_adjust(p) < 0.05) & (side != 0), axis=-1)
    assert float(np.mean(any_false)) <= 0.06
    uncorrected = float(np.mean(np.any((p < 0.05) & (side != 0), axis=-1)))
    assert uncorrected == pytest.approx(1 - 0.95 ** 5, abs=0.02)


def test_the_percentile_bootstrap_rule_fails_the_same_simulation():
    # why the rule changed: at 5 seeds the percentile interval excludes 0 in about 16% of
    # studies with no true difference (the bar above is 6%)
    rng = np.random.default_rng(9)
    d = rng.standard_normal((5, 1000))  # seeds x studies: bootstrap_ci works per column
    lo, hi = bootstrap_ci(d, n_resamples=2000)
    false = float(np.mean((lo > 0) | (hi < 0)))
    assert false > 0.10, false


def test_equal_differences_get_the_sign_test_not_p_zero():
    """Issue 35: identical non-zero differences (0/1 flags) gave p = 0 and "holds" at n = 2-3.
    Now the exact two-sided sign test: p = 2^(1-n), decisive at 0.05 from n = 6 on."""
    for n, p in ((2, 0.5), (3, 0.25), (5, 0.0625), (6, 0.03125)):
        got, side = claim_pvalue([1.0] * n, "greater")
        assert float(got) == p and int(side) == 1
        assert float(claim_pvalue([-1.0] * n, "greater")[0]) == p  # contradicted side, same p
    comp = paired_comparison({0: 1.0, 1: 1.0, 2: 1.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert evaluate_claim(comp, "greater") == "inconclusive"
    six = paired_comparison({s: 1.0 for s in range(6)}, {s: 0.0 for s in range(6)})
    assert evaluate_claim(six, "greater") == "holds"
    assert evaluate_claim(six, "less") == "contradicted"
    # equal to the margin-side null: no side, p = 1 (unchanged)
    assert float(claim_pvalue([0.0, 0.0, 0.0], "greater")[0]) == 1.0
    # vectorised: the flat row gets the sign test, the other row keeps its t-test p
    p, _ = claim_pvalue([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]], "greater")
    assert p[0] == 0.25 and p[1] == pytest.approx(float(t_pvalue([1.0, 2.0, 3.0])))
    # Holm over two flat claims at n = 6: adjusted 2 x 2^-5 = 0.0625, inconclusive
    res = evaluate_claims([six, six], [{"direction": "greater"}, {"direction": "greater"}])
    assert [r["p_holm"] for r in res] == [0.0625, 0.0625] and {r["result"] for r in res} == {"inconclusive"}
