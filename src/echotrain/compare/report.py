"""The comparison report: reads run directories, aggregates over seeds, writes Markdown + JSON + PNG.

Inputs are ordinary run directories (``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``); a
comparison directory (``compare.yaml`` + ``cells/``) expands to its cells and brings its
baseline, threshold and verdict rule. A run's arm is its ``cell.json`` label, else its preset.

Outputs in ``out_dir``: ``report.md``, ``summary.json`` (per-seed statistics, per-arm summary,
paired comparisons, verdicts with their p-values, Holm-adjusted p-values and minimal detectable
effects, the exploration seeds' results apart when the study declares ``confirm_seeds``,
stability flags; per run its last step read, configured steps, commit(s) and resolved precision;
``provenance``: the cells' commits and precisions and the compared pairs that differ;
``overridden``: the comparison file's settings the command line changed; with a sweep
``dose_response``), ``curves.json`` (per-arm mean / std / 95%
bootstrap interval per step of every metric, 5 significant digits), ``plots/<metric>.png`` (all arms' mean curves
with shaded 95% bands; a sweep's grouped by arm: a colour per arm, a line style per sweep value)
and, with a sweep, ``plots/dose_response.png`` (AUC and final against the sweep value per arm).

The report opens with what ran (seeds, steps, the step read; a warning when the file's
description was written for settings the command line overrode), the commits and precision of
the cells; a study whose confirmation seeds have not run opens with the exploration results.
A difference within float noise (:data:`FLOAT_NOISE`) prints as 0. The statistics are
:mod:`echotrain.compare.stats`.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from echotrain.compare.stats import (
    ALPHA,
    POWER,
    auc,
    evaluate_claims,
    mean_std_ci,
    min_detectable_effect,
    paired_comparison,
    steps_to_threshold,
)
from echotrain.train.metrics import read_jsonl
from echotrain.train.stability import FLAG_NAMES, StabilityThresholds, stability_flags

#: curves of the report that are not metrics of a run: ``steps_per_s`` is 1 / ``time/step``
DERIVED_CURVES: list[tuple[str, str, str]] = [("steps_per_s", "Training steps per second", "steps/s")]


def curve_specs() -> list[tuple[str, str, str]]:
    """(key, title, y label) of the report's curves, in order: every declared metric that has a
    plot panel (:func:`echotrain.metrics.panels`; ``eval/accuracy`` from eval.jsonl, step 0
    included; title = its one-line meaning, y label = its unit), then :data:`DERIVED_CURVES`.
    Missing ones are skipped."""
    from echotrain.metrics import panels
    from echotrain.train.metrics import builtin_metrics

    builtin_metrics()
    return [(m.name, m.help[:1].upper() + m.help[1:], m.unit) for _, ms in panels() for m in ms] + DERIVED_CURVES


@dataclass
class Run:
    """One run directory, loaded."""

    path: Path
    arm: str
    seed: int
    config: dict[str, Any]
    records: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    stability: dict[str, Any] = field(default_factory=dict)
    #: the echotrain commit(s) that ran the cell (``cell.json``'s ``commits``, written by
    #: compare's runner; a resumed cell run by another commit has two); [] when not recorded
    commits: list[str] = field(default_factory=list)
    #: ``run_info.json``'s resolved ``autocast`` ('bfloat16' | 'off') and ``autocast_reason``;
    #: None when the run has no run_info.json (or it predates the setting)
    autocast: str | None = None
    autocast_reason: str | None = None

    def curve(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of metric ``key`` (finite values only)."""
        if key == "steps_per_s":
            pts = [(r["step"], 1.0 / r["time/step"]) for r in self.records
                   if isinstance(r.get("time/step"), (int, float)) and r["time/step"] > 0]
        else:
            src = self.evals if key.startswith("eval/") and self.evals else self.records
            pts = [(r["step"], float(r[key])) for r in src
                   if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        pts = sorted({s: v for s, v in pts if math.isfinite(v)}.items())
        return [float(s) for s, _ in pts], [v for _, v in pts]


def load_run(path: str | os.PathLike, thresholds: StabilityThresholds | None = None,
             max_step: int | None = None) -> Run:
    """Load a run directory; with ``max_step`` only its steps <= max_step (a common horizon for
    runs of different lengths; with a constant learning rate a longer run's first N steps are the
    N-step run, since nothing before step N depends on the total).

    Raises:
        FileNotFoundError: no ``config.yaml`` / ``metrics.jsonl`` in ``path``.
    """
    p = Path(path)
    if not (p / "config.yaml").is_file() or not (p / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{p}: not a run directory (needs config.yaml and metrics.jsonl)")
    cfg = yaml.safe_load((p / "config.yaml").read_text()) or {}
    info = json.loads((p / "cell.json").read_text()) if (p / "cell.json").is_file() else {}
    records, evals = read_jsonl(p / "metrics.jsonl"), read_jsonl(p / "eval.jsonl")
    if max_step is not None:
        records = [r for r in records if r.get("step", 0) <= max_step]
        evals = [r for r in evals if r.get("step", 0) <= max_step]
    run = Run(path=p, arm=str(info.get("arm") or cfg.get("preset") or p.name), seed=int(info.get("seed", cfg.get("seed", 0))),
              config=cfg, records=records, evals=evals)
    run.stability = stability_flags(records, thresholds, evals=evals)
    run.commits = [str(c) for c in (info.get("commits") or ([info["commit"]] if info.get("commit") else []))]
    ri = json.loads((p / "run_info.json").read_text()) if (p / "run_info.json").is_file() else {}
    if ri.get("commit") and not run.commits:
        run.commits = [str(ri["commit"])]
    run.autocast, run.autocast_reason = ri.get("autocast"), ri.get("autocast_reason")
    return run


def collect_runs(dirs: Sequence[str | os.PathLike], include_partial: bool = False) -> tuple[list[Path], dict[str, Any]]:
    """Expand comparison directories into their cells; returns (run dirs, comparison settings from
    the first ``compare.yaml`` found: baseline, report, verdict, arms order; ``unfinished``: the
    cells skipped because they have no ``stability.json`` yet, unless ``include_partial``)."""
    runs: list[Path] = []
    settings: dict[str, Any] = {}
    unfinished: list[str] = []
    for d in map(Path, dirs):
        if (d / "compare.yaml").is_file():
            spec = yaml.safe_load((d / "compare.yaml").read_text()) or {}
            if not settings:
                settings = spec
            cells = d / "cells"
            found = sorted(c for c in cells.iterdir() if (c / "metrics.jsonl").is_file()) if cells.is_dir() else []
            for c in found:
                if include_partial or (c / "stability.json").is_file():
                    runs.append(c)
                else:
                    unfinished.append(c.name)
        elif (d / "metrics.jsonl").is_file():
            runs.append(d)
        else:
            raise FileNotFoundError(f"{d}: neither a run directory (metrics.jsonl) nor a comparison (compare.yaml)")
    return runs, {**settings, "unfinished": unfinished}


def seed_statistics(run: Run, metric: str = "eval/accuracy", threshold: float | None = None) -> dict[str, Any]:
    """Per-run numbers: ``final`` and ``auc`` of ``metric``, ``steps_to_threshold`` (None if never;
    ``steps_to_threshold_censored`` uses last step + 1 then), ``worst_grad_norm``, ``steps_per_s``
    (steps / total step time), ``peak_memory_mb``, ``samples_per_step`` (completions generated a
    step, the mean over steps of ``sampling_rounds`` x ``prompts_per_step`` x ``num_generations``:
    dynamic sampling's cost), ``any_flag`` (0/1) and ``steps`` done."""
    s, v = run.curve(metric)
    out: dict[str, Any] = {"steps": len(run.records)}
    if s:
        out["final"] = v[-1]
        out["auc"] = auc(s, v)
        if threshold is not None:
            hit = steps_to_threshold(s, v, threshold)
            out["steps_to_threshold"] = hit
            out["steps_to_threshold_censored"] = hit if hit is not None else s[-1] + 1
    g = run.curve("grad_norm")[1]
    if g:
        out["worst_grad_norm"] = max(g)
    times = [r["time/step"] for r in run.records if isinstance(r.get("time/step"), (int, float))]
    if times and sum(times) > 0:
        out["steps_per_s"] = len(times) / sum(times)
    mem = run.curve("memory/peak_mb")[1]
    if mem:
        out["peak_memory_mb"] = max(mem)
    rounds = run.curve("sampling_rounds")[1]
    per_round = int(run.config.get("prompts_per_step") or 0) * int(run.config.get("num_generations") or 0)
    if rounds and per_round:
        out["samples_per_step"] = per_round * sum(rounds) / len(rounds)
    out["any_flag"] = 1.0 if run.stability.get("any") else 0.0
    return out


def aggregate_curves(runs: Sequence[Run], key: str) -> dict[str, Any] | None:
    """Mean / std / 95% bootstrap band over the runs of one arm at the steps all of them have."""
    curves = [r.curve(key) for r in runs]
    curves = [c for c in curves if c[0]]
    if not curves:
        return None
    common = sorted(set.intersection(*(set(c[0]) for c in curves)))
    if not common:
        return None
    mat = [[dict(zip(*c))[s] for s in common] for c in curves]
    return {"steps": common, **mean_std_ci(mat)}


#: a difference below this (times the compared values' magnitude when above 1) is float noise of
#: summing per-seed values, printed as 0 (e.g. -1.85e-17 between two identical arms)
FLOAT_NOISE = 1e-12


def _fmt_noise(x: Any, *scale: Any, nd: int = 3) -> str:
    """:func:`_fmt` of a difference, 0 when it is within float noise of the values it compares
    (``|x| <= FLOAT_NOISE * max(1, |scale|...)``)."""
    mags = [abs(v) for v in scale if isinstance(v, (int, float)) and math.isfinite(v)]
    if isinstance(x, float) and math.isfinite(x) and abs(x) <= FLOAT_NOISE * max([1.0, *mags]):
        return "0"
    return _fmt(x, nd)


def _signed(text: str) -> str:
    """``+`` before a positive number's text (a change), as it is."""
    return "+" + text if text not in ("0", "n/a") and not text.startswith("-") else text


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1e4 else f"{x:.3e}"
    return str(x)


def _pm(stat: dict[str, Any] | None, nd: int = 3) -> str:
    if not stat:
        return "n/a"
    return f"{_fmt(stat['mean'], nd)} ± {_fmt(stat['std'], nd)} [{_fmt(stat['ci_low'], nd)}, {_fmt(stat['ci_high'], nd)}]"


def arm_rows(per_seed: dict[str, dict[int, dict[str, Any]]], arms: dict[str, list[Run]], order: Sequence[str],
             threshold: float | None, seeds: Sequence[int] | None = None,
             baseline: str | None = None) -> dict[str, dict[str, Any]]:
    """Per-arm summary rows (mean / std / bootstrap interval of each statistic, threshold hits,
    flag counts, speed and memory ratios to ``baseline``), over ``seeds`` only when given."""
    keep = None if seeds is None else set(seeds)
    rows: dict[str, dict[str, Any]] = {}
    for a in order:
        ps = {s: v for s, v in per_seed[a].items() if keep is None or s in keep}
        runs = [r for r in arms[a] if keep is None or r.seed in keep]
        if not ps:
            continue
        row: dict[str, Any] = {"seeds": sorted(ps), "n": len(ps)}
        for stat in ("final", "auc", "worst_grad_norm", "steps_per_s", "peak_memory_mb", "samples_per_step",
                     "steps_to_threshold_censored"):
            vals = [v[stat] for v in ps.values() if v.get(stat) is not None]
            row[stat] = mean_std_ci(vals) if vals else None
        if threshold is not None:
            hits = [v.get("steps_to_threshold") for v in ps.values()]
            reached = [h for h in hits if h is not None]
            row["threshold_reached"] = f"{len(reached)}/{len(hits)}"
            row["steps_to_threshold_mean_reached"] = sum(reached) / len(reached) if reached else None
        row["worst_grad_norm_max"] = max((v["worst_grad_norm"] for v in ps.values() if "worst_grad_norm" in v),
                                         default=None)
        row["flags"] = {f: sum(bool(r.stability["flags"].get(f)) for r in runs) for f in FLAG_NAMES}
        row["flags_not_judged"] = {f: sum(r.stability["flags"].get(f) is None for r in runs) for f in FLAG_NAMES}
        rows[a] = row
    if baseline in rows:
        b = rows[baseline]
        for row in rows.values():
            for stat in ("steps_per_s", "peak_memory_mb"):
                num, den = row.get(stat), b.get(stat)
                row[f"{stat}_ratio"] = num["mean"] / den["mean"] if num and den and den["mean"] else None
    return rows


def _values(per_seed: dict[str, dict[int, dict[str, Any]]], arm: str, key: str) -> dict[int, float]:
    return {s: float(v[key]) for s, v in per_seed[arm].items() if v.get(key) is not None}


def _claim_values(per_seed: dict[str, dict[int, dict[str, Any]]], arm: str, ref: str | None,
                  key: str) -> dict[int, float]:
    """``{seed: statistic}`` of ``arm``, or with ``ref`` the per-seed difference arm - ref (seeds in both)."""
    values = _values(per_seed, arm, key)
    if ref is None:
        return values
    other = _values(per_seed, ref, key)
    return {s: v - other[s] for s, v in values.items() if s in other}


def verdicts(claims: Sequence[dict[str, Any]], per_seed: dict[str, dict[int, dict[str, Any]]],
             baseline: str | None = None, seeds: Sequence[int] | None = None, rule: str = "paired_t",
             correction: str = "holm", alpha: float = ALPHA, power: float = POWER) -> list[dict[str, Any]]:
    """Apply the verdict rule to a study's claims (see :func:`echotrain.compare.stats.evaluate_claims`).

    Args:
        claims: ``{"claim", "arm", "baseline", "statistic", "direction", "margin"}`` each, optionally
            ``arm_ref`` and ``baseline_ref``: then the per-seed values compared are the differences
            (arm - arm_ref) and (baseline - baseline_ref), a difference of differences (e.g. the
            accuracy lost from staleness 0 to 8 by one objective against another's), paired by seed.
        per_seed: ``{arm: {seed: {statistic: value}}}`` (:func:`seed_statistics` per run, or the
            ``runs`` of a committed ``summary.json``).
        seeds: pair only these seeds (the confirmation seeds); None: every seed both arms have.

    Returns:
        One dict per claim: the claim's keys plus ``result``, ``p`` (the claim's decisive p-value),
        ``p_holm``, ``m`` (claims in the correction), ``mde`` (80%-power minimal detectable effect
        at ``alpha``), ``mde_holm`` (the same at ``alpha / m``, Holm's strictest step),
        ``comparison`` (:func:`paired_comparison`) and ``rule``, ``correction``, ``alpha``.
    """
    comps, ok = [], []
    for c in claims:
        arm, base, stat = c["arm"], c.get("baseline") or baseline, c["statistic"]
        key = "steps_to_threshold_censored" if stat == "steps_to_threshold" else stat
        needed = [arm, base] + [c[k] for k in ("arm_ref", "baseline_ref") if c.get(k)]
        if all(a in per_seed for a in needed):
            comps.append(paired_comparison(_claim_values(per_seed, arm, c.get("arm_ref"), key),
                                           _claim_values(per_seed, base, c.get("baseline_ref"), key),
                                           1 - alpha, rule=rule, seeds=seeds, power=power))
            ok.append(True)
        else:
            comps.append({"n": 0, "rule": rule})
            ok.append(False)
    results = evaluate_claims(comps, claims, alpha, correction)
    out = []
    for c, comp, res, present in zip(claims, comps, results, ok):
        base = c.get("baseline") or baseline
        entry = {**c, "baseline": base, **res, "rule": rule, "comparison": comp if present else {},
                 "mde": comp.get("mde", float("nan"))}
        m = max(res["m"], 1)
        entry["mde_holm"] = (min_detectable_effect(comp["diff_std"], comp["n"], alpha / m, power)
                             if present and comp["n"] >= 2 and correction == "holm" else entry["mde"])
        if not present:
            gone = [a for a in [c["arm"], base, c.get("arm_ref"), c.get("baseline_ref")] if a and a not in per_seed]
            entry["result"] = f"not run ({', '.join(dict.fromkeys(gone))} missing)"
        elif comp.get("rule_error"):
            entry["result"] = f"insufficient data ({comp['rule_error']})"
        elif comp["n"] < 2:
            entry["result"] = "insufficient data" + (" (confirmation seeds not run)" if seeds is not None else "")
        out.append(entry)
    return out


def build_report(runs: Sequence[Run], baseline: str | None = None, metric: str = "eval/accuracy",
                 threshold: float | None = None, verdict: Sequence[dict[str, Any]] = (),
                 arm_order: Sequence[str] | None = None, confirm_seeds: Sequence[int] | None = None,
                 rule: str = "paired_t", correction: str = "holm", alpha: float = ALPHA,
                 power: float = POWER) -> tuple[dict[str, Any], dict[str, Any]]:
    """Aggregate runs into (summary, curves) dicts (what summary.json / curves.json hold).

    With ``confirm_seeds`` the per-arm rows, paired comparisons and verdicts use those seeds only;
    the other seeds are reported under ``summary["exploration"]`` (rows, paired comparisons and
    the rule applied to them, marked exploratory). Curves are over every run."""
    arms: dict[str, list[Run]] = {}
    for r in runs:
        arms.setdefault(r.arm, []).append(r)
    order = [a for a in (arm_order or []) if a in arms] + sorted(a for a in arms if a not in (arm_order or []))
    per_seed = {a: {r.seed: seed_statistics(r, metric, threshold) for r in arms[a]} for a in order}
    confirm = sorted(confirm_seeds) if confirm_seeds else None
    explore = sorted({r.seed for r in runs} - set(confirm)) if confirm else None
    summary: dict[str, Any] = {"metric": metric, "threshold": threshold, "baseline": baseline, "arms": {},
                               "runs": [], "paired": {}, "verdict": [],
                               "verdict_rule": {"rule": rule, "correction": correction, "alpha": alpha, "power": power,
                                                "seeds": confirm if confirm else sorted({r.seed for r in runs}),
                                                "phase": "confirmation" if confirm else "all seeds"}}

    def paired(seeds: Sequence[int] | None) -> dict[str, Any]:
        if baseline not in per_seed:
            return {}
        return {a: {stat: paired_comparison(_values(per_seed, a, stat), _values(per_seed, baseline, stat), 1 - alpha,
                                            seeds=seeds, power=power)
                    for stat in ("auc", "final")} for a in order if a != baseline}

    summary["arms"] = arm_rows(per_seed, arms, order, threshold, confirm, baseline)
    summary["paired"] = paired(confirm)
    summary["verdict"] = verdicts(verdict, per_seed, baseline, confirm, rule, correction, alpha, power)
    if confirm:
        summary["exploration"] = {"seeds": explore, "arms": arm_rows(per_seed, arms, order, threshold, explore, baseline),
                                  "paired": paired(explore) if explore else {},
                                  "verdict": verdicts(verdict, per_seed, baseline, explore, "paired_t", correction,
                                                      alpha, power) if explore else []}
    for a in order:
        for r in sorted(arms[a], key=lambda r: r.seed):
            summary["runs"].append({"arm": a, "seed": r.seed, "path": str(r.path), **per_seed[a][r.seed],
                                    "phase": ("confirmation" if r.seed in confirm else "exploration") if confirm
                                    else None,
                                    "last_step": max((x.get("step", 0) for x in r.records), default=0),
                                    "config_steps": r.config.get("steps"), "commits": r.commits,
                                    "autocast": r.autocast, "autocast_reason": r.autocast_reason,
                                    "stability": r.stability["flags"],
                                    "stability_values": r.stability.get("values", {})})
    if runs:
        summary["stability_rules"] = runs[0].stability["rules"]
    summary["provenance"] = provenance(summary["runs"], _pairs(order, baseline, verdict))
    curves = {key: {a: agg for a in order if (agg := aggregate_curves(arms[a], key)) is not None}
              for key, _, _ in curve_specs()}
    curves = {k: v for k, v in curves.items() if v}
    return summary, curves


def _pairs(order: Sequence[str], baseline: str | None, claims: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (arm, reference) pairs whose cells the report compares seed by seed: every arm with the
    baseline, and each claim's arm / baseline / references."""
    pairs = [(a, baseline) for a in order if baseline and a != baseline]
    for c in claims:
        pairs.append((c["arm"], c.get("baseline") or baseline))
        pairs += [(c[k], c[k + "_ref"]) for k in ("arm", "baseline") if c.get(k + "_ref")]
    return [p for p in dict.fromkeys(pairs) if p[1] and p[0] != p[1]]


def provenance(runs: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Which commit and which precision ran the cells, and the compared pairs that differ.

    Args:
        runs: ``summary["runs"]`` entries (``arm``, ``seed``, ``commits``, ``autocast``,
            ``autocast_reason``).
        pairs: (arm, reference arm) label pairs compared seed by seed (:func:`_pairs`).

    Returns:
        ``{"commits": {commit(s) | "not recorded": cells}, "precision": {"<autocast>: <reason>" |
        "not recorded": cells}, "mixed_commits": [...], "mixed_precision": [...]}``; each mixed
        entry ``{"arm", "ref", "seed", "arm_value", "ref_value"}``: a pair of cells (same seed) whose
        commits (both recorded) or resolved precision (both recorded) differ, so the difference
        between them is not only the arms' settings.
    """
    def commit_of(r: dict[str, Any]) -> str | None:
        return " + ".join(r.get("commits") or []) or None

    def precision_of(r: dict[str, Any]) -> str | None:
        return r.get("autocast")

    out: dict[str, Any] = {"commits": {}, "precision": {}, "mixed_commits": [], "mixed_precision": []}
    for r in runs:
        c = commit_of(r) or "not recorded"
        out["commits"][c] = out["commits"].get(c, 0) + 1
        pr = (f"{r['autocast']} ({r.get('autocast_reason') or 'no reason recorded'})" if r.get("autocast")
              else "not recorded")
        out["precision"][pr] = out["precision"].get(pr, 0) + 1
    cell = {(r["arm"], r["seed"]): r for r in runs}
    for a, ref in pairs:
        for (arm, seed), r in cell.items():
            if arm != a or (ref, seed) not in cell:
                continue
            for key, get in (("mixed_commits", commit_of), ("mixed_precision", precision_of)):
                va, vr = get(r), get(cell[(ref, seed)])
                if va is not None and vr is not None and va != vr:
                    out[key].append({"arm": a, "ref": ref, "seed": seed, "arm_value": va, "ref_value": vr})
    return out


#: per-arm line styles and markers, cycled with the colours so that no two of the first 36 arms
#: look alike and overlapping arms stay distinguishable (a dashed line over a solid one)
ARM_LINESTYLES = ("-", "--", "-.", ":")
ARM_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")


def arm_style(i: int, n_arms: int) -> dict[str, Any]:
    """Matplotlib keyword arguments (colour, linestyle, marker) of the ``i``-th of ``n_arms`` arms."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if n_arms <= 10 else "tab20")
    return {"color": cmap(i % cmap.N), "linestyle": ARM_LINESTYLES[i % len(ARM_LINESTYLES)],
            "marker": ARM_MARKERS[i % len(ARM_MARKERS)]}


#: line styles of the sweep values (the arm is the colour): solid, dashed, dash-dot, dotted, then
#: dash patterns, so five values (the staleness dose's k = 0, 1, 2, 4, 8) are told apart
SWEEP_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3, 1, 3)))


def sweep_groups(labels: Sequence[str], sweep: dict[str, Any] | None) -> dict[str, tuple[str, int]]:
    """``{label: (arm, index of the sweep value)}`` for the labels ``arm[name=value]`` of ``sweep``
    (``{"name", "values"}``); {} without a sweep. Labels of other forms are left out."""
    if not sweep:
        return {}
    values = [str(v) for v in sweep.get("values") or []]
    out = {}
    for label in labels:
        head, sep, rest = label.partition(f"[{sweep['name']}=")
        if sep and rest.endswith("]") and rest[:-1] in values:
            out[label] = (head, values.index(rest[:-1]))
    return out


def group_style(arm_index: int, n_arms: int, value_index: int) -> dict[str, Any]:
    """Matplotlib keyword arguments of a sweep's cell label: the colour and marker of its arm
    (``arm_index`` of ``n_arms``), the line style of its sweep value (:data:`SWEEP_LINESTYLES`)."""
    style = arm_style(arm_index, n_arms)
    style["linestyle"] = SWEEP_LINESTYLES[value_index % len(SWEEP_LINESTYLES)]
    return style


def plot_curves(curves: dict[str, Any], out_dir: str | os.PathLike,
                groups: dict[str, tuple[str, int]] | None = None) -> list[Path]:
    """One PNG per metric (about 1000 x 560 px): every arm's mean curve, each arm with its own
    colour, line style and marker, with its shaded 95% bootstrap band; the legend sits outside
    the axes, so it hides no curve. With ``groups`` (:func:`sweep_groups`: label -> (arm, sweep
    value index)) the curves of a sweep group by arm: one colour and marker per arm, one line
    style per sweep value. Tick labels without offset notation
    (:func:`echotrain.train.plots.plain_tick_labels`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from echotrain.train.plots import plain_tick_labels

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    titles = {k: (t, y) for k, t, y in curve_specs()}
    groups = groups or {}
    written = []
    for key, per_arm in curves.items():
        fig, ax = plt.subplots(figsize=(9.0, 5.1))
        base_arms = list(dict.fromkeys(groups[a][0] for a in per_arm if a in groups))
        for i, (arm, agg) in enumerate(per_arm.items()):
            if arm in groups:
                style = group_style(base_arms.index(groups[arm][0]), len(base_arms), groups[arm][1])
            else:
                style = arm_style(i, len(per_arm))
            steps = agg["steps"]
            ax.plot(steps, agg["mean"], lw=1.8, markersize=5, markevery=max(1, len(steps) // 10),
                    label=f"{arm} (n={agg['n']})", **style)
            if agg["n"] > 1:
                ax.fill_between(steps, agg["ci_low"], agg["ci_high"], color=style["color"], alpha=0.12, lw=0)
        title, ylabel = titles.get(key, (key, ""))
        # wrapped and left-aligned: centred over the narrowed axes (the legend sits outside on the
        # right) a long title ran off the figure's left edge
        ax.set_title(textwrap.fill(f"{title}: mean over seeds, 95% bootstrap band", 75), fontsize=12, loc="left")
        ax.set_xlabel("step", fontsize=11)
        ax.set_ylabel(ylabel, fontsize=11)
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False,
                  handlelength=3.0)
        fig.tight_layout()
        plain_tick_labels(fig)
        path = out / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


#: the statistics of the dose-response figure
DOSE_STATISTICS = ("auc", "final")


def dose_response(runs: Sequence[dict[str, Any]], sweep: dict[str, Any], seeds: Sequence[int] | None = None,
                  statistics: Sequence[str] = DOSE_STATISTICS, alpha: float = ALPHA) -> dict[str, Any]:
    """Each statistic against the sweep value, per arm: its level and its change from the first
    sweep value, paired by seed (same seed = same prompts).

    Args:
        runs: ``summary["runs"]`` entries (``arm`` = ``arm[name=value]`` labels, ``seed``, the
            statistics); a committed ``summary.json`` works as well as a fresh one.
        sweep: ``{"name", "values"}`` (the comparison's sweep).
        seeds: only these seeds (the confirmation seeds); None: every seed.
        alpha: two-sided level of the intervals.

    Returns:
        ``{"sweep", "values", "seeds", "statistics": {stat: {arm: [point per sweep value]}}}``; a
        point is ``{"value", "n", "mean", "ci_low", "ci_high", "change"}``: mean over seeds and
        its (1 - alpha) t-interval, and ``change`` = :func:`~echotrain.compare.stats.paired_comparison`
        of the value's cells with the first value's (``diff_mean``, ``ci_low``, ``ci_high``, ``n``;
        the paired t-interval); values an arm has no run of are left out.
    """
    from echotrain.compare.stats import t_interval

    keep = None if seeds is None else set(seeds)
    groups = sweep_groups([r["arm"] for r in runs], sweep)
    values = list(sweep.get("values") or [])
    per: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in runs:
        if r["arm"] in groups and (keep is None or r["seed"] in keep):
            per.setdefault(groups[r["arm"]], {})[r["seed"]] = r
    arms = list(dict.fromkeys(a for a, _ in groups.values()))
    out: dict[str, Any] = {"sweep": sweep["name"], "values": values, "alpha": alpha,
                           "seeds": sorted({s for cells in per.values() for s in cells}), "statistics": {}}
    for stat in statistics:
        table: dict[str, list[dict[str, Any]]] = {}
        for a in arms:
            def vals(i: int) -> dict[int, float]:
                return {s: float(r[stat]) for s, r in per.get((a, i), {}).items()
                        if isinstance(r.get(stat), (int, float)) and math.isfinite(r[stat])}
            ref = vals(0)
            points = []
            for i, v in enumerate(values):
                x = vals(i)
                if not x:
                    continue
                lo, hi = (float(t) for t in t_interval(list(x.values()), 1 - alpha))
                ch = paired_comparison(x, ref, 1 - alpha) if i else None
                points.append({"value": v, "n": len(x), "mean": sum(x.values()) / len(x), "ci_low": lo, "ci_high": hi,
                               "change": ({k: ch[k] for k in ("n", "diff_mean", "ci_low", "ci_high")} if ch else
                                          {"n": len(x), "diff_mean": 0.0, "ci_low": 0.0, "ci_high": 0.0})})
            if points:
                table[a] = points
        if table:
            out["statistics"][stat] = table
    return out


def add_dose_response(summary: dict[str, Any], sweep: dict[str, Any], plot_dir: Path | None) -> None:
    """Put :func:`dose_response` into ``summary`` (``dose_response``, on the confirmation seeds when
    they have run, else on every seed run) and, with confirmation seeds run, the exploration
    seeds' into ``summary["exploration"]``; with ``plot_dir`` also their figures
    (``dose_response.png``, ``dose_response_exploration.png``; paths under ``dose_plot``)."""
    alpha = (summary.get("verdict_rule") or {}).get("alpha", ALPHA)
    explo = summary.get("exploration")
    confirmed = bool(explo) and bool(summary.get("arms"))
    parts = [(summary, summary["verdict_rule"]["seeds"] if confirmed else None, "dose_response.png")]
    if confirmed:
        parts.append((explo, explo["seeds"], "dose_response_exploration.png"))
    for where, seeds, name in parts:
        where["dose_response"] = dose_response(summary["runs"], sweep, seeds, alpha=alpha)
        png = plot_dose_response(where["dose_response"], plot_dir, alpha, name) if plot_dir is not None else None
        where["dose_plot"] = str(png) if png else None


def replot_report(report_dir: str | os.PathLike, sweep: dict[str, Any] | None = None) -> list[Path]:
    """Redraw a written report's figures from its ``curves.json`` and ``summary.json`` alone (no run
    directories needed: committed studies whose cells are gone): ``plots/<metric>.png`` (a sweep's
    curves grouped by arm) and, with a sweep, the dose-response figures. ``sweep``: ``{"name",
    "values"}``, default the summary's ``setting.sweep``. Returns the paths written; report.md is
    not rewritten (``summary["dose_response"]`` is added to summary.json).

    Raises:
        FileNotFoundError: no curves.json / summary.json in ``report_dir``.
    """
    d = Path(report_dir)
    curves = json.loads((d / "curves.json").read_text())
    summary = json.loads((d / "summary.json").read_text())
    sweep = sweep or (summary.get("setting") or {}).get("sweep")
    labels = list(dict.fromkeys(a for per_arm in curves.values() for a in per_arm))
    groups = sweep_groups(labels, sweep)
    written = plot_curves(curves, d / "plots", groups)
    if groups:
        add_dose_response(summary, sweep, d / "plots")
        for where in (summary, summary.get("exploration") or {}):
            if where.get("dose_plot"):
                where["dose_plot"] = os.path.relpath(where["dose_plot"], d)
                written.append(d / where["dose_plot"])
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return written


def plot_dose_response(dose: dict[str, Any], out_dir: str | os.PathLike, alpha: float = ALPHA,
                       name: str = "dose_response.png") -> Path | None:
    """``name`` (default ``dose_response.png``): per statistic of ``dose`` (:func:`dose_response`) a column, the
    level (mean over seeds, t-interval) on top and the change from the first sweep value (paired
    t-interval) below, against the sweep value; one colour and marker per arm, arms nudged apart
    on the x axis so their intervals do not hide each other. Numeric sweep values are placed at
    their values (staleness 0, 1, 2, 4, 8), others and values that would crowd (a gap under 8% of
    the span: bands 0.002, 0.005, ..., 0.05) at equal spacing. Returns the path, or None without data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from echotrain.train.plots import plain_tick_labels

    stats_ = [k for k in DOSE_STATISTICS if k in dose["statistics"]] + [
        k for k in dose["statistics"] if k not in DOSE_STATISTICS]
    if not stats_:
        return None
    values = dose["values"]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and len(values) > 1
    if numeric:  # at their values unless two would crowd (a gap under 8% of the span): then evenly
        srt = sorted(float(v) for v in values)
        span_v = srt[-1] - srt[0]
        numeric = span_v > 0 and min(b - a for a, b in zip(srt, srt[1:])) >= 0.08 * span_v
    xs = [float(v) for v in values] if numeric else list(range(len(values)))
    span = (max(xs) - min(xs)) or 1.0
    level = f"{1 - alpha:.0%}"
    names = {"auc": "AUC", "final": "final"}
    fig, axes = plt.subplots(2, len(stats_), figsize=(6.2 * len(stats_), 7.6), squeeze=False)
    for col, stat in enumerate(stats_):
        table = dose["statistics"][stat]
        for i, (arm, points) in enumerate(table.items()):
            st = arm_style(i, len(table))
            nudge = (i - (len(table) - 1) / 2) * 0.012 * span
            x = [xs[values.index(p["value"])] + nudge for p in points]
            for row, (get, key) in enumerate(((lambda p: p, "mean"), (lambda p: p["change"], "diff_mean"))):
                ys = [get(p)[key] for p in points]
                err = [[max(0.0, y - get(p)["ci_low"]) if math.isfinite(get(p)["ci_low"]) else 0.0
                        for y, p in zip(ys, points)],
                       [max(0.0, get(p)["ci_high"] - y) if math.isfinite(get(p)["ci_high"]) else 0.0
                        for y, p in zip(ys, points)]]
                axes[row][col].errorbar(x, ys, yerr=err, color=st["color"], marker=st["marker"], lw=1.8, capsize=4,
                                        markersize=6, label=f"{arm} (n={max(p['n'] for p in points)})")
        label = names.get(stat, stat)
        first = f"{dose['sweep']}={values[0]}"
        axes[0][col].set_title(textwrap.fill(f"{label}: mean over seeds, {level} t-interval", 48), fontsize=11, loc="left")
        axes[1][col].set_title(textwrap.fill(f"{label} change from {first}, paired by seed, {level} paired t-interval",
                                             48), fontsize=11, loc="left")
        axes[1][col].axhline(0.0, color="gray", lw=0.8)
        for ax in axes[:, col]:
            ax.set_xlabel(dose["sweep"], fontsize=10)
            ax.set_xticks(xs, [str(v) for v in values])
            ax.grid(alpha=0.3)
        axes[0][col].set_ylabel(label, fontsize=10)
        axes[1][col].set_ylabel(f"{label} − {label} at {first}", fontsize=10)
    axes[0][-1].legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    plain_tick_labels(fig)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _dose_table(dose: dict[str, Any]) -> list[str]:
    """Markdown rows of :func:`dose_response`: per arm and statistic, the level and the change
    from the first sweep value at each sweep value."""
    values = dose["values"]
    lines = ["| arm | statistic | " + " | ".join(f"{dose['sweep']}={v}" for v in values) + " |",
             "|---|---|" + "---|" * len(values)]
    for stat, table in dose["statistics"].items():
        for arm, points in table.items():
            at = {str(p["value"]): p for p in points}
            cell = [(f"{_fmt(at[str(v)]['mean'])}" + ("" if i == 0 else
                     f" ({_signed(_fmt_noise(at[str(v)]['change']['diff_mean'], at[str(v)]['mean']))} "
                     f"[{_fmt_noise(at[str(v)]['change']['ci_low'], at[str(v)]['mean'])}, "
                     f"{_fmt_noise(at[str(v)]['change']['ci_high'], at[str(v)]['mean'])}])"))
                    if str(v) in at else "n/a" for i, v in enumerate(values)]
            lines.append(f"| {arm} | {stat} | " + " | ".join(cell) + " |")
    return lines


def _seed_list(seeds: Sequence[int]) -> str:
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds)) or "none"


