"""Stability flags of one training run, from its metrics records (pure; no torch).

Every ``echotrain train`` run ends by writing ``stability.json`` with these flags and showing
them in its summary table; ``echotrain compare`` counts them per arm. Each flag compares the
*end* of a run with its *start* (or looks for one bad step), with stated thresholds:

- ``nan``: a non-finite value (NaN or +-inf) in any numeric metric of any step.
- ``length_collapse``: mean ``response_length/mean`` over the last window below
  ``length_ratio`` (0.5) x its mean over the first window (the collapse the ECHO paper shows for
  GSPO and GRPO: responses shrinking to a few tokens).
- ``entropy_collapse``: mean ``entropy`` over the last window below ``entropy_ratio`` (0.1) x its
  mean over the first window (the policy turned near-deterministic; DAPO arXiv 2503.14476 §3.1).
- ``grad_explosion``: some step's ``grad_norm`` (before clipping) above ``grad_factor`` (10) x the
  median ``grad_norm`` of the first window.
- ``accuracy_collapse``: the last held-out accuracy (``eval/accuracy``: greedy, or sampled at ``eval_temperature``; from ``eval.jsonl``
  when given, else the step records) below ``accuracy_ratio`` (0.5) x the first one (step 0, the
  starting policy, when evaluated) **and** at least ``accuracy_drop`` (0.10, i.e. 10 points)
  below it. Both conditions: halving from 4% to 2% is noise on a few hundred prompts, and a
  10-point fall from 90% is not a collapse. (Off-policy at lr 3e-4 the testbed fell from 0.28 to
  0.05 with none of the other flags raised.) Needs two evaluations, otherwise ``None``.

The first / last window is ``window_frac`` (10%) of the run's steps, at least ``min_window`` (3)
steps (capped at half the run). A flag needs at least ``2 * min_window`` steps with the metric,
otherwise it is ``None`` (not enough data), never silently False.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

FLAG_NAMES = ("nan", "length_collapse", "entropy_collapse", "grad_explosion", "accuracy_collapse")

#: What a user would turn when a flag is raised (printed with it and kept in stability.json).
REMEDIES = {
    "entropy_collapse": "entropy terms: entropy_coeff (verl's bonus, e.g. 0.001) or entropy_coef with "
                        "use_adaptive_entropy and entropy_target near the run's early entropy (TRL / Skywork-OR1); "
                        "top_entropy_quantile=0.2 (train on the high-entropy tokens only); a wider clip_ratio_high "
                        "(DAPO's clip-higher 0.28); a lower lr",
}


@dataclass(frozen=True)
class StabilityThresholds:
    """Thresholds of :func:`stability_flags` (see the module docstring for each rule)."""

    length_ratio: float = 0.5
    entropy_ratio: float = 0.1
    grad_factor: float = 10.0
    window_frac: float = 0.1
    min_window: int = 3
    accuracy_ratio: float = 0.5
    accuracy_drop: float = 0.10

    def __post_init__(self) -> None:
        for name in ("length_ratio", "entropy_ratio", "window_frac", "accuracy_ratio", "accuracy_drop"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"StabilityThresholds.{name}={v!r} must be in (0, 1]")
        if not self.grad_factor > 1:
            raise ValueError(f"StabilityThresholds.grad_factor={self.grad_factor!r} must be > 1")
        if int(self.min_window) < 1:
            raise ValueError(f"StabilityThresholds.min_window={self.min_window!r} must be >= 1")

    def describe(self) -> dict[str, str]:
        """Human-readable rule of each flag, with these thresholds."""
        w = f"{self.window_frac:.0%} of the steps (>= {self.min_window})"
        return {
            "nan": "any NaN/inf in a numeric metric",
            "length_collapse": f"mean response length of the last {w} < {self.length_ratio:g} x that of the first",
            "entropy_collapse": f"mean entropy of the last {w} < {self.entropy_ratio:g} x that of the first",
            "grad_explosion": f"max grad_norm > {self.grad_factor:g} x median grad_norm of the first {w}",
            "accuracy_collapse": f"last held-out accuracy < {self.accuracy_ratio:g} x the first and >= "
                                 f"{self.accuracy_drop:g} below it",
        }


def _series(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _window(n: int, th: StabilityThresholds) -> int:
    return max(1, min(max(int(th.min_window), math.ceil(th.window_frac * n)), n // 2))


def stability_flags(records: Sequence[dict[str, Any]], thresholds: StabilityThresholds | None = None,
                    evals: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Flags of one run from its ``metrics.jsonl`` records (dicts with ``step`` and metric keys).

    Args:
        records: the run's step records, in step order.
        thresholds: rules' thresholds; default :class:`StabilityThresholds()`.
        evals: the run's ``eval.jsonl`` records (with the step-0 evaluation of the starting
            policy); if None or empty, ``eval/accuracy`` is read from ``records``.

    Returns:
        ``{"flags": {name: True | False | None}, "any": bool, "values": {...}, "thresholds":
        {...}, "rules": {...}, "steps": int}``; ``values`` holds the numbers each flag compared
        (start/end window means, max/median grad norm, first non-finite step and key). ``None``
        means the metric was missing or the run too short to judge (fewer than
        ``2 * min_window`` steps).
    """
    th = thresholds or StabilityThresholds()
    flags: dict[str, bool | None] = {}
    values: dict[str, Any] = {}

    bad = None
    for r in records:
        for k, v in r.items():
            if isinstance(v, float) and not math.isfinite(v):
                bad = (r.get("step"), k)
                break
        if bad:
            break
    flags["nan"] = bad is not None
    if bad:
        values["nan_first"] = {"step": bad[0], "key": bad[1]}

    def start_end(key: str) -> tuple[float, float] | None:
        xs = [x for x in _series(records, key) if math.isfinite(x)]
        if len(xs) < 2 * int(th.min_window):
            return None
        w = _window(len(xs), th)
        return sum(xs[:w]) / w, sum(xs[-w:]) / w

    for flag, key, ratio in (("length_collapse", "response_length/mean", th.length_ratio),
                             ("entropy_collapse", "entropy", th.entropy_ratio)):
        se = start_end(key)
        if se is None:
            flags[flag] = None
            continue
        values[flag] = {"start": se[0], "end": se[1], "ratio": se[1] / se[0] if se[0] > 0 else None}
        flags[flag] = bool(se[1] < ratio * se[0])

    g = [x for x in _series(records, "grad_norm") if math.isfinite(x)]
    if len(g) < 2 * int(th.min_window):
        flags["grad_explosion"] = None
    else:
        base = statistics.median(g[: _window(len(g), th)])
        values["grad_explosion"] = {"start_median": base, "max": max(g),
                                    "ratio": max(g) / base if base > 0 else None}
        flags["grad_explosion"] = bool(max(g) > th.grad_factor * base)

    acc = sorted({int(r["step"]): float(r["eval/accuracy"]) for r in (evals or records)
                  if isinstance(r.get("eval/accuracy"), (int, float)) and not isinstance(r.get("eval/accuracy"), bool)
                  and math.isfinite(r["eval/accuracy"]) and "step" in r}.items())
    if len(acc) < 2:
        flags["accuracy_collapse"] = None
    else:
        (s0, a0), (s1, a1) = acc[0], acc[-1]
        values["accuracy_collapse"] = {"start_step": s0, "start": a0, "end_step": s1, "end": a1, "drop": a0 - a1}
        flags["accuracy_collapse"] = bool(a1 < th.accuracy_ratio * a0 and a0 - a1 >= th.accuracy_drop - 1e-12)
    return {"flags": flags, "any": any(bool(v) for v in flags.values()), "values": values,
            "thresholds": asdict(th), "rules": th.describe(), "steps": len(records),
            "remedies": {k: REMEDIES[k] for k, v in flags.items() if v and k in REMEDIES}}


def format_flags(result: dict[str, Any]) -> str:
    """One line for a summary table: the raised flags, ``none`` or ``n/a`` (too short)."""
    flags = result["flags"]
    raised = [k for k, v in flags.items() if v]
    if raised:
        return ", ".join(f"{k} (turn: {REMEDIES[k]})" if k in REMEDIES else k for k in raised)
    unknown = [k for k, v in flags.items() if v is None]
    return "none" + (f" (not judged: {', '.join(unknown)})" if unknown else "")
