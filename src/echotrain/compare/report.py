"""The comparison report: reads run directories, aggregates over seeds, writes Markdown + JSON + PNG.

Inputs are ordinary run directories (``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``); a
comparison directory (``compare.yaml`` + ``cells/``) expands to its cells and brings its
baseline, threshold and verdict rule. A run's arm is its ``cell.json`` label, else its preset.

Outputs in ``out_dir``: ``report.md``, ``summary.json`` (per-seed statistics, per-arm summary,
paired comparisons, verdicts with their p-values, Holm-adjusted p-values and minimal detectable
effects, the exploration seeds' results apart when the study declares ``confirm_seeds``,
stability flags), ``curves.json`` (per-arm mean / std / 95%
bootstrap interval per step of every metric, 5 significant digits) and ``plots/<metric>.png`` (all arms' mean curves
with shaded 95% bands). The statistics are :mod:`echotrain.compare.stats`.
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
                                    "stability": r.stability["flags"],
                                    "stability_values": r.stability.get("values", {})})
    if runs:
        summary["stability_rules"] = runs[0].stability["rules"]
    curves = {key: {a: agg for a in order if (agg := aggregate_curves(arms[a], key)) is not None}
              for key, _, _ in curve_specs()}
    curves = {k: v for k, v in curves.items() if v}
    return summary, curves


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


def plot_curves(curves: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """One PNG per metric (about 1000 x 560 px): every arm's mean curve, each arm with its own
    colour, line style and marker, with its shaded 95% bootstrap band; the legend sits outside
    the axes, so it hides no curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    titles = {k: (t, y) for k, t, y in curve_specs()}
    written = []
    for key, per_arm in curves.items():
        fig, ax = plt.subplots(figsize=(9.0, 5.1))
        for i, (arm, agg) in enumerate(per_arm.items()):
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
        path = out / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _seed_list(seeds: Sequence[int]) -> str:
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds)) or "none"


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
    on = f" Verdicts on the {vr.get('phase', 'all')} seeds {_seed_list(seeds)}." if seeds is not None else ""
    return (f"Per seed the statistic of the arm minus that of the baseline (same seed = same prompts); the {level} "
            f"{interval} of the mean difference. A claim *holds* when its test against the margin on the claimed "
            f"side has p < {alpha:g} (with one claim: the {level} interval lies entirely beyond the margin), is "
            f"*contradicted* when its test against 0 on the other side has p < {alpha:g}, otherwise *inconclusive*."
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
            lines.append(f"| {a} | {stat} | {c['n']} | {_fmt(c['arm_mean'])} | {_fmt(c['base_mean'])} | "
                         f"{_fmt(c['diff_mean'])} [{_fmt(c['ci_low'])}, {_fmt(c['ci_high'])}] | "
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
        diff = (f"{_fmt(comp.get('diff_mean'))} [{_fmt(comp.get('ci_low'))}, {_fmt(comp.get('ci_high'))}]"
                if comp.get("n") else "n/a")
        mde = _fmt(c.get("mde")) + (f" ({_fmt(c.get('mde_holm'))})" if holm else "")
        pair = (f"({c['arm']} - {c['arm_ref']}) vs ({c['baseline']} - {c['baseline_ref']})" if c.get("arm_ref")
                else f"{c['arm']} vs {c['baseline']}")
        lines.append(f"| {c['claim']} | {pair} | {c['statistic']} | "
                     f"{c['direction']} ({c.get('margin', 0)}) | {comp.get('n', 0)} | {diff} | {_fmt(c.get('p'))} | "
                     + (f"{_fmt(c.get('p_holm'))} | " if holm else "") + f"{mde} | **{verdict_phrase(c)}** |")
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
    if summary.get("max_step") is not None:
        lines += [f"Every run is read up to step {summary['max_step']} (`max_step`).", ""]
    if summary.get("unfinished_cells"):
        lines += [f"Unfinished cells (not included): {', '.join(summary['unfinished_cells'])}.", ""]
    vr = summary.get("verdict_rule") or {}
    explo = summary.get("exploration")
    if explo:
        lines += [f"Seeds: exploration {_seed_list(explo['seeds'])}; confirmation {_seed_list(vr.get('seeds', []))}. "
                  "The summary, the paired comparisons and the verdicts use the confirmation seeds only; the "
                  "exploration seeds are reported at the end, as exploration.", ""]
    lines += ["## Summary" + (" (confirmation seeds)" if explo else ""), ""]
    lines += _arm_table(summary["arms"], metric, th, b)
    if summary["paired"]:
        lines += ["", f"## Paired comparison with `{b}` over seeds" + (" (confirmation seeds)" if explo else ""), ""]
        lines += _paired_table(summary["paired"], vr)
    if summary["verdict"] or summary.get("dropped_verdicts"):
        lines += ["", "## Verdict rule (written before the runs) and outcome", "", rule_text(vr), ""]
        lines += _verdict_table(summary["verdict"], vr)
        if summary.get("dropped_verdicts"):
            lines.append("")
        for d in summary.get("dropped_verdicts") or []:
            lines.append(f"- not evaluated ({d['reason']}): {d['claim']}")
    if explo:
        lines += ["", f"## Exploration seeds {_seed_list(explo['seeds'])} (exploration: not verdicts)", ""]
        if explo["arms"]:
            lines += _arm_table(explo["arms"], metric, th, b)
        if explo.get("paired"):
            lines += [""] + _paired_table(explo["paired"], vr)
        if explo.get("verdict"):
            lines += ["", "The claims checked on the exploration seeds (paired t, same correction): a screening "
                      "that says which claims are worth confirming, not a verdict.", ""]
            lines += _verdict_table(explo["verdict"], {**vr, "rule": "paired_t"})
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
    written = plot_curves(curves, out / "plots") if plots else []
    summary["unfinished_cells"] = settings["unfinished"]
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
