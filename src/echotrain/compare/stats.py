"""Statistics of a multi-seed comparison: pure functions of numbers (numpy / scipy, no torch).

Descriptive (per arm):

- :func:`mean_std_ci`          mean, sample std (ddof 1) and 95% percentile-bootstrap interval of
                               the mean over seeds, for a vector or per column of a (seeds, T) curve
- :func:`auc`                  normalised area under a curve (trapezoid / step span): the mean level
- :func:`steps_to_threshold`   first step whose value reaches a threshold (None if never)

The verdict rule (paired by seed; see docs/design/architecture.md, "The verdict rule"):

- :func:`t_interval`, :func:`t_pvalue`   paired t-interval / two-sided paired t-test of the mean
                               per-seed difference (vectorised over leading axes)
- :func:`bca_bootstrap`        BCa bootstrap interval and test-inversion p-values (an option, refused
                               below ``BCA_MIN_N`` seeds)
- :func:`min_detectable_effect` smallest true mean difference a two-sided paired t-test detects with
                               the given power (noncentral t), from the SD of the differences and n
- :func:`claim_pvalue`         the one p-value that can make a claim decisive, and on which side
- :func:`holm_adjust`          Holm's step-down adjustment across the claims of one study
- :func:`paired_comparison`    arm vs baseline over the seeds both have: mean difference, interval,
                               paired t and Welch p-values, minimal detectable effect
- :func:`evaluate_claims`      the verdicts of one study's claims (Holm-corrected)
- :func:`evaluate_claim`       one claim alone (no correction)

The percentile bootstrap of the descriptive intervals is ``scipy.stats.bootstrap`` (fixed seed,
10,000 resamples), so a report is reproducible. With one seed an interval is (nan, nan); with all
values equal it is the value itself. The percentile bootstrap is *not* used for verdicts: at n = 3
its interval of a mean is [min, max] of the values, and simulated with no true difference it gives
a false verdict in 25% of studies at 3 seeds and 16% at 5 (the paired t: 5%).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 12345
#: verdict rules: ``paired_t`` (default) or ``bca`` (BCa bootstrap, needs >= BCA_MIN_N paired seeds)
RULES = ("paired_t", "bca")
#: multiplicity corrections across the claims of one study
CORRECTIONS = ("holm", "none")
ALPHA = 0.05  # two-sided level of every verdict (each side 2.5%), before the Holm correction
POWER = 0.8  # power of the minimal detectable effect
#: fewest paired seeds the BCa rule accepts: the BCa interval of a mean under-covers at few seeds
#: (simulated with no true difference, normal differences, 2,000 studies, 10,000 resamples: false
#: verdicts 9.7% at n = 10, 6.9% at n = 20, 6.3% at n = 30 and at n = 50; the paired t: 5%)
BCA_MIN_N = 30


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


def _as_diffs(d: Any) -> np.ndarray:
    x = np.asarray(d, dtype=np.float64)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("differences: need at least one value along the last axis (seeds)")
    if not np.all(np.isfinite(x)):
        raise ValueError("differences must be finite (drop NaN runs first)")
    return x


def t_interval(d: Any, confidence: float = 1 - ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Paired t-interval of the mean over the last axis: ``mean ± t_{1-a/2, n-1} · s / sqrt(n)``.

    Args:
        d: (..., n) per-seed differences (arm − baseline), float; n >= 2 for a finite interval.
        confidence: level 1 − a in (0, 1).

    Returns:
        (low, high), float64 arrays of shape ``d.shape[:-1]`` (0-d for a vector); nan where n < 2;
        the point itself where every difference is equal (s = 0).

    Raises:
        ValueError: ``confidence`` outside (0, 1), empty or non-finite input.

    Source: Student's t interval of a mean (the paired-difference form, e.g. Wasserman, *All of
    Statistics*, 2004, §10.10).
    """
    from scipy import stats

    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    x = _as_diffs(d)
    n = x.shape[-1]
    m = x.mean(axis=-1)
    if n < 2:
        nan = np.full(m.shape, np.nan)
        return nan, nan.copy()
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * x.std(axis=-1, ddof=1) / math.sqrt(n)
    return m - half, m + half


