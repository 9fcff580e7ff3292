"""``echotrain train`` and ``echotrain eval``: argument parsing and the run entry points.

    echotrain train [--config FILE.yaml] [--resume [RUN_DIR]] [key=value ...]
    echotrain eval [--model NAME|PATH|RUN_DIR|CHECKPOINT] [--task NAME] [--prompts P] [--n N] [--k 1,4]
    echotrain eval --suite math --data-dir DIR [--limit N] [--n N --k 1,4]   (echotrain.evalsuite)

Configuration errors (unknown keys, bad values) are reported before any model is loaded, with
the key and the valid choices, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echotrain.train.config import ConfigError, format_help, load_yaml, parse_overrides, resolve_config
from echotrain.train.config.parse import _safe_load_file
from echotrain.runtime.precision import AUTOCAST_CHOICES

TRAIN_EPILOG = """\
Configuration keys (key=value on the command line, or a flat YAML mapping in --config).
Precedence: defaults < preset < --config file < key=value. Presets: {presets},
each also as <name>+balanced (Balanced Aggregation), e.g. preset=gspo+balanced.
Booleans: true/false; none/null clears an optional value; task_options.KEY=VALUE and
loss_options.KEY=VALUE nest; plugins=[module,file.py] imports user modules first.
"""


def register_train(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``echotrain train`` to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    from echotrain.rl import PRESETS

    parser.epilog = TRAIN_EPILOG.format(presets=", ".join(PRESETS)) + format_help()
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of configuration keys (see below)")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                        help="continue from the last checkpoint of RUN_DIR (or of output_dir=...): model, optimizer, "
                             "scheduler, RNG states and data position; key=value may change e.g. steps")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--debug", action="store_true", help="on a bad input, show the traceback too")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    parser.set_defaults(func=run_train, accepts_extra=True)


def _resolve_train_config(args: argparse.Namespace):
    tokens = list(getattr(args, "overrides", []) or []) + list(getattr(args, "extra", []) or [])
    for tok in tokens:
        if tok.startswith("-"):
            raise ConfigError(f"unrecognized option {tok!r}; see echotrain train --help")
    overrides = parse_overrides(tokens)
    yaml_values = load_yaml(args.config) if args.config else {}
    base = None
    if args.resume is not None:
        run_dir = args.resume if isinstance(args.resume, str) else overrides.get("output_dir",
                                                                                 yaml_values.get("output_dir"))
        if not run_dir:
            raise ConfigError("--resume needs a run directory: --resume RUN_DIR or output_dir=RUN_DIR")
        saved = Path(run_dir) / "config.yaml"
        if not Path(run_dir).is_dir():
            raise ConfigError(f"--resume {run_dir!r}: no such run directory")
        if not saved.is_file():
            raise ConfigError(f"--resume {run_dir!r}: no config.yaml there (not a run directory)")
        base = _safe_load_file(saved, "--resume")
        if not isinstance(base, dict):
            raise ConfigError(f"--resume {run_dir!r}: {saved} is not a mapping of keys to values")
        base["output_dir"] = str(run_dir)
    cfg = resolve_config(yaml_values, overrides, base=base)
    saved_lag = int((base or {}).get("staleness") or 0)
    if base is not None and cfg.staleness != saved_lag:  # cheap here; the Trainer checks the checkpoint too
        raise ConfigError(f"--resume: the run was written with staleness={saved_lag} and this run has "
                          f"staleness={cfg.staleness}; resume with staleness={saved_lag} (its checkpoints hold "
                          "the rollouts generated ahead for that lag)")
    return cfg


def run_train(args: argparse.Namespace) -> int:
    """Entry point of ``echotrain train``."""
    try:
        cfg = _resolve_train_config(args)
    except ConfigError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"echotrain train: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from echotrain.runtime import preflight

    try:  # every path, device and resume state, before a model is loaded or anything is written
        preflight.check_threads(cfg.num_threads)
        preflight.check_device(cfg.device)
        if cfg.output_dir:  # another process writing the run directory: name it (train/run_lock.py)
            from echotrain.train.run_lock import RunDirBusy, lock_holder

            holder = lock_holder(cfg.output_dir)
            if holder is not None:
                raise RunDirBusy(cfg.output_dir, holder)
        if args.resume is not None:
            from echotrain.runtime.checkpoints import checkpoint_step

            reached = checkpoint_step(preflight.check_resume(cfg.output_dir, cfg.steps))
            if reached == cfg.steps:  # nothing to run: say so, write nothing
                print(f"echotrain train: {cfg.output_dir} already reached steps={cfg.steps}; nothing to do (give "
                      f"steps={cfg.steps + 1} or more to continue it)", file=sys.stderr)
                return 0
        preflight.check_output_dir(cfg.output_dir, resume=args.resume is not None)
        preflight.check_chat_template(cfg.chat_template)
        from echotrain.train.warmup import check_sft_data

        check_sft_data(cfg, resume=args.resume is not None)
        if cfg.sft_data:  # config.yaml and run_info.json name the file itself: a resume from another folder finds it
            cfg.sft_data = os.path.abspath(cfg.sft_data)  # (abspath: the name given, symlinks not followed)
        if cfg.reward:
            from echotrain.rewards.custom import load_reward

            load_reward(cfg.reward)
        preflight.check_model(cfg.model)
        task = preflight.check_task(cfg.task, cfg.task_options)  # cheap: the model is not loaded yet
    except ConfigError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"echotrain train: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from echotrain.omp import omp_wait_in_force
    from echotrain.runtime.precision import describe as describe_precision
    from echotrain.train.config.preset_report import preset_note
    from echotrain.train.trainer import Trainer

    from echotrain.train.dist import local_world_size

    # torchrun: the processes on this machine share its cores
    cores, cores_reason = preflight.default_threads()
    torch.set_num_threads(cfg.num_threads or max(1, cores // local_world_size()))
    threads_why = "" if cfg.num_threads else f" (num_threads=0: {cores_reason})"
    t0 = time.perf_counter()
    from echotrain.train.dist import WorldSizeMismatch
    from echotrain.train.async_rollouts import AsyncUnsupported, RolloutWorkerError
    from echotrain.train.lag import StalenessMismatch
    from echotrain.train.run_lock import RunDirBusy
    from echotrain.train.warmup import WarmupError
    from echotrain.runtime.episodes import TemplateError

    try:
        trainer = Trainer(cfg, task=task, resume=args.resume is not None)
    except (OSError, WorldSizeMismatch, StalenessMismatch, AsyncUnsupported, RunDirBusy, WarmupError,
            TemplateError) as exc:  # a hub id that passed the checks but does
        # not exist; a resume with another number of processes or another staleness; another
        # process writing the run directory (exit 2, before the model loads); a warm-up (sft_steps) without
        # a demonstration it can use, or whose environment replies the chat template cannot render
        if getattr(args, "debug", False):
            raise
        print(f"echotrain train: error: {exc}", file=sys.stderr)
        return 2
    outputs = "config.yaml, metrics.jsonl, samples.jsonl, " + ("plots/, " if cfg.plots else "") + "checkpoints/"
    n = torch.get_num_threads()
    threads = (f"{n} learner + {trainer.rollouts.spec.threads} rollout-worker thread"
               f"{'s' if n + trainer.rollouts.spec.threads > 1 else ''}"
               if cfg.async_rollouts else f"{n} thread{'s' if n > 1 else ''}") + threads_why
    print(f"echotrain: run directory {trainer.run_dir} ({outputs}); {threads}, device "
          f"{trainer.device} (because {trainer.device_reason}), {describe_precision(trainer.autocast_dtype, trainer.autocast_reason)}; OpenMP wait "
          f"policy {omp_wait_in_force()}" + (f"; {note}" if (note := getattr(trainer.rollouts, "resume_note", None))
                                              else ""), file=sys.stderr)
    if trainer.resumed is not None:
        print(f"echotrain: {trainer.resumed.describe()}", file=sys.stderr)
    note = preset_note(cfg)  # loss_mode=X alone keeps the preset's other recipe keys: say which
    if note:
        print(f"echotrain: {note}", file=sys.stderr)
    try:
        trainer.train()
    except RolloutWorkerError as exc:  # the async worker died or stalled; the last completed step is saved
        if getattr(args, "debug", False):
            raise
        print(f"echotrain train: error: {exc}", file=sys.stderr)
        return 1
    except TemplateError as exc:  # an environment reply the chat template cannot render: a setting, exit 2
        if getattr(args, "debug", False):
            raise
        print(f"echotrain train: error: {exc}", file=sys.stderr)
        return 2
    total = time.perf_counter() - t0
    train_s = getattr(trainer, "train_seconds", total)
    glance = "plots/summary.png: the run at a glance" if cfg.plots else "metrics.jsonl: one line per step; plots=false"
    print(f"echotrain: done in {total:.0f} s ({total - train_s:.0f} s loading and setup, {train_s:.0f} s training); "
          f"outputs in {trainer.run_dir} ({glance}); {disk_note(trainer.run_dir, cfg.keep_last)}", file=sys.stderr)
    return 0


def _size(n_bytes: int) -> str:
    """Bytes in decimal units, as ``du --si`` and file managers print them: ``1.6 GB``, ``3.2 MB``, ``12 kB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 1e3:.0f} kB"


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def disk_note(run_dir: str | Path, keep_last: int) -> str:
    """What a finished run leaves on disk, for its last line: the run folder's total, its
    checkpoints (how many, what they hold, ``keep_last``) and the final model, in decimal units,
    e.g. ``2.2 GB on disk: checkpoints/ 1.6 GB (1 checkpoint: model and optimizer states, for
    --resume; keep_last=1), final_model/ 541.6 MB`` (the default job). Sizes are the files' byte counts (``st_size``)."""
    run_dir = Path(run_dir)
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    parts = []
    if ckpts:
        parts.append(f"checkpoints/ {_size(sum(p.stat().st_size for p in ckpts))} ({len(ckpts)} checkpoint"
                     f"{'s' if len(ckpts) > 1 else ''}: model and optimizer states, for --resume; keep_last={keep_last})")
    if (run_dir / "final_model").is_dir():
        parts.append(f"final_model/ {_size(_folder_bytes(run_dir / 'final_model'))}")
    return f"{_size(_folder_bytes(run_dir))} on disk" + (": " + ", ".join(parts) if parts else "")


