"""The ``echotrain`` command line.

Each subcommand lives in the module that owns it; this file only wires them together, so a new
subcommand is one line in :data:`COMMANDS` (or :data:`EXPERIMENTS`) and one ``register``
function ``register(parser: argparse.ArgumentParser) -> None`` that adds its options and sets
``parser.set_defaults(func=callable(args) -> int | None)``.

    echotrain train [--config FILE.yaml] [key=value ...]
    echotrain eval ...
    echotrain compare CONFIG.yaml [key=value ...] | echotrain compare report DIR...
    echotrain experiment <name> ...
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> ("module:function", one-line help). Imported lazily, when the command is parsed.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("echotrain.train.commands:register_train", "RL-train a language model on a verifiable task"),
    "eval": ("echotrain.train.commands:register_eval", "accuracy / pass@k of a model or checkpoint on a task"),
    "compare": ("echotrain.compare.commands:register", "multi-seed grid of objective arms, and its report"),
    "testbed": ("echotrain.models.testbed:register", "build (or show) the cached CPU testbed policy (model=testbed)"),
}

# `echotrain experiment <name>`: reproductions of each method's central claim.
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "late-sam": ("echotrain.experiments.late_sam:register", "SGD vs full SAM vs SAM late in training (Zhou et al. 2025)"),
    "looped-lr": ("echotrain.experiments.looped_lr:register", "learning-rate transfer across loop counts (Wang et al. 2026)"),
}


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser, importing only the subcommand named in ``argv``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="echotrain", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (target, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == wanted:
            _load(target)(p)
    exp = sub.add_parser("experiment", help="reproduce a method's central claim", description="reproduce a method's central claim")
    exp_sub = exp.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    wanted_exp = argv[1] if wanted == "experiment" and len(argv) > 1 else None
    for name, (target, help_) in EXPERIMENTS.items():
        p = exp_sub.add_parser(name, help=help_, description=help_)
        if name == wanted_exp:
            _load(target)(p)
    return parser


#: other processes using at least this many cores' worth of CPU at start -> passive OpenMP waits
BUSY_CORES = 0.5
#: libgomp spin count of a waiting worker thread on a quiet machine (its default: 300000)
SPINCOUNT = 3000


def cpu_ticks(stat: str, cpus: set[int] | None = None) -> tuple[int, int, int]:
    """``(busy, total, n)``: clock ticks since boot from the text of Linux ``/proc/stat``, summed
    over the CPUs ``cpus`` (their ``cpuN`` lines; None, or none of them listed: the aggregate
    ``cpu`` line over all ``n`` CPUs that have a line).

    A line's fields are user nice system idle iowait irq softirq steal guest guest_nice (the last
    two are already counted in user / nice, so they are left out): total = the first eight,
    busy = total - idle - iowait.

    Raises:
        ValueError: no ``cpu`` line, or one with fewer than 4 numbers.
    """
    lines = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu"):
            lines[name] = [int(x) for x in rest.split()]
    per_cpu = {int(k[3:]): v for k, v in lines.items() if k[3:].isdigit()}
    chosen = [per_cpu[c] for c in sorted(cpus) if c in per_cpu] if cpus else []
    if chosen:
        n = len(chosen)
    elif "cpu" in lines:
        chosen, n = [lines["cpu"]], max(len(per_cpu), 1)
    else:
        raise ValueError("/proc/stat: no cpu line")
    busy = total = 0
    for fields in chosen:
        if len(fields) < 4:
            raise ValueError(f"/proc/stat: a cpu line has {len(fields)} numbers, expected at least 4")
        t = sum(fields[:8])
        busy, total = busy + t - fields[3] - (fields[4] if len(fields) > 4 else 0), total + t
    return busy, total, n


def other_cpu_load(sample_s: float = 0.2) -> float | None:
    """Cores' worth of CPU time spent busy over ``sample_s`` seconds on the CPUs this process may
    run on (``os.sched_getaffinity``; all processes, this one sleeps meanwhile), from Linux
    ``/proc/stat`` (:func:`cpu_ticks`); None where that cannot be read."""
    import time

    try:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        with open("/proc/stat") as f:
            busy0, total0, n = cpu_ticks(f.read(), cpus)
        time.sleep(sample_s)
        with open("/proc/stat") as f:
            busy1, total1, _ = cpu_ticks(f.read(), cpus)
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return (busy1 - busy0) / (total1 - total0) * n


def set_omp_wait_policy(environ: dict[str, str] | None = None, load: float | None = None) -> str:
    """Choose how OpenMP worker threads wait, from the machine's load at start (unless the user chose).

    libgomp's default lets an idle worker spin ~300k times before it sleeps: fast on a quiet
    machine, but next to another busy process the spinning threads and the descheduled partner
    make a 2-thread step ~2x slower than a 1-thread one. ``OMP_WAIT_POLICY=PASSIVE`` (sleep at
    once) is the most robust under contention (1.05x) but costs 1.2x on a quiet machine for the
    RL step's small ops; a bounded spin of :data:`SPINCOUNT` (``GOMP_SPINCOUNT``) is as fast as
    the default when quiet and 1.34x under one competitor (docs/benchmarks.md, "Contention").
    So: when other processes use at least :data:`BUSY_CORES` cores over a short sample at start
    (:func:`other_cpu_load`), or the load cannot be read, set ``OMP_WAIT_POLICY=PASSIVE`` in
    ``environ`` (default ``os.environ``); otherwise ``GOMP_SPINCOUNT=3000``, which also bounds
    the cost of a competitor that starts later. A user's ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is left alone. It must run before torch is imported (libgomp reads it once).

    Args:
        environ: the environment to update (default ``os.environ``).
        load: the measured load in cores (default: measure it with :func:`other_cpu_load`).
    Returns:
        "PASSIVE", "GOMP_SPINCOUNT=3000", or the user's setting.
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        load = other_cpu_load() if load is None else load
        if load is None or load >= BUSY_CORES:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            env["GOMP_SPINCOUNT"] = str(SPINCOUNT)
    return omp_wait_in_force(env)


def omp_wait_in_force(environ: dict[str, str] | None = None) -> str:
    """The OpenMP wait setting of ``environ`` (default ``os.environ``), for logs and run_info:
    its ``OMP_WAIT_POLICY``, else ``GOMP_SPINCOUNT=<n>``, else ``"default"`` (libgomp's own)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:
        return env["OMP_WAIT_POLICY"]
    if "GOMP_SPINCOUNT" in env:
        return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}"
    return "default"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``echotrain`` command; returns the process exit code.

    Exit codes: 0 done, 2 bad input (one message naming the key or path; ``--debug`` anywhere on
    the command line adds the traceback, still exit 2), 130 interrupted (Ctrl-C).
    """
    set_omp_wait_policy()
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    from echotrain._quiet import silence_known_noise

    silence_known_noise()
    try:
        return _main(argv, debug)
    except KeyboardInterrupt:
        print("echotrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from echotrain.train.config import ConfigError

        if not isinstance(exc, ConfigError):
            raise
        if debug:  # a bad input stays exit 2; --debug adds where it was raised
            import traceback

            traceback.print_exc()
        print(f"echotrain: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str], debug: bool = False) -> int:
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args(argv[:1] + ["--help"] if argv else ["--help"])
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    args.debug = debug
    rc = func(args)
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