def t_pvalue(d: Any, null: Any = 0.0) -> np.ndarray:
    """Two-sided paired t-test p-value of H0: mean difference = ``null``, over the last axis.

    Args:
        d: (..., n) per-seed differences, float, n >= 2.
        null: scalar or array broadcastable to ``d.shape[:-1]``.

    Returns:
        float64 array of shape ``d.shape[:-1]``: ``2 · P(T_{n-1} > |mean − null| / (s / sqrt n))``;
        with s = 0: 0 where mean != null, 1 where equal; nan where n < 2.

    Raises:
        ValueError: empty or non-finite input.
    """
    from scipy import stats

    x = _as_diffs(d)
    n = x.shape[-1]
    m = x.mean(axis=-1)
    null = np.broadcast_to(np.asarray(null, dtype=np.float64), m.shape)
    if n < 2:
        return np.full(m.shape, np.nan)
    se = x.std(axis=-1, ddof=1) / math.sqrt(n)
    dev = np.abs(m - null)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = 2 * stats.t.sf(dev / se, n - 1)
    return np.where(se > 0, p, np.where(dev > 0, 0.0, 1.0))


def bca_bootstrap(d: Sequence[float], nulls: Sequence[float] = (), confidence: float = 1 - ALPHA,
                  n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Bias-corrected and accelerated (BCa) bootstrap interval of the mean, and p-values by inverting it.

    Args:
        d: (n,) per-seed differences, n >= ``BCA_MIN_N``.
        nulls: values theta0 to test; the two-sided p-value of each is 1 − the level of the BCa
            interval whose endpoint is theta0 (so "the 95% BCa interval excludes theta0" <=> p < 0.05).

    Returns:
        ``{"ci_low", "ci_high", "p": [one per null], "z0", "acceleration"}`` (floats).

    Raises:
        ValueError: fewer than ``BCA_MIN_N`` values, non-finite values, bad ``confidence``.

    Source: Efron, "Better bootstrap confidence intervals", JASA 1987 (z0 from the share of
    resampled means below the estimate, acceleration from the jackknife); Efron & Tibshirani,
    *An Introduction to the Bootstrap*, 1993, §14.3. The interval agrees with
    ``scipy.stats.bootstrap(method="BCa")`` up to resampling noise (tested).
    """
    from scipy import stats

    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    x = _as_diffs(d)
    if x.ndim != 1 or len(x) < BCA_MIN_N:
        raise ValueError(f"bca_bootstrap: needs >= {BCA_MIN_N} paired seeds, got {x.shape[-1]} "
                         "(use the paired_t rule)")
    n = len(x)
    est = float(x.mean())
    if np.all(x == x[0]):
        return {"ci_low": est, "ci_high": est, "p": [0.0 if v != est else 1.0 for v in nulls], "z0": 0.0,
                "acceleration": 0.0}
    rng = np.random.default_rng(seed)
    means = np.sort(x[rng.integers(0, n, size=(n_resamples, n))].mean(axis=1))
    z0 = stats.norm.ppf(np.mean(means < est))
    jack = (x.sum() - x) / (n - 1)
    dev = jack.mean() - jack
    accel = float(np.sum(dev ** 3) / (6.0 * np.sum(dev ** 2) ** 1.5))

    def quantile_at(z: float) -> float:
        u = z0 + z
        return float(np.quantile(means, stats.norm.cdf(z0 + u / (1 - accel * u))))

    zc = stats.norm.ppf(0.5 + confidence / 2)
    lo, hi = quantile_at(-zc), quantile_at(zc)
    ps = []
    for v in nulls:
        frac = np.clip(np.mean(means < v), 0.5 / n_resamples, 1 - 0.5 / n_resamples)
        w = stats.norm.ppf(frac) - z0
        z = w / (1 + accel * w) - z0  # the z of the BCa endpoint that equals v
        ps.append(float(min(1.0, 2 * min(stats.norm.cdf(z), stats.norm.sf(z)))))
    return {"ci_low": lo, "ci_high": hi, "p": ps, "z0": float(z0), "acceleration": accel}


def min_detectable_effect(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true mean difference a two-sided paired t-test at level ``alpha`` detects with
    probability ``power``, given the SD of the per-seed differences and the number of seeds.

    Solves ``P(|T'| > t_{1-alpha/2, n-1}) = power`` for the noncentrality ``lambda`` of
    ``T' ~ t'_{n-1}(lambda)`` (``scipy.stats.nct``; both tails), then returns ``lambda · sd / sqrt(n)``.
    The normal approximation ``(z_{1-alpha/2} + z_{power}) · sd / sqrt(n)`` is too small at few
    seeds (by 34% at n = 5, 12% at n = 10).

    Args:
        sd: sample SD (ddof 1) of the per-seed differences, in the statistic's unit (>= 0).
        n: number of paired seeds.

    Returns:
        The effect in the statistic's unit; nan for n < 2 or non-finite sd; 0 for sd = 0.

    Raises:
        ValueError: sd < 0, alpha or power outside (0, 1).

    Source: the power of the one-sample (paired) t-test, e.g. Cohen, *Statistical Power Analysis
    for the Behavioral Sciences*, 1988, ch. 2.
    """
    from scipy import optimize, stats

    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha={alpha!r} and power={power!r} must be in (0, 1)")
    if not math.isfinite(sd) or n < 2:
        return float("nan")
    if sd < 0:
        raise ValueError(f"sd={sd!r} must be >= 0")
    if sd == 0:
        return 0.0
    df = n - 1
    tc = stats.t.ppf(1 - alpha / 2, df)

    def gap(nc: float) -> float:
        # the far tail below -tc is negligible for nc > 0; scipy's nct.cdf returns nan there for large nc
        lower = float(stats.nct.cdf(-tc, df, nc))
        return float(stats.nct.sf(tc, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    hi = tc + stats.norm.ppf(power) + 1.0
    while gap(hi) < 0:
        hi *= 2
    nc = optimize.brentq(gap, 0.0, hi, xtol=1e-12)
    return float(nc * sd / math.sqrt(n))


CLAIM_DIRECTIONS = ("greater", "less")


def _check_claim(direction: str, margin: float) -> None:
    if direction not in CLAIM_DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not valid; valid: {', '.join(CLAIM_DIRECTIONS)}")
    if not margin >= 0:
        raise ValueError(f"margin={margin!r} must be >= 0")


def claim_pvalue(d: Any, direction: str, margin: float = 0.0, rule: str = "paired_t") -> tuple[Any, Any]:
    """The p-value that can make one claim decisive, and which verdict it would give.

    A claim "arm is ``direction`` than the baseline by more than ``margin``" with sign s (+1
    greater, −1 less) and mean difference m: when s·m > margin it can *hold*, tested against
    the null s·margin; when s·m < 0 it can be *contradicted*, tested against 0; in between
    neither (p = 1). Each test is two-sided at the rule's level, so with one claim "decisive
    at alpha" is exactly "the (1 − alpha) interval excludes the null on that side".

    Zero variance (every difference equal, e.g. a 0/1 flag on every seed): the t-test would give
    p = 0 at any n >= 2, so the p-value is the exact two-sided sign test's instead, 2^(1 − n)
    (every difference lies beyond the null): decisive at alpha = 0.05 from n = 6 seeds on, never
    at n = 2-5 (both rules; our choice, docs/design/architecture.md, "The verdict rule").

    Args:
        d: (..., n) per-seed differences arm − baseline (``paired_t``: any leading axes;
            ``bca``: one vector of n >= ``BCA_MIN_N``).

    Returns:
        (p, side): arrays of shape ``d.shape[:-1]`` (floats for ``bca``); side +1 = can hold,
        −1 = can be contradicted, 0 = neither.

    Raises:
        ValueError: unknown rule / direction, negative margin, bad input.
    """
    _check_claim(direction, margin)
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not valid; valid: {', '.join(RULES)}")
    x = _as_diffs(d)
    s = 1.0 if direction == "greater" else -1.0
    sm = s * x.mean(axis=-1)
    side = np.where(sm > margin, 1, np.where(sm < 0, -1, 0))
    # every difference equal (s_d = 0): the t-test's p is 0 at any n, even n = 2 (0/1 statistics
    # such as flags make this common); the exact two-sided sign test instead: each of the n
    # differences lies beyond the tested null, p = 2^(1-n) (decisive at alpha 0.05 from n = 6 on)
    flat = np.all(x == x[..., :1], axis=-1)
    p_sign = min(1.0, 2.0 ** (1 - x.shape[-1]))
    if rule == "bca":
        if x.ndim != 1:
            raise ValueError("claim_pvalue: the bca rule takes one vector of differences")
        if flat and side != 0:
            return p_sign, int(side)
        p_hold, p_contra = bca_bootstrap(x, nulls=(s * margin, 0.0))["p"]
        return (p_hold if side == 1 else p_contra if side == -1 else 1.0), int(side)
    p = np.where(side == 1, t_pvalue(x, s * margin), np.where(side == -1, t_pvalue(x, 0.0), 1.0))
    return np.where(flat & (side != 0), p_sign, p), side


def holm_adjust(p: Any) -> np.ndarray:
    """Holm's step-down adjusted p-values over the last axis (the claims of one study).

    Sort the m p-values ascending, p_(1) <= ... <= p_(m); the adjusted value of p_(k) is
    ``max_{j <= k} min(1, (m − j + 1) · p_(j))``. Rejecting where the adjusted p < alpha keeps
    the chance of any false verdict in the family <= alpha under any dependence.

    Args:
        p: (..., m) p-values in [0, 1] (nan not allowed).

    Returns:
        float64 array of the same shape, in the input order.

    Raises:
        ValueError: values outside [0, 1] or nan.

    Source: Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist.
    6 (1979) 65-70.
    """
    x = np.asarray(p, dtype=np.float64)
    if x.ndim == 0:
        x = x[None]
    if not np.all((x >= 0) & (x <= 1)):
        raise ValueError("holm_adjust: p-values must be in [0, 1] (no nan)")
    m = x.shape[-1]
    order = np.argsort(x, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(x, order, axis=-1)
    adj = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * sorted_p), axis=-1)
    out = np.empty_like(adj)
    np.put_along_axis(out, order, adj, axis=-1)
    return out


def paired_comparison(arm: dict[Any, float], base: dict[Any, float], confidence: float = 1 - ALPHA,
                      rule: str = "paired_t", seeds: Sequence[Any] | None = None,
                      power: float = POWER) -> dict[str, Any]:
    """Compare per-seed values of an arm with a baseline arm, paired by seed.

    Args:
        arm, base: ``{seed: value}``; only seeds present in both (and finite in both) are paired.
        rule: the interval of the mean difference: ``paired_t`` (:func:`t_interval`) or ``bca``
            (:func:`bca_bootstrap`; with fewer than ``BCA_MIN_N`` paired seeds the interval is
            nan and ``rule_error`` says why).
        seeds: if given, only these seeds are paired (e.g. the confirmation seeds).

    Returns:
        ``{"seeds", "n", "diffs", "rule", "arm_mean", "base_mean", "diff_mean", "diff_std",
        "ci_low", "ci_high", "p_paired_t", "p_welch", "mde"}``: the interval is of the mean
        paired difference (arm − base); ``p_paired_t`` is the two-sided paired t-test of 0,
        ``p_welch`` ``scipy.stats.ttest_ind(equal_var=False)`` on the two samples (nan when
        undefined: n < 2 or zero variance); ``mde`` :func:`min_detectable_effect` at level
        1 − ``confidence`` and ``power``.

    Raises:
        ValueError: unknown rule.
    """
    from scipy import stats

    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not valid; valid: {', '.join(RULES)}")
    keep = None if seeds is None else set(seeds)
    paired = sorted(s for s in arm if s in base and (keep is None or s in keep)
                    and math.isfinite(arm[s]) and math.isfinite(base[s]))
    a = np.array([arm[s] for s in paired], dtype=np.float64)
    b = np.array([base[s] for s in paired], dtype=np.float64)
    out: dict[str, Any] = {"seeds": paired, "n": len(paired), "rule": rule}
    if not paired:
        return {**out, "diffs": [], **{k: float("nan") for k in (
            "arm_mean", "base_mean", "diff_mean", "diff_std", "ci_low", "ci_high", "p_paired_t", "p_welch", "mde")}}
    d = a - b
    sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    if rule == "bca" and len(d) < BCA_MIN_N:
        lo = hi = float("nan")
        out["rule_error"] = f"the bca rule needs >= {BCA_MIN_N} paired seeds, got {len(d)}"
    elif rule == "bca":
        res = bca_bootstrap(d, confidence=confidence)
        lo, hi = res["ci_low"], res["ci_high"]
    else:
        lo, hi = (float(v) for v in t_interval(d, confidence))
    p_welch = float("nan")
    if len(d) >= 2 and (np.any(a != a[0]) or np.any(b != b[0])):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one constant sample: scipy warns, the p-value is still defined
            p_welch = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return {**out, "diffs": d.tolist(), "arm_mean": float(a.mean()), "base_mean": float(b.mean()),
            "diff_mean": float(d.mean()), "diff_std": sd if len(d) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
            "p_paired_t": float(t_pvalue(d)), "p_welch": p_welch,
            "mde": min_detectable_effect(sd, len(d), 1 - confidence, power)}


VERDICTS = ("holds", "contradicted", "inconclusive", "insufficient data")


def evaluate_claims(comparisons: Sequence[dict[str, Any]], claims: Sequence[dict[str, Any]],
                    alpha: float = ALPHA, correction: str = "holm") -> list[dict[str, Any]]:
    """The verdicts of one study's claims, each on its :func:`paired_comparison`.

    Rule: each claim gets its :func:`claim_pvalue` (paired t, or BCa if the comparison's rule is
    ``bca``); the p-values of the claims that have data are Holm-adjusted together
    (``correction="holm"``); a claim *holds* (or is *contradicted*) when its adjusted p < alpha on
    that side, else it is *inconclusive*; fewer than 2 paired seeds (``bca``: fewer than
    ``BCA_MIN_N``): *insufficient data*, left out of the correction.

    Args:
        comparisons: one :func:`paired_comparison` result per claim (same order).
        claims: dicts with ``direction`` (greater | less) and ``margin`` (>= 0, default 0).

    Returns:
        One dict per claim: ``{"result", "side", "p", "p_holm", "alpha", "correction", "m"}``
        (``m``: claims in the correction; ``p_holm`` = ``p`` with ``correction="none"``).

    Raises:
        ValueError: unknown correction, bad alpha, direction or margin, mismatched lengths.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"correction={correction!r} is not valid; valid: {', '.join(CORRECTIONS)}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    if len(comparisons) != len(claims):
        raise ValueError(f"{len(comparisons)} comparisons for {len(claims)} claims")
    raw: list[tuple[float, int] | None] = []
    for comp, c in zip(comparisons, claims):
        direction, margin = c.get("direction", "greater"), float(c.get("margin", 0.0))
        _check_claim(direction, margin)
        rule = comp.get("rule", "paired_t")
        need = BCA_MIN_N if rule == "bca" else 2
        if comp.get("n", 0) < need:
            raw.append(None)
            continue
        p, side = claim_pvalue(comp["diffs"], direction, margin, rule)
        raw.append((float(p), int(side)))
    ps = [r[0] for r in raw if r is not None]
    adj = iter(holm_adjust(ps).tolist() if ps and correction == "holm" else ps)
    out = []
    for r in raw:
        if r is None:
            out.append({"result": "insufficient data", "side": 0, "p": float("nan"), "p_holm": float("nan"),
                        "alpha": alpha, "correction": correction, "m": len(ps)})
            continue
        p, side = r
        pa = next(adj)
        result = ("holds" if side == 1 else "contradicted") if side != 0 and pa < alpha else "inconclusive"
        out.append({"result": result, "side": side, "p": p, "p_holm": pa, "alpha": alpha, "correction": correction,
                    "m": len(ps)})
    return out


def evaluate_claim(comparison: dict[str, Any], direction: str, margin: float = 0.0, alpha: float = ALPHA) -> str:
    """One claim alone (no multiplicity correction): :func:`evaluate_claims` of a single claim.

    Returns:
        One of ``"holds"``, ``"contradicted"``, ``"inconclusive"``, ``"insufficient data"``.

    Raises:
        ValueError: unknown direction or negative margin.
    """
    _check_claim(direction, margin)
    return evaluate_claims([comparison], [{"direction": direction, "margin": margin}], alpha, "none")[0]["result"]
