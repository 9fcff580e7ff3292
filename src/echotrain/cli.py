"""The ``echotrain`` command line.

Each subcommand lives in the module that owns it; this file only wires them together, so a new
subcommand is one line in :data:`COMMANDS` (or :data:`EXPERIMENTS`) and one ``register``
function ``register(parser: argparse.ArgumentParser) -> None`` that adds its options and sets
``parser.set_defaults(func=callable(args) -> int | None)``.

    echotrain train [--config FILE.yaml] [key=value ...]
    echotrain eval ...
    echotrain compare CONFIG.yaml [key=value ...] | echotrain compare report DIR...
    echotrain experiment <name> ...
    echotrain device-check [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib
import sys

from echotrain.omp import (  # noqa: F401  (re-exported: the CLI sets the policy first)
    BUSY_CORES,
    SPINCOUNT,
    cpu_ticks,
    omp_wait_in_force,
    other_cpu_load,
    set_omp_wait_policy,
)

# name -> ("module:function", one-line help). Imported lazily, when the command is parsed.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("echotrain.train.commands:register_train", "RL-train a language model on a verifiable task"),
    "eval": ("echotrain.train.commands:register_eval", "accuracy / pass@k of a model or checkpoint on a task"),
    "compare": ("echotrain.compare.commands:register", "multi-seed grid of objective arms, and its report"),
    "testbed": ("echotrain.models.testbed:register", "build (or show) the cached CPU testbed policy (model=testbed)"),
    "device-check": ("echotrain.devicecheck:register", "run and assert echotrain's CUDA path on this GPU (--dry-run: CPU)"),
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
    from echotrain import __version__

    parser = argparse.ArgumentParser(prog="echotrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"echotrain {__version__}",
                        help="print echotrain's version and exit")
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``echotrain`` command; returns the process exit code.

    Exit codes: 0 done (also ``--version``, ``--help`` and a bare ``echotrain``, which prints the
    help), 2 bad input (one message naming the key or path; an unknown option or command is
    argparse's usage error; ``--debug`` anywhere on the command line adds the traceback, still
    exit 2), 130 interrupted (Ctrl-C).
    """
    set_omp_wait_policy()
    from echotrain.lifeline import watch_parent

    watch_parent()  # started by `echotrain compare`: end with it (a no-op otherwise)
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
        from echotrain.errors import ConfigError

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
        if extra:  # `echotrain --foo`, `echotrain experiment --foo`: an unknown option, not a request for help
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
