"""The suite options of ``echotrain eval`` and their entry point.

    echotrain eval --suite math --data-dir DIR [--limit N] [--n 4 --k 1,4] [--temperature 0.6 --top-p 0.95]
    echotrain eval --benchmark gsm8k=PATH --benchmark aime24 --data-dir DIR
    echotrain eval --benchmark choice:mysci=rows.jsonl --n 1 --temperature 0

``--n``, ``--k``, ``--temperature``, ``--max-new-tokens``, ``--seed``, ``--model``,
``--device``, ``--threads``, ``--decode-loop``, ``--sampler``, ``--decode-linear`` and ``--json`` are ``echotrain
eval``'s own options; this module adds the rest. A run directory as ``--model`` is evaluated with
its own ``decode_loop`` and ``sampler`` unless those options are given. Input errors exit with status 2 before the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from echotrain.runtime.cpu_linear import DEFAULT_DECODE_LINEAR
from echotrain.evalsuite.runner import DEFAULT_MAX_NEW_TOKENS as SUITE_MAX_NEW_TOKENS


#: the options only a suite evaluation reads, with their defaults (``echotrain eval`` without --suite/--benchmark
#: refuses them when given otherwise: :func:`suite_only_given`)
SUITE_ONLY_DEFAULTS: dict[str, Any] = {"--data-dir": None, "--limit": None, "--top-p": 1.0, "--batch-size": 8,
                                       "--out": None, "--no-progress": False}


def suite_only_given(args: argparse.Namespace) -> list[str]:
    """The suite-only options (:data:`SUITE_ONLY_DEFAULTS`) ``args`` sets to something other than their default."""
    return [flag for flag, default in SUITE_ONLY_DEFAULTS.items()
            if getattr(args, flag[2:].replace("-", "_"), default) != default]


def add_suite_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark-suite options to ``echotrain eval``'s parser."""
    from echotrain.evalsuite import SUITES, benchmark_names

    g = parser.add_argument_group(
        "benchmark suites",
        "Evaluate on local JSONL benchmark files (or hub datasets when online) instead of --task; writes "
        "samples.jsonl and summary.json to --out. Suites: " +
        "; ".join(f"{s}: {', '.join(m)}" for s, m in sorted(SUITES.items())) +
        f". Defaults with a suite: --max-new-tokens {SUITE_MAX_NEW_TOKENS}; --n, --k, --temperature, --seed as above "
        "(use --n 1 --temperature 0 for greedy accuracy).")
    g.add_argument("--suite", default=None, metavar="NAME", help=f"benchmark suite: {', '.join(sorted(SUITES))}")
    g.add_argument("--benchmark", action="append", default=[], metavar="NAME[=SOURCE]",
                   help="a benchmark to run or a source override, repeatable: NAME (from --data-dir or the hub), "
                        "NAME=PATH (a JSONL file or a folder with test.jsonl), NAME=hf:DATASET[:CONFIG][@SPLIT], or "
                        "KIND:NAME=PATH for your own file (KIND math or choice). Registered: " +
                        ", ".join(benchmark_names()))
    g.add_argument("--data-dir", default=SUITE_ONLY_DEFAULTS["--data-dir"], metavar="DIR",
                   help="folder holding <benchmark>/test.jsonl (or <benchmark>.jsonl) files")
    g.add_argument("--limit", type=int, default=SUITE_ONLY_DEFAULTS["--limit"], metavar="N", help="first N problems of each benchmark")
    g.add_argument("--top-p", type=float, default=SUITE_ONLY_DEFAULTS["--top-p"],
                   help=f"nucleus sampling mass in (0, 1] (default {SUITE_ONLY_DEFAULTS['--top-p']})")
    g.add_argument("--batch-size", type=int, default=SUITE_ONLY_DEFAULTS["--batch-size"], metavar="B",
                   help=f"problems per generate call, each with its --n samples (default {SUITE_ONLY_DEFAULTS['--batch-size']})")
    g.add_argument("--out", default=SUITE_ONLY_DEFAULTS["--out"], metavar="DIR",
                   help="output folder (default runs/eval-<suite>-<UTC timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def wants_suite(args: argparse.Namespace) -> bool:
    """Whether ``echotrain eval`` was asked for a suite evaluation."""
    return bool(getattr(args, "suite", None) or getattr(args, "benchmark", None))


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def print_table(summary: dict[str, Any], title: str) -> None:
    """The summary as a rich table on stdout: one row per benchmark, then the average."""
    from rich.console import Console
    from rich.table import Table

    s = summary["settings"]
    n, ks = s["n"], s["ks"]
    table = Table(title=title, caption=f"accuracy in %; se = standard error of avg@{n} over problems; n={n}, "
                  f"temperature={s['temperature']}, top_p={s['top_p']}, max_new_tokens={s['max_new_tokens']}, "
                  f"limit={s['limit']}, seed={s['seed']}, decode_loop={s.get('decode_loop')}, sampler={s.get('sampler')}")
    table.add_column("benchmark", no_wrap=True)
    for col in ["N", f"avg@{n}", "se", *[f"pass@{k}" for k in ks], "format", "tokens", "trunc", "s"]:
        table.add_column(col, justify="right", no_wrap=True)
    for name, r in summary["benchmarks"].items():
        table.add_row(name, str(int(r["num_problems"])), _pct(r[f"avg@{n}"]), _pct(r[f"avg@{n}_stderr"]),
                      *[_pct(r[f"pass@{k}"]) for k in ks], _pct(r["format_rate"]), f"{r['mean_response_tokens']:.0f}",
                      _pct(r["truncated_rate"]), f"{r['seconds']:.0f}")
    avg = summary["average"]
    table.add_row("average", "", _pct(avg[f"avg@{n}"]), "", *[_pct(avg[f"pass@{k}"]) for k in ks], "", "", "",
                  f"{summary['seconds']:.0f}", style="bold")
    Console().print(table)


def run_suite_command(args: argparse.Namespace) -> int:
    """``echotrain eval --suite/--benchmark``: check inputs, load the model, run, print, write."""
    from echotrain.evalsuite.registry import SuiteInputError
    from echotrain.evalsuite.runner import _check_settings, load_suite, run_suite

    def fail(msg: Any) -> int:
        print(f"echotrain eval: error: {msg}", file=sys.stderr)
        return 2

    try:
        ks = [int(k) for k in str(args.k).split(",") if k.strip()]
    except ValueError:
        return fail(f"--k {args.k!r} must be comma-separated integers")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else SUITE_MAX_NEW_TOKENS
    from echotrain.runtime import preflight
    from echotrain.errors import ConfigError
    from echotrain.runtime.loading import generation_settings, read_run_config, run_dir_of

    try:
        _check_settings(args.n, ks, args.temperature, args.top_p, max_new, args.batch_size)
        run = run_dir_of(args.model)  # a testbed policy reads no chat prompts: say so before any file is read
        model_name = (read_run_config(run).get("model") if run is not None else args.model)
        what = f"--suite {args.suite}" if args.suite else f"--benchmark {', '.join(args.benchmark)}"
        mismatch = preflight.model_task_mismatch(
            model_name, None, model_label=f"--model {args.model!r}" + (f" (a run of model={model_name})" if run else ""),
            task_label=f"{what} (chat prompts)", task_key="--task ")
        if mismatch:
            raise ConfigError(mismatch)
        load_suite(args.suite, args.benchmark, data_dir=args.data_dir, limit=args.limit)  # fail before the model
        # the same checks as ``echotrain eval --task``: threads, device, model path or hub id
        preflight.check_threads(args.threads, key="--threads")
        preflight.check_device(args.device, key="--device")
        preflight.check_eval_model(args.model)
        # generate as the run did (its decode_loop, sampler) unless --decode-loop / --sampler say otherwise
        generation, source = generation_settings(args.model, getattr(args, "decode_loop", None),
                                                 getattr(args, "sampler", None))
    except (SuiteInputError, ConfigError) as exc:
        if getattr(args, "debug", False):
            raise
        return fail(exc)
    taken = [f"{k}={v}" for k, v in generation.items() if getattr(args, k, None) is None]
    if source is not None and taken:  # the first line says what came from the run
        print(f"echotrain eval: {', '.join(taken)} as the run ({source}); --decode-loop, --sampler set them",
              file=sys.stderr)
    import torch

    from echotrain.runtime.checkpoints import CheckpointError
    from echotrain.runtime.loading import load_for_eval

    torch.set_num_threads(args.threads or preflight.affinity_cores())
    try:
        model, tok, desc = load_for_eval(args.model, device=args.device)
        # every benchmark's prompts are chat messages: a model without a chat template is one line naming both
        preflight.check_chat_prompts(tok, [], model_label=f"--model {desc!r}", task_label=f"{what} (chat prompts)")
    except (OSError, CheckpointError, ConfigError) as exc:  # a model that passed the checks but does not load
        if getattr(args, "debug", False):
            raise
        return fail(exc)
    name = args.suite or "custom"
    out = Path(args.out) if args.out else Path("runs") / (
        f"eval-{name}-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    t0 = time.perf_counter()
    from echotrain.runtime.precision import autocast, resolve_for

    with autocast(model, resolve_for(model, args.autocast)):
        summary = run_suite(model, tok, args.suite, benchmarks=args.benchmark, data_dir=args.data_dir, limit=args.limit,
                            n=args.n, ks=ks, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=max_new, batch_size=args.batch_size, seed=args.seed, out_dir=out,
                            progress=not args.no_progress, model_name=desc,
                            decode_linear=getattr(args, "decode_linear", DEFAULT_DECODE_LINEAR), **generation)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary, f"echotrain eval --suite {name}: {desc}")
    print(f"echotrain: {time.perf_counter() - t0:.0f} s; per-sample records {out / 'samples.jsonl'}, "
          f"summary {out / 'summary.json'}", file=sys.stderr)
    return 0
