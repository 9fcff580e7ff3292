"""The pre-registered choice of what to confirm (``echotrain compare select``).

A study explores on some seeds and confirms on fresh ones (``seeds`` / ``confirm_seeds``), but
confirming every claim can cost more CPU than one machine has. The comparison file then fixes,
before any run, *which* claims go on to the confirmation seeds (its ``selection`` mapping), and
this module applies that rule to the screening's numbers, so that the choice is a computation
anyone can repeat, not a judgement made after seeing the data:

1. candidates: the claims evaluated on at least two exploration seeds whose mean difference
   points the claimed way (``direction: greater`` -> > 0, ``less`` -> < 0; a difference of
   differences for claims with ``arm_ref`` / ``baseline_ref``) and whose exploration p-value
   (uncorrected, the paired-t rule of the report) is a number;
2. ranked by that p-value, ascending (ties keep the file's order);
3. chosen: the first ``claims`` candidates with p < ``p_max``; when none qualifies, the first
   claim of the file (by convention the headline; ``fallback: first``) or nothing
   (``fallback: none``: the study stops at its screening).

The rows ranked are recomputed from the report's per-seed statistics for every claim of the
file (:func:`exploration_rows`), so ``select`` gives the same answer before and after a
confirmation run rewrote the report. The confirmation then runs only the arms the chosen claims name (``arms=``, with the sweep
values the claims need coming from the sweep), and the verdicts of the other claims read
"insufficient data" in the confirmation report.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

#: ``selection`` keys of a comparison file, their defaults and meaning
SELECTION_DEFAULTS: dict[str, Any] = {"p_max": 0.2, "claims": 1, "fallback": "first"}
SELECTION_HELP = {"p_max": "largest exploration p-value a claim may have to be chosen (in (0, 1])",
                  "claims": "how many claims go on to the confirmation seeds (>= 1)",
                  "fallback": "when no claim qualifies: first (confirm the file's first claim) or none"}
FALLBACKS = ("first", "none")

_LABEL_SUFFIX = re.compile(r"\[.*\]$")


def check_selection(value: Any) -> dict[str, Any]:
    """The comparison file's ``selection`` mapping with defaults filled in.

    Raises:
        ValueError: not a mapping, an unknown key, ``p_max`` outside (0, 1] or ``claims`` < 1.
    """
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"selection: expected a mapping of {', '.join(SELECTION_DEFAULTS)}, got {value!r}")
    extra = set(value) - set(SELECTION_DEFAULTS)
    if extra:
        raise ValueError(f"selection: unknown key(s) {sorted(extra)}; valid: {', '.join(SELECTION_DEFAULTS)}")
    out = {**SELECTION_DEFAULTS, **value}
    p_max, claims = out["p_max"], out["claims"]
    if isinstance(p_max, bool) or not isinstance(p_max, (int, float)) or not 0 < p_max <= 1:
        raise ValueError(f"selection.p_max={p_max!r}: {SELECTION_HELP['p_max']}")
    if isinstance(claims, bool) or not isinstance(claims, int) or claims < 1:
        raise ValueError(f"selection.claims={claims!r}: {SELECTION_HELP['claims']}")
    if out["fallback"] not in FALLBACKS:
        raise ValueError(f"selection.fallback={out['fallback']!r}: {SELECTION_HELP['fallback']}")
    return out


def _points_the_claimed_way(row: Mapping[str, Any]) -> bool:
    diff = (row.get("comparison") or {}).get("diff_mean")
    if diff is None or diff != diff:
        return False
    return diff > 0 if row.get("direction", "greater") == "greater" else diff < 0


def rank_claims(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The candidate claims (step 1 of the module's rule), ranked by exploration p (step 2).

    Args:
        rows: a report's exploration verdict rows (``summary.json["exploration"]["verdict"]``),
            each with ``p``, ``direction`` and ``comparison`` {``n``, ``diff_mean``}.
    """
    cands = [r for r in rows if (r.get("comparison") or {}).get("n", 0) >= 2 and _points_the_claimed_way(r)
             and isinstance(r.get("p"), (int, float)) and r["p"] == r["p"]]
    return sorted(cands, key=lambda r: r["p"])  # stable: ties keep the file's order


def select_claims(rows: Sequence[Mapping[str, Any]], p_max: float = SELECTION_DEFAULTS["p_max"],
                  claims: int = SELECTION_DEFAULTS["claims"],
                  fallback: str = SELECTION_DEFAULTS["fallback"]) -> tuple[list[Mapping[str, Any]], bool]:
    """``(chosen rows, fell_back)``: step 3 of the module's rule; ``fell_back`` is True when no
    candidate had p < ``p_max`` (the chosen rows are then the file's first claim, or none with
    ``fallback="none"``).

    Raises:
        ValueError: ``rows`` is empty (the study declares no claim).
    """
    if not rows:
        raise ValueError("the exploration report has no claims to select from")
    chosen = [r for r in rank_claims(rows) if r["p"] < p_max][:claims]
    if chosen:
        return chosen, False
    return ([rows[0]] if fallback == "first" else []), True


def arms_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The arm names (sweep suffix ``[name=value]`` removed) the claims in ``rows`` compare, in
    first-seen order: what ``arms=`` must select for their confirmation."""
    labels = [r[k] for r in rows for k in ("arm", "arm_ref", "baseline", "baseline_ref") if r.get(k)]
    return list(dict.fromkeys(_LABEL_SUFFIX.sub("", lab) for lab in labels))


def exploration_rows(summary_path: str | Path, claims: Sequence[Mapping[str, Any]], seeds: Sequence[int],
                     baseline: str | None = None, report: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The verdict rows of ``claims`` (the comparison file's, all of them) on the exploration
    ``seeds``, recomputed from the per-seed statistics of a report's ``summary.json`` (its
    ``runs``) under the file's verdict rule (``report``: rule, correction, alpha, power). Not
    the report's own ``exploration`` rows: a confirmation run rewrites the report with only the
    claims of the arms it selected, and a screening run with ``arms=`` judged only some.

    Raises:
        FileNotFoundError: no such file (run the screening first: ``phase=exploration``).
        ValueError: not a report summary (no ``runs`` list).
    """
    from echotrain.compare.report import verdicts
    from echotrain.compare.restate import read_summary

    _, per_seed = read_summary(summary_path, "run the screening first: phase=exploration")
    rule = {k: v for k, v in (report or {}).items() if k in ("rule", "correction", "alpha", "power")}
    return verdicts([dict(c) for c in claims], per_seed, baseline, list(seeds), **rule)


def confirmation_command(config: str, rows: Sequence[Mapping[str, Any]], baseline: str | None,
                         tokens: Sequence[str] = ()) -> str:
    """The ``echotrain compare`` command that runs the chosen claims' arms on the confirmation
    seeds. ``baseline`` is kept when its arm is selected, else the first chosen claim's
    reference (``baseline_ref``, or ``baseline``) becomes the report's baseline."""
    arms = arms_of(rows)
    if baseline is None or _LABEL_SUFFIX.sub("", baseline) not in arms:
        first = rows[0]
        baseline = first.get("baseline_ref") or first.get("baseline") or first["arm"]
    parts = ["echotrain compare", config, *tokens, "phase=confirmation", f"arms={','.join(arms)}",
             f"baseline={baseline}"]
    return " ".join(shlex.quote(p) if i else p for i, p in enumerate(parts))
