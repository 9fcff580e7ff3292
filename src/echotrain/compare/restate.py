"""Re-state the verdicts of a written report under the current verdict rule (``echotrain compare restate``).

A report's ``summary.json`` keeps every run's per-seed statistics (``runs``: arm, seed, auc,
final, worst_grad_norm, any_flag, ...) and the claims with the verdict they got (``verdict``:
claim, arm, baseline, statistic, direction, margin, result). :func:`restate` applies
:func:`echotrain.compare.report.verdicts` to those numbers again (paired t-interval, Holm across
the study's claims, minimal detectable effect; or the settings given), so a verdict written under
an earlier rule can be read next to the current one without re-running anything. Only the
verdict rule changes: per-seed statistics are taken as written (an ``any_flag`` written before
a flag existed does not count that flag).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from echotrain.compare.stats import ALPHA, POWER


def read_summary(summary_path: str | os.PathLike, missing_hint: str) -> tuple[dict[str, Any],
                                                                            dict[str, dict[int, dict[str, Any]]]]:
    """A report's ``summary.json`` and its per-seed statistics ``{arm: {seed: run row}}`` (the
    ``runs`` list, as :func:`echotrain.compare.report.verdicts` reads them).

    Raises:
        FileNotFoundError: no such file (the message ends with ``missing_hint``).
        ValueError: not a report summary (no ``runs`` list).
    """
    p = Path(summary_path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file ({missing_hint})")
    summary = json.loads(p.read_text())
    if not isinstance(summary, dict) or not isinstance(summary.get("runs"), list):
        raise ValueError(f"{p}: not a comparison report summary (needs its 'runs' list)")
    per_seed: dict[str, dict[int, dict[str, Any]]] = {}
    for r in summary["runs"]:
        per_seed.setdefault(str(r["arm"]), {})[int(r["seed"])] = r
    return summary, per_seed


def restate(summary_path: str | os.PathLike, rule: str = "paired_t", correction: str = "holm", alpha: float = ALPHA,
            power: float = POWER) -> list[dict[str, Any]]:
    """The claims of ``summary.json`` with the written verdict (``old_result``) and the verdict of
    the current rule (every key of :func:`echotrain.compare.report.verdicts`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a report summary (no ``runs`` / ``verdict`` lists).
    """
    from echotrain.compare.report import verdicts

    summary, per_seed = read_summary(summary_path, "give a report's summary.json")
    if not isinstance(summary.get("verdict"), list):
        raise ValueError(f"{summary_path}: not a comparison report summary (needs 'runs' and 'verdict' lists)")
    rule_seeds = (summary.get("verdict_rule") or {}).get("seeds")
    seeds = rule_seeds if (summary.get("verdict_rule") or {}).get("phase") == "confirmation" else None
    keys = ("claim", "arm", "baseline", "statistic", "direction", "margin", "arm_ref", "baseline_ref")
    claims = [{k: c[k] for k in keys if k in c} for c in summary["verdict"]]
    new = verdicts(claims, per_seed, summary.get("baseline"), seeds, rule, correction, alpha, power)
    return [{**n, "old_result": c.get("result"), "old_comparison": c.get("comparison") or {}}
            for n, c in zip(new, summary["verdict"])]


def restate_markdown(rows: list[dict[str, Any]], title: str | None = None) -> str:
    """A Markdown table: claim, n, old interval and verdict, new interval, p, Holm p, MDE, new verdict."""
    from echotrain.compare.report import _fmt, verdict_phrase

    holm = bool(rows) and rows[0].get("correction") == "holm"
    lines = ([f"### {title}", ""] if title else []) + [
        "| claim | n | written: diff [95% percentile bootstrap] | written verdict | diff [95% paired t] | p | "
        + ("p Holm | " if holm else "") + "MDE 80% | verdict now |",
        "|---|---|---|---|---|---|" + ("---|" if holm else "") + "---|---|"]
    for r in rows:
        o, c = r["old_comparison"], r.get("comparison") or {}
        old = f"{_fmt(o.get('diff_mean'))} [{_fmt(o.get('ci_low'))}, {_fmt(o.get('ci_high'))}]" if o else "n/a"
        now = f"{_fmt(c.get('diff_mean'))} [{_fmt(c.get('ci_low'))}, {_fmt(c.get('ci_high'))}]" if c else "n/a"
        lines.append(f"| {r['claim']} | {c.get('n', 0)} | {old} | {r['old_result']} | {now} | {_fmt(r.get('p'))} | "
                     + (f"{_fmt(r.get('p_holm'))} | " if holm else "")
                     + f"{_fmt(r.get('mde'))} | **{verdict_phrase(r)}** |")
    return "\n".join(lines) + "\n"