def register_eval(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``echotrain eval`` to ``parser``."""
    from echotrain.models.testbed import TESTBED_EVAL_SETTINGS

    parser.add_argument("--model", default=None, help="HF name/path, a .gguf file, a run directory (final_model or "
                        "latest checkpoint) or a checkpoint file; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--task", default=None,
                        help="task name for echotrain.tasks.get_task. Default: with --model RUN_DIR (or one of its "
                             "checkpoints) the run's task and task_options, on its held-out prompts (the task's "
                             "held-out split, or seed + 1: the pool the run's own evaluations draw from), said in the "
                             "first line; with a testbed policy's name (testbed, testbed-length, testbed-calc) that "
                             "model's task, held out the same way; else default")
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option for get_task, repeatable (e.g. --task-option seed=1 for questions other than "
                             "the training ones, which use seed 0); without --task, laid over the run's task_options "
                             "and the task is then built as given (no held-out split chosen)")
    parser.add_argument("--env", default=None,
                        help="play each sample as an episode with this environment (as train's env key, e.g. "
                             "calculator; 'none' for single completions). Default: a run directory's own env, "
                             "testbed-calc's calculator (on its own task), else none")
    parser.add_argument("--env-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option of --env (as train's env_options), repeatable")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="model turns an episode may take with --env (default: the run's max_turns, "
                             "testbed-calc's 2 with its calculator, else 4)")
    parser.add_argument("--plugins", action="append", default=[], metavar="MODULE|FILE.py",
                        help="import this module or .py file first (repeatable, or comma-separated), so the tasks "
                             "it registers are valid --task values (as train's plugins key)")
    parser.add_argument("--prompts", type=int, default=64, help="number of task prompts (default 64)")
    parser.add_argument("--n", type=int, default=None,
                        help="samples per prompt (default 4; 1 with --temperature 0, which decodes greedily)")
    parser.add_argument("--k", default="1", help="comma-separated k values for unbiased pass@k, each <= n (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="response length cap (default: the run's max_new_tokens when evaluating a run on its "
                             "own task, a testbed policy's on its own task ("
                             + ", ".join(f"{m} {v['max_new_tokens']}" for m, v in TESTBED_EVAL_SETTINGS.items())
                             + f"), else {EVAL_MAX_NEW_TOKENS} with --task, 1024 with --suite/--benchmark)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (default 0.7)")
    parser.add_argument("--seed", type=int, default=1234, help="seed for prompt choice and sampling (default 1234)")
    parser.add_argument("--device", default="cpu", help="device (default cpu)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = OMP_NUM_THREADS when set, else all cores (default)")
    parser.add_argument("--autocast", default="off", choices=AUTOCAST_CHOICES,
                        help="precision of the model's forward passes, as train's autocast key; default off "
                             "(float32). A run's in-training evaluation uses the run's setting (run_info.json's "
                             "autocast): pass the same to reproduce its eval.jsonl")
    from echotrain.runtime.decode import DECODE_LOOPS, DEFAULT_DECODE_LOOP, DEFAULT_SAMPLER, SAMPLERS
    from echotrain.train.config.schema import FIELDS

    for key, choices, default in (("decode_loop", DECODE_LOOPS, DEFAULT_DECODE_LOOP), ("sampler", SAMPLERS, DEFAULT_SAMPLER)):
        parser.add_argument("--" + key.replace("_", "-"), default=None, choices=choices,
                            help=f"as train's {key} key (--task and --suite alike); default: the run's when --model "
                                 f"is a run directory or one of its checkpoints, else {default}. "
                                 + FIELDS[key].metadata["help"])
    from echotrain.runtime.cpu_linear import DECODE_LINEARS, DEFAULT_DECODE_LINEAR

    parser.add_argument("--decode-linear", default=DEFAULT_DECODE_LINEAR, choices=DECODE_LINEARS,
                        help=f"as train's decode_linear key (--task and --suite alike; default {DEFAULT_DECODE_LINEAR}; "
                             "a run's own value is not taken: like --threads it changes results by float rounding "
                             "only). " + FIELDS["decode_linear"].metadata["help"])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    from echotrain.evalsuite.cli import add_suite_arguments

    add_suite_arguments(parser)  # --suite, --benchmark, --data-dir, --limit, --top-p, --batch-size, --out
    parser.add_argument("--show", type=int, default=None, metavar="N",
                        help="print N completions (default: 3 when accuracy is 0%%, else none)")
    parser.add_argument("--debug", action="store_true", help="on a bad input, show the traceback too")
    parser.set_defaults(func=run_eval, accepts_extra=False)


def run_eval(args: argparse.Namespace) -> int:
    """Entry point of ``echotrain eval``."""
    import yaml

    from echotrain.evalsuite.cli import run_suite_command, suite_only_given, wants_suite
    from echotrain.plugins import PluginError, load_plugins

    if args.n is None:  # greedy decoding gives one distinct sample a prompt: the default follows the temperature
        args.n = 1 if args.temperature == 0 else 4

    try:  # before any name is looked up: a plugin's task or benchmark is valid then
        load_plugins([p for item in getattr(args, "plugins", []) for p in item.split(",") if p.strip()])
    except PluginError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"echotrain eval: error: {exc}", file=sys.stderr)
        return 2
    if wants_suite(args):
        return run_suite_command(args)
    suite_only = suite_only_given(args)
    if suite_only:  # options of the benchmark suites: silently unused here otherwise
        print(f"echotrain eval: error: {', '.join(suite_only)} {'is an option' if len(suite_only) == 1 else 'are options'} "
              "of --suite / --benchmark (benchmark files); a --task evaluation (or one without --task) does not take "
              "it: leave it out, or evaluate a suite", file=sys.stderr)
        return 2

    try:
        ks = [int(k) for k in str(args.k).split(",") if k.strip()]
    except ValueError:
        print(f"echotrain eval: error: --k {args.k!r} must be comma-separated integers", file=sys.stderr)
        return 2
    bad = [k for k in ks if not 1 <= k <= args.n]
    if bad or args.n < 1 or args.prompts < 1:
        print(f"echotrain eval: error: need --n >= 1, --prompts >= 1 and every k in [1, n={args.n}]; got k={ks}",
              file=sys.stderr)
        return 2
    from echotrain.runtime.sampling_stats import greedy_samples_error

    if not args.temperature >= 0:  # also NaN
        print(f"echotrain eval: error: --temperature must be >= 0 (0 = greedy), got {args.temperature}", file=sys.stderr)
        return 2
    greedy = greedy_samples_error(args.n, args.temperature)
    if greedy:
        print(f"echotrain eval: error: {greedy}", file=sys.stderr)
        return 2
    parsed: dict[str, dict[str, Any]] = {"--task-option": {}, "--env-option": {}}
    for flag, items in (("--task-option", args.task_option), ("--env-option", args.env_option)):
        for item in items:
            if "=" not in item:
                print(f"echotrain eval: error: {flag} {item!r} must be KEY=VALUE", file=sys.stderr)
                return 2
            key, _, value = item.partition("=")
            try:
                parsed[flag][key] = yaml.safe_load(value)
            except yaml.YAMLError:
                print(f"echotrain eval: error: {flag} {item!r}: not a valid YAML value", file=sys.stderr)
                return 2
    options = parsed["--task-option"]
    from echotrain.runtime import preflight

    try:  # paths, device, threads and the task before the model is loaded
        preflight.check_threads(args.threads, key="--threads")
        preflight.check_device(args.device, key="--device")
        preflight.check_eval_model(args.model)
        plan = plan_eval_task(args.model, args.task, options, args.max_new_tokens, args.decode_loop, args.sampler,
                              env=args.env, env_options=parsed["--env-option"], max_turns=args.max_turns)
    except ConfigError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"echotrain eval: error: {exc}", file=sys.stderr)
        return 2
    if plan.note:
        print(f"echotrain eval: {plan.note}", file=sys.stderr)
    import torch

    from echotrain.runtime.checkpoints import CheckpointError
    from echotrain.runtime.loading import load_for_eval
    from echotrain.train.evaluate import evaluate
    from echotrain.runtime.precision import autocast, resolve_for

    torch.set_num_threads(args.threads or preflight.default_threads()[0])
    try:
        model, tok, desc = load_for_eval(args.model, device=args.device)
        first = next(iter(plan.task), None)  # a model without a chat template and a chat task: one line, both named
        if first is not None:
            preflight.check_chat_prompts(tok, first.messages, model_label=f"--model {desc!r}",
                                         task_label=f"--task {plan.task_name!r}")
    except (OSError, CheckpointError, ConfigError) as exc:
        if getattr(args, "debug", False):
            raise
        print(f"echotrain eval: error: {exc}", file=sys.stderr)
        return 2
    from echotrain.runtime.episodes import TemplateError

    t0 = time.perf_counter()
    try:
        with autocast(model, resolve_for(model, args.autocast)):
            res = evaluate(model, tok, plan.task, num_prompts=args.prompts, n=args.n, ks=ks,
                           max_new_tokens=plan.max_new_tokens, temperature=args.temperature, seed=args.seed,
                           keep_samples=max(3, args.show or 0), episodes=plan.episodes,
                           decode_linear=args.decode_linear, **plan.generation)
    except TemplateError as exc:  # --env's replies the model's chat template cannot render
        if getattr(args, "debug", False):
            raise
        print(f"echotrain eval: error: {exc}", file=sys.stderr)
        return 2
    res["seconds"] = time.perf_counter() - t0
    samples = res.pop("samples", [])
    show = args.show if args.show is not None else (3 if res["accuracy"] == 0 else 0)
    params = {"temperature": args.temperature, "max_new_tokens": plan.max_new_tokens, "seed": args.seed,
              **plan.generation}
    if args.json:
        print(json.dumps({"model": desc, "task": plan.task_name, "task_options": plan.task_options,
                          "held_out": plan.held_out, **params, **res, "samples": samples[:show]}))
    else:
        from echotrain.train.eval_report import print_eval_report

        print_eval_report(desc, plan.task_name + (" (held-out prompts)" if plan.held_out else ""), params, res,
                          samples[:show])
    return 0


def testbed_eval_settings(model: str | None) -> dict[str, Any]:
    """The generation settings of a testbed policy's runs (:data:`echotrain.models.testbed.TESTBED_EVAL_SETTINGS`:
    ``max_new_tokens``, and ``env`` / ``max_turns`` for testbed-calc), a copy, or ``{}`` for any other model."""
    from echotrain.models.testbed import TESTBED_EVAL_SETTINGS

    return dict(TESTBED_EVAL_SETTINGS.get(model or "", {}))


#: ``echotrain eval --task``'s response length cap when neither ``--max-new-tokens`` nor a run's own
#: setting nor a testbed policy's (:func:`testbed_eval_settings`) gives one (short answers of the built-in tasks)
EVAL_MAX_NEW_TOKENS = 48


@dataclass
class EvalPlan:
    """What ``echotrain eval --task`` evaluates, resolved before the model loads (:func:`plan_eval_task`)."""

    task: Any  #: the built task (its held-out version when ``held_out``)
    task_name: str
    task_options: dict[str, Any]
    held_out: bool  #: the task was swapped for its held-out prompts (:func:`default_eval_task`)
    max_new_tokens: int
    generation: dict[str, str]  #: ``decode_loop`` and ``sampler`` for :func:`echotrain.train.evaluate.evaluate`
    note: str  #: the first line of the command's output: what was taken from the run or the model; "" if nothing
    #: a run with ``env``: :func:`echotrain.train.evaluate.evaluate`'s ``episodes`` (the run's environment,
    #: turns and budget); None: single completions
    episodes: dict[str, Any] | None = None


def plan_eval_task(model: str | None, task: str | None, options: dict[str, Any], max_new_tokens: int | None,
                   decode_loop: str | None, sampler: str | None, *, env: str | None = None,
                   env_options: dict[str, Any] | None = None, max_turns: int | None = None) -> EvalPlan:
    """The task and generation settings of ``echotrain eval --model MODEL [--task TASK]``.

    Without ``task``: a run directory (or one of its checkpoints) is evaluated on the run's task and
    ``task_options`` (``options`` laid over them), on the pool of prompts the run's own
    evaluations draw from (:func:`~echotrain.train.evaluate.default_eval_task`: the task's
    held-out split, or seed + 1)
    unless ``options`` are given, with the run's ``max_new_tokens``; a testbed policy name
    (``testbed``, ``testbed-length``, ``testbed-calc``) on its own task, held out the same way, with its
    runs' ``max_new_tokens`` and (testbed-calc) environment (:func:`testbed_eval_settings`; also when
    ``task`` names that same task); any other model on ``default``. ``decode_loop`` / ``sampler`` (None = not given) default to the run's
    (:func:`echotrain.runtime.loading.generation_settings`). A run trained with ``env`` (or
    ``tools``) is evaluated as it evaluated itself: each sample an episode with its environment,
    ``max_turns`` and episode budget (:func:`echotrain.train.episodes.episodes_of_run`;
    ``env_options`` and ``max_turns`` laid over the run's). ``env`` (``--env``) names the
    environment: the run's own keeps the run's settings, another one plays with ``env_options``,
    ``max_turns`` (else 4) and the budget derived from them, ``"none"`` gives single completions.

    Raises:
        ConfigError: the model and the task do not fit (names both), an unknown task, a bad
            option, an unreadable run ``config.yaml``, an environment that cannot be built,
            ``env_options`` or ``max_turns`` without an environment, ``max_turns`` < 1.
    """
    from echotrain.runtime import preflight
    from echotrain.runtime.loading import generation_settings, read_run_config, run_dir_of
    from echotrain.train.evaluate import default_eval_task

    run = run_dir_of(model)
    run_cfg = read_run_config(run) if run is not None else {}
    model_name = run_cfg.get("model") if run is not None else model
    model_label = f"--model {model!r}" + (f" (a run of model={model_name})" if run is not None else "")
    generation, gen_source = generation_settings(model, decode_loop, sampler)
    source = ""  # where the task came from, for the first line
    if task is not None:
        name, opts = task, dict(options)
    elif run is not None:
        name = str(run_cfg.get("task") or "default")
        opts = {**(run_cfg.get("task_options") or {}), **options}
        source = f"the run's task {name}"
    elif preflight.testbed_task_of(model) is not None:
        name, opts = preflight.testbed_task_of(model), dict(options)
        source = f"{model}'s own task {name}"
    else:
        name, opts = "default", dict(options)
    mismatch = preflight.model_task_mismatch(model_name, name, model_label=model_label,
                                             task_label=f"--task {name!r}", task_key="--task ")
    if mismatch:
        raise ConfigError(mismatch)
    built = preflight.check_task(name, opts, key="--task")
    held_out = bool(source) and not options
    if held_out:
        held = default_eval_task(built, name, opts)
        where = f"held-out prompts ({held!r})" if held is not built else "its own prompts (no held-out split)"
        held_out, built = held is not built, held
    else:
        where = f"{built!r}" if source else ""
    # what the model's own settings give: a run's config.yaml (without --task), or a testbed policy's (on its own
    # task, named or not: --task testbed-calc with 48 new tokens and no calculator would cut its tool calls)
    own_task = task is None or (run is None and task == preflight.testbed_task_of(model))
    own_cfg = run_cfg if run is not None else testbed_eval_settings(model) if own_task else {}
    from_run = max_new_tokens is None and own_task and "max_new_tokens" in own_cfg
    if max_new_tokens is None:
        max_new_tokens = int(own_cfg["max_new_tokens"]) if from_run else EVAL_MAX_NEW_TOKENS
    note = []
    if source:
        note.append(f"evaluating on {source}" + (f" (task_options {opts})" if opts else "") + f", {where}")
    if run is not None:
        taken = [f"{k}={v}" for k, v in generation.items() if {"decode_loop": decode_loop, "sampler": sampler}[k] is None]
        if from_run:
            taken.insert(0, f"max_new_tokens={max_new_tokens}")
        if taken:
            note.append(f"{', '.join(taken)} as the run ({gen_source})")
    elif from_run:
        note.append(f"max_new_tokens={max_new_tokens} as {model}'s runs (--max-new-tokens sets another)")
    if note and (run is not None or task is None):
        note.append("--task, --task-option, --max-new-tokens, --decode-loop, --sampler set them" if run is not None
                    else "--task sets another")
    episodes = None
    if max_turns is not None and max_turns < 1:
        raise ConfigError(f"--max-turns must be >= 1, got {max_turns}")
    if env == "":
        raise ConfigError("--env must name an environment (or none: single completions)")
    run_env = own_cfg.get("env") or ("tools" if own_cfg.get("tools") else None)
    if run_env is not None and env in (None, run_env):  # the run's environment, turns and budget (--env-option over them)
        env_cfg = {**own_cfg, **({"max_turns": max_turns} if max_turns else {}),
                   "env_options": {**(own_cfg.get("env_options") or {}), **(env_options or {})}}
        whose = "the run's " if run is not None else f"{model}'s "
        label = f"{model_label}: {whose}environment env={run_env!r}"
    elif env not in (None, "none"):  # another environment: its own options, max_turns (else 4), a derived budget
        env_cfg = {"env": env, "env_options": dict(env_options or {}), "max_turns": max_turns}
        whose, label = "", f"--env {env!r}"
    else:
        env_cfg = None
        if env_options or max_turns is not None:
            raise ConfigError("--env-option and --max-turns need an environment: --env NAME (or a run trained with env)")
    if env_cfg is not None:
        from echotrain.train.episodes import episodes_of_run

        try:
            episodes = episodes_of_run(env_cfg, max_new_tokens)
        except (ValueError, TypeError, KeyError, ImportError) as exc:
            raise ConfigError(f"{label} cannot be built here: {exc}") from None
        note.insert(0, f"episodes with {whose}environment (env={env_cfg.get('env') or 'tools'}, "
                       f"max_turns={episodes['max_turns']}, max_episode_tokens={episodes['max_episode_tokens']})")
    return EvalPlan(task=built, task_name=name, task_options=opts, held_out=held_out, max_new_tokens=max_new_tokens,
                    generation=generation, note="; ".join(note), episodes=episodes)


