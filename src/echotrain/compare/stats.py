"""Statistics of a multi-seed comparison: pure functions of numbers (numpy / scipy, no torch).

- :func:`mean_std_ci`          mean, sample std (ddof 1) and 95% percentile-bootstrap interval of
                               the mean over seeds, for a vector or per column of a (seeds, T) curve
- :func:`auc`                  normalised area under a curve (trapezoid / step span): the mean level
- :func:`steps_to_threshold`   first step whose value reaches a threshold (None if never)
- :func:`paired_comparison`    arm vs baseline over the seeds both have: mean difference, paired
                               bootstrap 95% interval, paired t-test and Welch's t-test p-values
- :func:`evaluate_claim`       a verdict rule (written before the runs) applied to a comparison

The bootstrap is ``scipy.stats.bootstrap`` (percentile method, fixed seed, 10,000 resamples), so a
report is reproducible. With one seed the interval is (nan, nan); with all values equal it is the
value itself.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 12345


def bootstrap_ci(values: Any, confidence: float = 0.95, n_resamples: int = N_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Percentile-bootstrap interval of the mean over axis 0 (seeds).

    Args:
        values: (n,) or (n, T) array-like of floats, n = number of seeds.
        confidence: interval level in (0, 1).

    Returns:
        (low, high), each shaped like ``values[0]``; nan where n < 2.

    Raises:
        ValueError: ``confidence`` outside (0, 1), or non-finite values.
    """
    from scipy.stats import bootstrap

    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    x = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("bootstrap_ci: values must be finite (drop NaN runs first)")
    shape = x.shape[1:]
    if x.shape[0] < 2:
        nan = np.full(shape, np.nan)
        return nan, nan.copy()
    # all seeds equal in a column: the interval is the point (scipy warns on degenerate samples)
    const = np.all(x == x[:1], axis=0)
    if np.all(const):
        return x[0].copy(), x[0].copy()
    res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                    axis=0, vectorized=True, random_state=np.random.default_rng(seed))
    low = np.where(const, x[0], res.confidence_interval.low)
    high = np.where(const, x[0], res.confidence_interval.high)
    return np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)