def sign_test_min_n(alpha: float) -> int:
    """Fewest seeds at which equal differences (the sign test's p = 2^(1-n)) can be decisive at
    ``alpha`` (6 at 0.05), before any Holm correction."""
    return math.floor(1 - math.log2(alpha)) + 1


def rule_text(vr: dict[str, Any]) -> str:
    """The verdict rule in words, with its settings (``summary["verdict_rule"]``)."""
    alpha = vr.get("alpha", ALPHA)
    level = f"{1 - alpha:.0%}"
    interval = ("paired t-interval" if vr.get("rule", "paired_t") == "paired_t"
                else "BCa bootstrap interval (10,000 resamples, fixed seed)")
    corr = (" The p-values of the study's claims are Holm-corrected together (step-down; the chance of any "
            "false verdict in the study stays <= alpha)." if vr.get("correction", "holm") == "holm"
            else " No correction across claims.")
    seeds = vr.get("seeds")
    phase = vr.get("phase", "all seeds")
    on = ("" if seeds is None else f" Verdicts on the confirmation seeds {_seed_list(seeds)}." if phase == "confirmation"
          else f" Verdicts on every seed run: {_seed_list(seeds)}.")
    return (f"Per seed the statistic of the arm minus that of the baseline (same seed = same prompts); the {level} "
            f"{interval} of the mean difference. A claim *holds* when its test against the margin on the claimed "
            f"side has p < {alpha:g} (with one claim: the {level} interval lies entirely beyond the margin), is "
            f"*contradicted* when its test against 0 on the other side has p < {alpha:g}, otherwise *inconclusive*. "
            f"When every paired difference is equal (zero variance, e.g. a 0/1 flag on every seed) the p-value is the "
            f"exact sign test's, 2^(1-n): no verdict below {sign_test_min_n(alpha)} seeds."
            f"{corr} MDE: the smallest true difference the paired t-test detects with "
            f"{vr.get('power', POWER):.0%} power at two-sided {alpha:g} (noncentral t, from the observed SD of the "
            f"differences and n; in parentheses at alpha / m, Holm's strictest step); an inconclusive claim "
            f"rules out no difference smaller than that.{on}")


