"""``echotrain compare``: run a multi-seed grid of arms, or report on existing run directories.

    echotrain compare CONFIG.yaml [key=value ...] [--jobs N] [--threads T] [--nice K]
                      [--dry-run] [--cell I] [--no-report]
    echotrain compare report DIR... [--out DIR] [--baseline ARM] [--metric KEY] [--threshold X]
    echotrain compare restate SUMMARY.json...   (a written report's verdicts under the current rule)
    echotrain compare select CONFIG.yaml [key=value ...]   (the pre-registered claims to confirm)

Every cell is validated (like ``echotrain train``) before any runs; configuration errors exit
with status 2. ``--cell I`` runs only cell I (for a scheduler's job array); ``--dry-run`` lists the
cells with their state and writes ``compare.yaml`` and ``commands.sh`` without running anything.
The cells die with this command (``kill -9`` included; :mod:`echotrain.lifeline`); a cell that
another process is still writing (its run directory's lock, :mod:`echotrain.train.run_lock`) is
refused before any cell starts: exit 2, naming the cell and that process's pid.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from echotrain.errors import ConfigError

EPILOG = """\
CONFIG.yaml: name, output_dir, seeds (N or [list]: exploration), confirm_seeds (N or [list]: the
seeds verdicts use), baseline, base {TrainConfig keys}, arms {name: {preset: ..., key: value}},
optional sweep {name, keys, values}, report {metric, threshold, stability, max_step, rule
(paired_t | bca), correction (holm | none), alpha, power}, verdict [claims], suite {name, args},
selection {p_max, claims, fallback} (what 'select' sends on to the confirmation seeds)
(see echotrain.compare.config and configs/compare/*.yaml). key=value: seeds=, confirm_seeds=,
output_dir=, name=, baseline=, arms=a,b (subset; claims naming other arms are dropped, with a
note), phase=exploration|confirmation|all (which seeds' cells run), verdict=none (skip every
claim), report.KEY=, or any TrainConfig key (applied to every
cell, over the arms' values).
"""



def dropped_claims_line(spec: Any) -> str:
    """One line for the claims a command line left out (``arms=`` selection, ``verdict=none``):
    how many of how many, and why (the arms not selected, named once each), e.g. ``7 of 10 claims not
    evaluated: arm(s) dapo, gspo not selected (each claim is listed in compare.yaml and the report)``."""
    dropped = spec.dropped_verdicts
    total = len(dropped) + len(spec.verdict)
    if all(d["reason"] == "verdict=none" for d in dropped):
        why = "verdict=none"
    else:
        arms = dict.fromkeys(a for d in dropped for a in d.get("missing", []))
        why = f"arm(s) {', '.join(arms)} not selected"
    return (f"{len(dropped)} of {total} claim{'s' if total > 1 else ''} not evaluated: {why} (each claim is listed "
            "in compare.yaml's dropped_verdicts and in the report)")

def register(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``echotrain compare`` to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("config", metavar="CONFIG.yaml|report|restate|select", help="comparison file, 'report' to "
                        "aggregate DIRs, 'restate' to re-judge the claims of written summary.json files, or 'select' "
                        "to apply a comparison file's pre-registered selection to its screening report")
    parser.add_argument("rest", nargs="*", metavar="key=value|DIR|SUMMARY.json",
                        help="overrides (run), directories (report) or summary.json files (restate)")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at a time locally (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cell unless the config sets "
                        "num_threads (default 1)")
    parser.add_argument("--nice", type=int, default=0, help="niceness increment of the cell processes (default 0)")
    parser.add_argument("--dry-run", action="store_true", help="validate, list cells and their state, write "
                        "compare.yaml and commands.sh; run nothing")
    parser.add_argument("--cell", type=int, default=None, metavar="I", help="run only cell I (0-based, the order of "
                        "--dry-run), e.g. from a job array")
    parser.add_argument("--no-report", action="store_true", help="do not write the report after the runs")
    parser.add_argument("--out", default=None, help="report: output folder (default <comparison>/report)")
    parser.add_argument("--baseline", default=None, help="report: baseline arm (default: the comparison's)")
    parser.add_argument("--metric", default=None, help="report: curve for final/AUC/threshold (default eval/accuracy)")
    parser.add_argument("--threshold", type=float, default=None, help="report: threshold for steps-to-threshold")
    parser.add_argument("--title", default=None, help="report: title")
    parser.add_argument("--max-step", type=int, default=None, help="report: read every run up to this step only")
    parser.add_argument("--notes", default=None, metavar="FILE.md", help="report: Markdown inserted under the title")
    parser.add_argument("--include-partial", action="store_true", help="report: also aggregate unfinished cells "
                        "(curves then stop at the shortest run of an arm)")
    parser.set_defaults(func=run_compare, accepts_extra=True)


def _sigterm(_signum, _frame):  # let run_cells stop its children
    raise KeyboardInterrupt


def _select(rest: list[str]) -> int:
    """``echotrain compare select CONFIG.yaml [key=value ...]``: rank the screening's claims as the
    file's ``selection`` says (:mod:`echotrain.compare.select`), print the ranking to stderr and the
    confirmation command to stdout. Exit 2 on a bad file or a missing screening report."""
    from echotrain.compare.config import load_spec
    from echotrain.compare.select import confirmation_command, exploration_rows, rank_claims, select_claims

    if not rest or "=" in rest[0]:
        print("echotrain compare select: error: give the comparison file (CONFIG.yaml [key=value ...])", file=sys.stderr)
        return 2
    # the whole file's claims: a selection of arms, phase or verdict=none does not apply here
    config, tokens = rest[0], [t for t in rest[1:]
                               if t.split("=", 1)[0] not in ("phase", "arms", "baseline", "verdict")]
    try:
        spec = load_spec(config, tokens)
        if not spec.confirm_seeds:
            raise ValueError(f"{config}: declares no confirm_seeds, so there is nothing to select for")
        summary = spec.output_dir / "report" / "summary.json"
        rows = exploration_rows(summary, spec.verdict, spec.seeds, spec.baseline, spec.report)
        chosen, fallback = select_claims(rows, **spec.selection)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"echotrain compare select: error: {exc}", file=sys.stderr)
        return 2
    rule = spec.selection
    print(f"echotrain compare select: {summary}: rule p < {rule['p_max']} in the claimed direction, "
          f"best {rule['claims']} by exploration p", file=sys.stderr)
    for i, r in enumerate(rank_claims(rows), 1):
        c = r["comparison"]
        print(f"  {i}. p {r['p']:.3g}  diff {c['diff_mean']:+.4g} (n {c['n']})  {r['claim']}", file=sys.stderr)
    why = f"no claim had p < {rule['p_max']} in its direction: the file's first claim" if fallback else "chosen"
    for r in chosen:
        print(f"  {why}: {r['claim']}", file=sys.stderr)
    if not chosen:
        print(f"  no claim had p < {rule['p_max']} in its direction and the file's fallback is none: "
              "nothing to confirm", file=sys.stderr)
        return 0
    print(confirmation_command(config, chosen, spec.baseline, tokens))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Entry point of ``echotrain compare``."""
    from echotrain.compare.report import write_report

    extra = list(getattr(args, "extra", []) or [])  # positionals given after an option
    bad = [t for t in extra if t.startswith("-")]
    if bad:
        print(f"echotrain compare: error: unrecognized option {bad[0]!r}; see echotrain compare --help", file=sys.stderr)
        return 2
    args.rest = list(args.rest) + extra
    if args.config == "restate":
        from echotrain.compare.restate import restate, restate_markdown

        if not args.rest:
            print("echotrain compare restate: error: give one or more report summary.json files", file=sys.stderr)
            return 2
        try:
            tables = [restate_markdown(restate(p), title=p) for p in args.rest]
        except (FileNotFoundError, ValueError, KeyError) as exc:
            print(f"echotrain compare restate: error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(tables), end="")
        return 0
    if args.config == "select":
        return _select(args.rest)
    if args.config == "report":
        if not args.rest:
            print("echotrain compare report: error: give one or more run or comparison directories", file=sys.stderr)
            return 2
        try:
            path = write_report(args.rest, out_dir=args.out, baseline=args.baseline, metric=args.metric,
                                threshold=args.threshold, title=args.title, include_partial=args.include_partial, notes=args.notes,
                                max_step=args.max_step)
        except (FileNotFoundError, ValueError) as exc:
            print(f"echotrain compare report: error: {exc}", file=sys.stderr)
            return 2
        print(f"echotrain compare: report in {path}")
        return 0

    from echotrain.compare.config import expand_cells, load_spec
    from echotrain.compare.runner import (CellBusy, ComparisonBusy, cell_status, check_cell_config, lock_comparison,
                                          run_cells, write_plan)

    try:
        spec = load_spec(args.config, args.rest)
        if args.jobs < 1 or args.threads < 1:
            raise ConfigError(f"--jobs={args.jobs} and --threads={args.threads} must be >= 1")
        cells = expand_cells(spec, threads=args.threads)
        if args.cell is not None and not 0 <= args.cell < len(cells):
            raise ConfigError(f"--cell {args.cell}: valid cells are 0..{len(cells) - 1}")
        from echotrain.tasks import get_task

        distinct = {(c.config.task, repr(sorted(c.config.task_options.items()))): c for c in cells}
        for c in distinct.values():  # tasks are cheap to build: check names and options up front
            try:
                get_task(c.config.task, **c.config.task_options)
            except (KeyError, ValueError, TypeError) as exc:
                raise ConfigError(f"task={c.config.task!r} task_options={c.config.task_options}: {exc}") from None
        from echotrain.runtime import preflight

        for model in dict.fromkeys(c.config.model for c in cells):  # as echotrain train does, once per model
            preflight.check_model(model)
        for c in cells:
            check_cell_config(c)
    except (ConfigError, ValueError) as exc:
        print(f"echotrain compare: error: {exc}", file=sys.stderr)
        return 2
    if spec.dropped_verdicts:  # one line (was one per claim); the plan and the report list each claim
        print(f"echotrain compare: {dropped_claims_line(spec)}", file=sys.stderr)
    spec.raw["command"] = " ".join(["echotrain compare", args.config, *args.rest] +
                                   ([f"--threads {args.threads}"] if args.threads != 1 else []))
    try:  # before the plan is written: a refused command must not rewrite a running study's compare.yaml
        lock = lock_comparison(spec.output_dir)
    except ComparisonBusy as exc:
        print(f"echotrain compare: error: {exc}", file=sys.stderr)
        return 2
    write_plan(spec, cells)
    if args.dry_run:
        for i, c in enumerate(cells):
            print(f"[{i}] {c.arm:40s} seed {c.seed:<4d} {cell_status(c):7s} {c.run_dir}")
        print(f"echotrain compare: {len(cells)} cells; plan in {spec.output_dir / 'compare.yaml'}, "
              f"{spec.output_dir / 'commands.sh'}")
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    todo = [cells[args.cell]] if args.cell is not None else cells
    try:
        outcomes = run_cells(spec, todo, jobs=args.jobs, nice=args.nice,
                             log=lambda m: print(m, file=sys.stderr, flush=True), lock=lock)
    except KeyboardInterrupt:
        print("echotrain compare: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    except (ComparisonBusy, CellBusy) as exc:
        print(f"echotrain compare: error: {exc}", file=sys.stderr)
        return 2
    failed = {k: v for k, v in outcomes.items() if v.startswith("failed")}
    if not args.no_report and args.cell is None:
        try:
            path = write_report([spec.output_dir], out_dir=args.out, baseline=args.baseline, metric=args.metric,
                                threshold=args.threshold, title=args.title)
            print(f"echotrain compare: report in {path}", file=sys.stderr)
        except ValueError as exc:
            print(f"echotrain compare: no report: {exc}", file=sys.stderr)
    for k, v in failed.items():
        print(f"echotrain compare: {k}: {v}", file=sys.stderr)
    return 1 if failed else 0