def mean_std_ci(values: Any, confidence: float = 0.95) -> dict[str, Any]:
    """Mean, sample standard deviation (ddof=1; 0 for one seed) and bootstrap interval over axis 0.

    Args:
        values: (n,) per-seed numbers or (n, T) per-seed curves on common steps.

    Returns:
        ``{"n", "mean", "std", "ci_low", "ci_high"}``: floats for a vector, lists for curves.

    Raises:
        ValueError: empty input or non-finite values.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or x.shape[0] == 0:
        raise ValueError("mean_std_ci: no values")
    mean = x.mean(axis=0)
    std = x.std(axis=0, ddof=1) if x.shape[0] > 1 else np.zeros(x.shape[1:])
    lo, hi = bootstrap_ci(x, confidence)
    conv = (lambda a: float(a)) if x.ndim == 1 else (lambda a: np.asarray(a).tolist())
    return {"n": int(x.shape[0]), "mean": conv(mean), "std": conv(std), "ci_low": conv(lo), "ci_high": conv(hi)}


def _check_curve(steps: Sequence[float], values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps and values must be 1-D of equal length, got {s.shape} and {v.shape}")
    if len(s) and np.any(np.diff(s) <= 0):
        raise ValueError("steps must be strictly increasing")
    return s, v


def auc(steps: Sequence[float], values: Sequence[float], normalize: bool = True) -> float:
    """Area under the curve ``values(steps)`` by the trapezoid rule.

    With ``normalize`` (default) the area is divided by the step span, giving the curve's mean
    level (for accuracy: in [0, 1], comparable across run lengths). One point: that value.

    Raises:
        ValueError: empty input, mismatched lengths or steps not strictly increasing.
    """
    s, v = _check_curve(steps, values)
    if len(s) == 0:
        raise ValueError("auc: empty curve")
    if len(s) == 1:
        return float(v[0])
    area = float(np.sum((v[1:] + v[:-1]) * np.diff(s)) / 2.0)
    return area / float(s[-1] - s[0]) if normalize else area


def steps_to_threshold(steps: Sequence[float], values: Sequence[float], threshold: float) -> float | None:
    """The first step whose value is >= ``threshold``; None if the curve never reaches it.

    Raises:
        ValueError: mismatched lengths or steps not strictly increasing.
    """
    s, v = _check_curve(steps, values)
    hit = np.nonzero(v >= threshold)[0]
    return float(s[hit[0]]) if len(hit) else None


def paired_comparison(arm: dict[Any, float], base: dict[Any, float], confidence: float = 0.95) -> dict[str, Any]:
    """Compare per-seed values of an arm with a baseline arm, paired by seed.

    Args:
        arm, base: ``{seed: value}``; only seeds present in both (and finite in both) are paired.

    Returns:
        ``{"seeds", "n", "arm_mean", "base_mean", "diff_mean", "diff_std", "ci_low", "ci_high",
        "p_paired_t", "p_welch"}``: the bootstrap interval is of the mean paired difference
        (arm - base); ``p_paired_t`` from ``scipy.stats.ttest_rel``, ``p_welch`` from
        ``scipy.stats.ttest_ind(equal_var=False)`` on the two samples (nan when undefined:
        n < 2 or zero variance).
    """
    from scipy import stats

    seeds = sorted(s for s in arm if s in base and math.isfinite(arm[s]) and math.isfinite(base[s]))
    a = np.array([arm[s] for s in seeds], dtype=np.float64)
    b = np.array([base[s] for s in seeds], dtype=np.float64)
    out: dict[str, Any] = {"seeds": seeds, "n": len(seeds)}
    if not seeds:
        return {**out, **{k: float("nan") for k in ("arm_mean", "base_mean", "diff_mean", "diff_std", "ci_low",
                                                     "ci_high", "p_paired_t", "p_welch")}}
    d = a - b
    lo, hi = bootstrap_ci(d, confidence)
    p_rel = p_welch = float("nan")
    if len(seeds) >= 2:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zero variance -> nan p-value, reported as such
            if np.any(d != d[0]):
                p_rel = float(stats.ttest_rel(a, b).pvalue)
            if np.any(a != a[0]) or np.any(b != b[0]):
                p_welch = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return {**out, "arm_mean": float(a.mean()), "base_mean": float(b.mean()), "diff_mean": float(d.mean()),
            "diff_std": float(d.std(ddof=1)) if len(d) > 1 else 0.0, "ci_low": float(lo), "ci_high": float(hi),
            "p_paired_t": p_rel, "p_welch": p_welch}


CLAIM_DIRECTIONS = ("greater", "less")


def evaluate_claim(comparison: dict[str, Any], direction: str, margin: float = 0.0) -> str:
    """Apply a verdict rule to a :func:`paired_comparison` result.

    Rule: the claim "arm is ``direction`` than the baseline by more than ``margin``" *holds* when
    the whole 95% interval of the mean paired difference lies beyond the margin on the claimed
    side (``greater``: ci_low > margin; ``less``: ci_high < -margin); it is *contradicted* when
    the whole interval lies on the other side of 0 (``greater``: ci_high < 0; ``less``:
    ci_low > 0); otherwise *inconclusive*. Fewer than 2 paired seeds: *insufficient data*.

    Returns:
        One of ``"holds"``, ``"contradicted"``, ``"inconclusive"``, ``"insufficient data"``.

    Raises:
        ValueError: unknown direction or negative margin.
    """
    if direction not in CLAIM_DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not valid; valid: {', '.join(CLAIM_DIRECTIONS)}")
    if not margin >= 0:
        raise ValueError(f"margin={margin!r} must be >= 0")
    lo, hi = comparison.get("ci_low", float("nan")), comparison.get("ci_high", float("nan"))
    if comparison.get("n", 0) < 2 or not (math.isfinite(lo) and math.isfinite(hi)):
        return "insufficient data"
    if direction == "greater":
        return "holds" if lo > margin else ("contradicted" if hi < 0 else "inconclusive")
    return "holds" if hi < -margin else ("contradicted" if lo > 0 else "inconclusive")