def _arm_table(rows: dict[str, Any], metric: str, th: Any, b: str | None) -> list[str]:
    lines = [f"| arm | seeds | final {metric} | AUC | steps to {th} (reached) | worst grad norm (max) | "
             f"steps/s{' / ' + b if b else ''} | peak mem{' / ' + b if b else ''} | samples / step | flags (runs) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a, row in rows.items():
        flags = ", ".join(f"{k} {v}" for k, v in row["flags"].items() if v) or "none"
        sts = (f"{_fmt(row.get('steps_to_threshold_mean_reached'))} ({row.get('threshold_reached')})"
               if th is not None else "n/a")
        ratio = (lambda k: _fmt(row.get(f"{k}_ratio")) if b and f"{k}_ratio" in row
                 else _fmt((row.get(k) or {}).get("mean")))
        lines.append(f"| {a} | {row['n']} | {_pm(row['final'])} | {_pm(row['auc'])} | {sts} | "
                     f"{_fmt(row['worst_grad_norm_max'])} | {ratio('steps_per_s')} | {ratio('peak_memory_mb')} | "
                     f"{_fmt((row.get('samples_per_step') or {}).get('mean'), 4)} | {flags} |")
    return lines


def _paired_table(paired: dict[str, Any], vr: dict[str, Any]) -> list[str]:
    level = f"{1 - vr.get('alpha', ALPHA):.0%}"
    lines = [f"Difference arm − baseline per seed (same seed = same prompts); {level} paired t-interval; p-values "
             f"of the paired t-test and of Welch's t-test; MDE at {vr.get('power', POWER):.0%} power (no correction).",
             "", f"| arm | statistic | n | arm mean | base mean | diff mean [{level} CI] | p paired | p Welch | MDE |",
             "|---|---|---|---|---|---|---|---|---|"]
    unpaired = [a for a, comps in paired.items() if not any(c["n"] for c in comps.values())]
    for a, comps in paired.items():
        if a in unpaired:
            continue
        for stat, c in comps.items():
            sc = (c["arm_mean"], c["base_mean"])
            lines.append(f"| {a} | {stat} | {c['n']} | {_fmt(c['arm_mean'])} | {_fmt(c['base_mean'])} | "
                         f"{_fmt_noise(c['diff_mean'], *sc)} [{_fmt_noise(c['ci_low'], *sc)}, "
                         f"{_fmt_noise(c['ci_high'], *sc)}] | "
                         f"{_fmt(c['p_paired_t'])} | {_fmt(c['p_welch'])} | {_fmt(c.get('mde'))} |")
    if unpaired:
        lines += ["", f"No seed in common with the baseline here: {', '.join(unpaired)}."]
    return lines


def verdict_phrase(v: dict[str, Any]) -> str:
    """``holds`` / ``contradicted`` / ``inconclusive: no difference larger than X detectable`` ..."""
    comp = v.get("comparison") or {}
    if v["result"] == "inconclusive" and comp.get("n", 0) >= 2 and comp.get("diff_std") == 0:
        return "inconclusive: every paired difference is equal (no variation to test)"
    if v["result"] == "inconclusive" and isinstance(v.get("mde"), float) and math.isfinite(v["mde"]):
        return f"inconclusive: no difference larger than {_fmt(v['mde'], 2)} detectable"
    return v["result"]


def _verdict_table(rows: Sequence[dict[str, Any]], vr: dict[str, Any]) -> list[str]:
    level = f"{1 - vr.get('alpha', ALPHA):.0%}"
    holm = vr.get("correction", "holm") == "holm"
    lines = [f"| claim | arm vs baseline | statistic | direction (margin) | n | diff [{level} CI] | p | "
             f"{'p Holm | ' if holm else ''}MDE 80%{' (Holm)' if holm else ''} | result |",
             "|---|---|---|---|---|---|---|" + ("---|" if holm else "") + "---|---|"]
    for c in rows:
        comp = c.get("comparison") or {}
        sc = (comp.get("arm_mean"), comp.get("base_mean"))
        diff = (f"{_fmt_noise(comp.get('diff_mean'), *sc)} [{_fmt_noise(comp.get('ci_low'), *sc)}, "
                f"{_fmt_noise(comp.get('ci_high'), *sc)}]" if comp.get("n") else "n/a")
        mde = _fmt(c.get("mde")) + (f" ({_fmt(c.get('mde_holm'))})" if holm else "")
        pair = (f"({c['arm']} - {c['arm_ref']}) vs ({c['baseline']} - {c['baseline_ref']})" if c.get("arm_ref")
                else f"{c['arm']} vs {c['baseline']}")
        lines.append(f"| {c['claim']} | {pair} | {c['statistic']} | "
                     f"{c['direction']} ({c.get('margin', 0)}) | {comp.get('n', 0)} | {diff} | {_fmt(c.get('p'))} | "
                     + (f"{_fmt(c.get('p_holm'))} | " if holm else "") + f"{mde} | **{verdict_phrase(c)}** |")
    return lines


def _dose_lines(part: dict[str, Any], which: str, out_dir: Path) -> list[str]:
    """The dose-response section of ``part`` (the summary or its exploration: ``dose_response``,
    ``dose_plot``) on the ``which`` seeds; [] without one."""
    dose = part.get("dose_response")
    if not dose or not dose.get("statistics"):
        return []
    level = f"{1 - dose.get('alpha', ALPHA):.0%}"
    lines = ["", f"## Dose-response: the statistics against `{dose['sweep']}` ({which})", "",
             f"Per arm, on seeds {_seed_list(dose['seeds'])} ({which}): the mean over seeds and, in parentheses, "
             f"the change from `{dose['sweep']}={dose['values'][0]}` paired by seed [{level} paired t-interval].", ""]
    if part.get("dose_plot"):
        lines += [f"![dose_response]({os.path.relpath(part['dose_plot'], out_dir)})", ""]
    return lines + _dose_table(dose)


def _ran_lines(summary: dict[str, Any]) -> list[str]:
    """What ran, from the runs themselves (seeds, steps, the last step read under ``max_step``),
    and a warning when the comparison file's description was written for other settings (the
    command line's overrides, ``summary["overridden"]``)."""
    runs = summary.get("runs") or []
    lines: list[str] = []
    over = summary.get("overridden") or {}
    if over:
        lines += ["**The description above was written for the comparison file's settings; these runs override "
                  "them:** " + "; ".join(f"`{k}` {v['file']} in the file, {v['ran']} here" for k, v in over.items())
                  + ". The numbers below are of what ran.", ""]
    if not runs:
        return lines
    seeds = sorted({r["seed"] for r in runs})
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    configured = sorted({r["config_steps"] for r in runs if isinstance(r.get("config_steps"), int)})
    last = [r.get("last_step", r.get("steps", 0)) for r in runs]
    logged = sorted({r["steps"] for r in runs if isinstance(r.get("steps"), int)})
    steps = (f"configured for {configured[0]} steps" if len(configured) == 1 else
             f"configured for {configured[0]}-{configured[-1]} steps" if configured else
             # a summary written before config_steps was recorded: the steps logged
             "of " + (f"{logged[0]}" if len(logged) == 1 else f"{logged[0]}-{logged[-1]}") + " logged steps")
    text = (f"What ran: {len(arms)} arm{'s' if len(arms) != 1 else ''} x {len(seeds)} seed"
            f"{'s' if len(seeds) != 1 else ''} ({_seed_list(seeds)}), {len(runs)} runs {steps}; ")
    hi, lo = max(last), min(last)
    ms = summary.get("max_step")
    if ms is not None and ms < hi:
        text += f"every run is read up to step {ms} (`max_step`)."
    elif ms is not None:
        text += (f"`max_step` {ms} is beyond the last step logged, so every run is read to its end "
                 f"(step {hi}" + (f"; the shortest run stops at step {lo})." if lo != hi else ")."))
    else:
        text += f"every run is read to its end (step {hi}" + (f"; the shortest at step {lo})." if lo != hi else ").")
    return lines + [text, ""]


def _provenance_lines(prov: dict[str, Any]) -> list[str]:
    """The commits and the resolved precision of the cells, and the compared pairs of cells
    whose commit or precision differ (:func:`provenance`)."""
    if not prov:
        return []
    def counts(d: dict[str, int]) -> str:
        return "; ".join(f"{k} ({v} cell{'s' if v != 1 else ''})" for k, v in d.items())
    lines = [f"Commit of echotrain that ran the cells: {counts(prov.get('commits') or {})}.",
             f"Precision of the forward passes (run_info.json `autocast`): {counts(prov.get('precision') or {})}.", ""]
    for key, what in (("mixed_commits", "commits"), ("mixed_precision", "precision")):
        mixed = prov.get(key) or []
        if mixed:
            shown = "; ".join(f"{m['arm']} vs {m['ref']} seed {m['seed']} ({m['arm_value']} vs {m['ref_value']})"
                              for m in mixed[:10])
            lines += [f"**Warning: {len(mixed)} compared pair{'s' if len(mixed) != 1 else ''} of cells ran with "
                      f"different {what}**, so their difference is not only the arms' settings: {shown}"
                      + (" ..." if len(mixed) > 10 else "") + ".", ""]
    return lines


def render_markdown(summary: dict[str, Any], plots: Sequence[Path], out_dir: Path, title: str = "Comparison") -> str:
    """The report as Markdown."""
    b = summary.get("baseline")
    th = summary.get("threshold")
    metric = summary["metric"]
    lines = [f"# {title}", "",
             f"Statistic curve: `{metric}`; mean ± std over seeds [95% percentile-bootstrap interval of the mean]. "
             f"AUC = trapezoid area under the curve / step span (the mean level over the run).", ""]
    if summary.get("notes"):
        lines += [summary["notes"].rstrip(), ""]
    st = summary.get("setting") or {}
    if st:
        lines += ["## Setting", ""]
        if st.get("command"):
            lines += ["```", st["command"], "```", ""]
        if st.get("description"):
            lines += [" ".join(str(st["description"]).split()), ""]
        if st.get("seeds") is not None:
            lines += [f"Seeds: {st['seeds']}" + (f" (exploration); confirmation seeds: {st['confirm_seeds']}"
                                                 if st.get("confirm_seeds") else "") + ".", ""]
        if st.get("base"):
            lines += ["Every cell: " + ", ".join(f"`{k}={v}`" for k, v in st["base"].items()) + ".", ""]
        if st.get("arms"):
            lines += ["| arm | settings |", "|---|---|"]
            lines += [f"| {a} | {', '.join(f'`{k}={v}`' for k, v in (vals or {}).items()) or '(base)'} |"
                      for a, vals in st["arms"].items()]
            lines.append("")
        if st.get("sweep"):
            sw = st["sweep"]
            lines += [f"Sweep `{sw['name']}`: {', '.join(map(str, sw['values']))} (sets {', '.join(sw['keys'])}).", ""]
    lines += _ran_lines(summary)
    if summary.get("unfinished_cells"):
        lines += [f"Unfinished cells (not included): {', '.join(summary['unfinished_cells'])}.", ""]
    lines += _provenance_lines(summary.get("provenance") or {})
    vr = summary.get("verdict_rule") or {}
    explo = summary.get("exploration")
    confirmed = bool(summary["arms"])  # a confirmation seed has run (or there is one phase)
    explored = bool(explo and explo.get("seeds"))  # (a confirmation of a screening run in another comparison: none)

    def exploration_section() -> list[str]:
        out = [f"## Exploration seeds {_seed_list(explo['seeds'])} (exploration: not verdicts)", ""]
        if explo["arms"]:
            out += _arm_table(explo["arms"], metric, th, b)
        if explo.get("paired"):
            out += [""] + _paired_table(explo["paired"], vr)
        if explo.get("verdict"):
            out += ["", "The claims checked on the exploration seeds (paired t, same correction): a screening "
                    "that says which claims are worth confirming, not a verdict.", ""]
            out += _verdict_table(explo["verdict"], {**vr, "rule": "paired_t"})
        if explo.get("dose_response"):
            out += _dose_lines(explo, "exploration seeds", out_dir)
        elif not confirmed:
            out += _dose_lines(summary, "exploration seeds", out_dir)
        return out

    if explo and not confirmed:
        lines += [f"Seeds: exploration {_seed_list(explo['seeds'])}; the confirmation seeds "
                  f"{_seed_list(vr.get('seeds', []))} have not run yet. Below: the exploration results (a "
                  "screening, not verdicts); the verdicts wait for the confirmation seeds.", ""]
        lines += exploration_section()
    elif explored:
        lines += [f"Seeds: exploration {_seed_list(explo['seeds'])}; confirmation {_seed_list(vr.get('seeds', []))}. "
                  "The summary, the paired comparisons and the verdicts use the confirmation seeds only; the "
                  "exploration seeds are reported at the end, as exploration.", ""]
    elif explo:
        lines += [f"Seeds: confirmation {_seed_list(vr.get('seeds', []))} only (no exploration seed ran in this "
                  "comparison). The summary, the paired comparisons and the verdicts use them.", ""]
    if confirmed:
        lines += ["## Summary" + (" (confirmation seeds)" if explo else ""), ""]
        lines += _arm_table(summary["arms"], metric, th, b)
    if summary["paired"] and confirmed:
        lines += ["", f"## Paired comparison with `{b}` over seeds" + (" (confirmation seeds)" if explo else ""), ""]
        lines += _paired_table(summary["paired"], vr)
    if confirmed or not explo:
        lines += _dose_lines(summary, "confirmation seeds" if explo else "every seed run", out_dir)
    if summary["verdict"] or summary.get("dropped_verdicts"):
        lines += ["", "## Verdict rule (written before the runs) and outcome", "", rule_text(vr), ""]
        lines += _verdict_table(summary["verdict"], vr)
        if summary.get("dropped_verdicts"):
            lines.append("")
        for d in summary.get("dropped_verdicts") or []:
            lines.append(f"- not evaluated ({d['reason']}): {d['claim']}")
    if explored and confirmed:
        lines += [""] + exploration_section()
    rules = summary.get("stability_rules", {})
    lines += ["", "## Stability flags per run", "", "Rules: " + "; ".join(f"`{k}`: {v}" for k, v in rules.items()), "",
              "| arm | seed | steps | " + " | ".join(FLAG_NAMES) + " |", "|---|---|---|" + "---|" * len(FLAG_NAMES)]
    for r in summary["runs"]:
        cells = ["**yes**" if r["stability"].get(f) else ("n/a" if r["stability"].get(f) is None else "no")
                 for f in FLAG_NAMES]
        lines.append(f"| {r['arm']} | {r['seed']} | {r['steps']} | " + " | ".join(cells) + " |")
    if plots:
        lines += ["", "## Curves", ""]
        for p in plots:
            rel = os.path.relpath(p, out_dir)
            lines.append(f"![{p.stem}]({rel})")
    return "\n".join(lines) + "\n"


def _round(obj: Any, digits: int = 5) -> Any:
    """Floats to ``digits`` significant digits (curves.json stays small enough to commit)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _round(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v, digits) for v in obj]
    return obj


def write_report(dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None,
                 baseline: str | None = None, metric: str | None = None, threshold: float | None = None,
                 title: str | None = None, plots: bool = True, include_partial: bool = False,
                 notes: str | os.PathLike | None = None, max_step: int | None = None) -> Path:
    """Aggregate run / comparison directories and write the report; returns the report.md path.

    Explicit arguments override the comparison's ``compare.yaml`` settings; ``notes``: a Markdown
    file inserted under the title (e.g. the written verdict); ``max_step``: read every run up to
    that step only (see :func:`load_run`). Default ``out_dir``:
    ``<first comparison dir>/report`` (or ``./compare-report``).

    Raises:
        FileNotFoundError: a directory that is neither a run nor a comparison.
        ValueError: no runs found.
    """
    paths, settings = collect_runs(dirs, include_partial)
    if not paths:
        raise ValueError(f"no run directories with metrics.jsonl under {list(map(str, dirs))}")
    rep = settings.get("report") or {}
    thresholds = StabilityThresholds(**(rep.get("stability") or {}))
    max_step = max_step if max_step is not None else rep.get("max_step")
    runs = [load_run(p, thresholds, max_step) for p in paths]
    baseline = baseline or settings.get("baseline")
    metric = metric or rep.get("metric") or "eval/accuracy"
    threshold = threshold if threshold is not None else rep.get("threshold")
    arm_order = None
    if settings.get("arms"):
        sweep = settings.get("sweep")
        arm_order = ([f"{a}[{sweep['name']}={v}]" for a in settings["arms"] for v in sweep["values"]]
                     if sweep else list(settings["arms"]))
    rule_keys = {k: rep[k] for k in ("rule", "correction", "alpha", "power") if rep.get(k) is not None}
    summary, curves = build_report(runs, baseline=baseline, metric=metric, threshold=threshold,
                                   verdict=settings.get("verdict") or [], arm_order=arm_order,
                                   confirm_seeds=settings.get("confirm_seeds") or None, **rule_keys)
    summary["dropped_verdicts"] = settings.get("dropped_verdicts") or []
    first_cmp = next((Path(d) for d in dirs if (Path(d) / "compare.yaml").is_file()), None)
    out = Path(out_dir) if out_dir else (first_cmp / "report" if first_cmp else Path("compare-report"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "curves.json").write_text(json.dumps(_round(curves)) + "\n")
    sweep = settings.get("sweep")
    groups = sweep_groups([r.arm for r in runs], sweep)
    written = plot_curves(curves, out / "plots", groups) if plots else []
    if groups:
        add_dose_response(summary, sweep, out / "plots" if plots else None)
    summary["unfinished_cells"] = settings["unfinished"]
    summary["overridden"] = settings.get("overridden") or {}
    summary["max_step"] = max_step
    summary["setting"] = {k: settings[k] for k in ("command", "description", "seeds", "confirm_seeds", "base", "arms",
                                                   "sweep")
                          if settings.get(k) is not None}
    if notes:
        summary["notes"] = Path(notes).read_text()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    md = render_markdown(summary, written, out, title or f"Comparison: {settings.get('name', 'runs')}")
    (out / "report.md").write_text(md)
    return out / "report.md"
