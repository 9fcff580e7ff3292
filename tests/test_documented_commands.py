"""Every command that README.md or docs/**/*.md shows with a shipped config (``configs/...``) or
the testbed model runs through the real CLI (``echotrain.cli.main``), offline, with tiny settings.

The commands are found in the Markdown itself (fenced and indented code blocks, and inline code
such as the README's table of studies), so a new documented command is tested without an edit
here; a placeholder this module cannot fill fails :func:`test_commands_are_found_and_filled`.

What "tiny" means per subcommand (appended to the command, so they win over its own values;
every other key of the command is kept as written):

- ``train``: 1 step of 2+ prompts x 2 samples x 4 tokens, a 2-prompt evaluation (every step: the one), one thread,
  warm-up steps (``sft_steps``, where a command has them) of 2 demonstrations (and then the
  command's own ``max_new_tokens``: a demonstration longer than a turn is left out),
  ``output_dir`` in a temporary folder (``prompts_per_step`` at least the resolved
  ``num_mini_batches``, read with ``--print-config``).
- ``eval``: 2 prompts of at most 4 new tokens, one thread (``runs/<run>``: a tiny testbed run; a
  ``train`` command's ``teacher=runs/<run>`` is that run too).
- ``compare select CONFIG``: on a screening report written here (random per-seed numbers of
  every arm), it must print a confirmation command or say there is nothing to confirm.
- ``compare CONFIG``: the grid is validated with ``--dry-run`` (every cell's config and the
  model preflight, no run); ``--cell I`` runs that cell (1 step, tiny sizes, a subprocess as a
  scheduler would). The whole grid with ``seeds=1`` and its ``compare report`` run in
  :func:`test_compare_testbed_grid_and_report` (``slow``).

The model is the one the command names: ``testbed`` comes from :func:`testbed_cache` (the built
testbed when cached, else a random-weight stand-in of the same architecture), SmolLM2-135M from
its converted cache.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from echotrain import cli

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# placeholder -> the value a test run uses
FILL = {"preset=<arm>": "preset=grpo", "seed=<n>": "seed=1"}
OPTIONAL = re.compile(r"\s\[[^\]]*\]")  # "[overrides]", "[more run dirs ...]": left out
TINY_EVAL = ["--prompts", "2", "--max-new-tokens", "4", "--threads", "1"]


def _tiny_train(prompts: int) -> list[str]:
    return [f"prompts_per_step={prompts}", "num_generations=2", "max_new_tokens=4", "micro_batch_size=8",
            "eval_prompts=2", "eval_every=1", "num_threads=1", "progress=false", "plots=false",
            "save_final_model=false", "save_every=0", "log_samples=1", "sft_batch_size=2"]


def _strip_env(line: str) -> str:
    """``OMP_NUM_THREADS=1 nice -n 10 echotrain ...`` -> ``echotrain ...``."""
    tokens = line.split()
    while tokens and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]) or tokens[0] in ("nice", "-n", "10")):
        tokens.pop(0)
    return " ".join(tokens)


def commands_in(text: str) -> list[str]:
    """``echotrain`` command lines of a Markdown text: in fenced or 4-space-indented code blocks
    (``\\`` continuations joined) and in inline code spans."""
    out = [m.group(1) for m in re.finditer(r"`(echotrain [^`\n]+)`", text)]
    lines, fenced, i = text.splitlines(), False, 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        cmd = line.strip()
        while cmd.endswith("\\") and i < len(lines):
            cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        cmd = _strip_env(cmd)
        if cmd.startswith("echotrain "):
            out.append(cmd)
    return out


def _names_shipped_config_or_testbed(argv: list[str]) -> bool:
    """A shipped config, the testbed model or task, or the run folder of a shipped study."""
    from echotrain.models.testbed import TESTBED_CONFIGS

    study = [a for a in argv if re.fullmatch(r"runs/compare/\w+", a)]
    testbeds = set(TESTBED_CONFIGS)  # the shipped testbed policies (testbed, testbed-length, testbed-calc)
    return (any(a.startswith("configs/") or a.split("=", 1)[0] in ("model", "task") and a.split("=", 1)[-1] in testbeds
                for a in argv)
            or any(a in ("--model", "--task") and b in testbeds for a, b in zip(argv, argv[1:]))
            or any((ROOT / "configs" / "compare" / f"{Path(a).name}.yaml").is_file() for a in study))


def documented_commands() -> dict[str, list[str]]:
    """``{"FILE:command": argv}`` of every selected command (argv without ``echotrain``), first
    occurrence of each; placeholders filled."""
    found: dict[str, list[str]] = {}
    seen: set[tuple[str, ...]] = set()
    for path in DOC_FILES:
        for cmd in commands_in(path.read_text(encoding="utf-8")):
            for a, b in FILL.items():
                cmd = cmd.replace(a, b)
            argv = [t for t in shlex.split(OPTIONAL.sub("", cmd), comments=True)[1:] if t != "..."]
            if not _names_shipped_config_or_testbed(argv) or tuple(argv) in seen:
                continue
            seen.add(tuple(argv))
            found[f"{path.relative_to(ROOT)}: {' '.join(argv)[:90]}"] = argv
    return found


COMMANDS = documented_commands()


def test_commands_are_found_and_filled():
    """The parser sees the known commands; no placeholder is left unfilled."""
    subcommands = [argv[0] for argv in COMMANDS.values()]
    assert subcommands.count("train") >= 4 and subcommands.count("eval") >= 2 and subcommands.count("compare") >= 6
    for argv in COMMANDS.values():
        bad = [a for a in argv if re.search(r"<(?!run>)[^>]*>", a)]
        assert not bad, f"unfilled placeholder {bad} in {argv}: add it to FILL"
    assert any("configs/compare/testbed.yaml" in argv for argv in COMMANDS.values())
    assert any(argv[:3] == ["eval", "--model", "testbed"] for argv in COMMANDS.values())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, testbed_cache):
    """A working folder with the shipped configs; the CLI runs from there, offline."""
    d = tmp_path_factory.mktemp("documented")
    shutil.copytree(ROOT / "configs", d / "configs")
    return d


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))  # the compare cells are subprocesses
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return workdir


@pytest.fixture(scope="module")
def testbed_run(workdir, testbed_cache):
    """A finished 1-step testbed run (for ``--model runs/<run>``)."""
    run = workdir / "runs" / "tiny-testbed"
    assert cli.main(["train", "model=testbed", "task=testbed", "steps=1", *_tiny_train(2), f"output_dir={run}"]) == 0
    return run


def _main(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _without(argv: list[str], *keys: str) -> list[str]:
    return [a for a in argv if a.split("=", 1)[0] not in keys]


def _drop_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        else:
            out.append(a)
    return out


def tiny_argv(argv: list[str], out: Path, run: Path | None, capsys) -> list[str]:
    """The command with the tiny settings of this module's docstring."""
    if argv[0] == "train":
        assert "--resume" not in argv, "a documented resume of a shipped config: give it a run to resume here"
        base = _without(argv, "output_dir")
        rc, text = _main([*base, "--print-config"], capsys)
        assert rc == 0, text
        resolved = yaml.safe_load(text)
        mini = int(resolved["num_mini_batches"])
        base = [f"teacher={run}" if a == "teacher=runs/<run>" else a for a in base]  # a distillation's teacher
        tiny = _tiny_train(max(2, mini))
        if resolved.get("sft_steps"):  # the warm-up leaves out demonstrations a 4-token turn cannot hold
            tiny = [a for a in tiny if not a.startswith("max_new_tokens=")]
        return [*base, "steps=1", *tiny, f"output_dir={out}"]
    if argv[0] == "eval":
        return [str(run) if a == "runs/<run>" else a for a in argv] + TINY_EVAL
    if argv[:2] == ["compare", "select"]:  # a screening report: per-seed numbers of every arm
        import random

        from echotrain.compare.config import load_spec

        spec, rng = load_spec(Path.cwd() / argv[2]), random.Random(0)
        runs = [{"arm": lab, "seed": seed, "auc": rng.random(), "final": rng.random(), "any_flag": rng.randint(0, 1)}
                for lab in spec.arm_labels() for seed in spec.seeds]
        (out / "report").mkdir(parents=True)
        (out / "report" / "summary.json").write_text(json.dumps({"runs": runs, "verdict": []}))
        return [*_without(argv, "output_dir"), f"output_dir={out}"]
    if argv[0] == "compare" and argv[1] != "report":
        base = _drop_option(_drop_option(_without(argv, "output_dir", "seeds"), "--jobs"), "--nice")
        given = {a.split("=", 1)[0] for a in base if "=" in a}
        mini = int(next((a.split("=", 1)[1] for a in base if a.startswith("num_mini_batches=")), 1))
        tiny = [*_tiny_train(max(2, mini)), "steps=1"] + ([] if "num_mini_batches" in given else ["num_mini_batches=1"])
        mode = [] if "--cell" in base else ["--dry-run"]
        return [*base, *mode, "seeds=1", *tiny, f"output_dir={out}"]
    raise AssertionError(f"no tiny form for {argv}")


def _resolved_model(cmd: list[str], capsys) -> str | None:
    rc, text = _main([*cmd, "--print-config"], capsys)
    assert rc == 0, text
    return yaml.safe_load(text)["model"]


#: (``echotrain testbed ...`` builds a testbed policy for minutes: tests/models/test_testbed.py builds a tiny one)
RUN_CASES = {k: v for k, v in COMMANDS.items() if v[:2] != ["compare", "report"] and v[0] != "testbed"}


@pytest.mark.parametrize("argv", list(RUN_CASES.values()), ids=list(RUN_CASES))
def test_documented_command(argv, in_workdir, testbed_run, tmp_path, capsys):
    cmd = tiny_argv(argv, tmp_path / "out", testbed_run, capsys)
    if cmd[0] == "train" and _resolved_model(cmd, capsys) != "testbed":
        # SmolLM2-135M: one optimizer step of the full model is ~5 s of CPU (ppo_epochs x
        # mini-batches of them, and a 1.6 GB checkpoint); here the checks run before any model
        # loads, the run itself is test_documented_smollm_train_runs (slow)
        _preflight_only(cmd)
        return
    rc, text = _main(cmd, capsys)
    assert rc == 0, f"echotrain {' '.join(cmd)}\n{text[-3000:]}"
    assert "huggingface.co" not in text and "Traceback" not in text
    if cmd[0] == "train":
        assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1
    if cmd[:2] == ["compare", "select"]:
        assert "phase=confirmation" in text or "nothing to confirm" in text
    if cmd[0] == "compare" and "--cell" in cmd:
        cells = list((tmp_path / "out" / "cells").glob("*/metrics.jsonl"))
        assert len(cells) == 1 and cells[0].read_text().count("\n") == 1


def _preflight_only(cmd: list[str]) -> None:
    """What ``echotrain train`` checks before it loads the model, on the command's resolved config."""
    import argparse

    from echotrain.runtime import preflight
    from echotrain.train.commands import _resolve_train_config

    config = next((b for a, b in zip(cmd, cmd[1:]) if a == "--config"), None)
    args = argparse.Namespace(overrides=[a for a in cmd[1:] if "=" in a], extra=[], config=config, resume=None)
    cfg = _resolve_train_config(args)
    preflight.check_threads(cfg.num_threads)
    preflight.check_device(cfg.device)
    preflight.check_output_dir(cfg.output_dir, resume=False)
    preflight.check_model(cfg.model)
    preflight.check_task(cfg.task, cfg.task_options)


SMOLLM_TRAIN = {k: v for k, v in RUN_CASES.items() if v[0] == "train" and not any(
    a == "model=testbed" or a == "configs/testbed.yaml" for a in v)}


@pytest.mark.slow
@pytest.mark.parametrize("argv", list(SMOLLM_TRAIN.values()), ids=list(SMOLLM_TRAIN))
def test_documented_smollm_train_runs(argv, in_workdir, tmp_path, capsys):
    """The documented SmolLM2-135M train commands, 1 step with tiny sizes (2-3 min on a loaded core)."""
    cmd = tiny_argv(argv, tmp_path / "out", None, capsys)
    rc, text = _main(cmd, capsys)
    assert rc == 0, text[-3000:]
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1


def test_compare_preflight_names_an_unreachable_model(in_workdir, capsys):
    """A hub model offline stops the whole grid at once with one message, not in every cell."""
    rc, text = _main(["compare", "configs/compare/testbed.yaml", "model=someorg/not-cached", "--dry-run",
                      f"output_dir={in_workdir / 'nohub'}"], capsys)
    assert rc == 2 and "model='someorg/not-cached'" in text and "Traceback" not in text


@pytest.mark.slow
def test_compare_testbed_grid_and_report(in_workdir, tmp_path, capsys):
    """The README's study command, every arm with seeds=1 and 1 step, --jobs 2, then each
    documented ``compare report`` on the finished study."""
    out = tmp_path / "study"
    cmd = ["compare", "configs/compare/testbed.yaml", "--jobs", "2", "seeds=1", "steps=1", "num_mini_batches=1",
           *_tiny_train(2), f"output_dir={out}"]
    rc, text = _main(cmd, capsys)
    assert rc == 0, text[-3000:]
    assert (out / "report" / "report.md").is_file()
    cells = sorted((out / "cells").glob("*/metrics.jsonl"))
    assert len(cells) == len(yaml.safe_load((ROOT / "configs/compare/testbed.yaml").read_text())["arms"])
    reports = [v for v in COMMANDS.values() if v[:2] == ["compare", "report"]]
    assert reports
    for argv in reports:
        argv = _drop_option(argv, "--out")
        argv = [str(out) if a.startswith("runs/compare/") else a for a in argv]
        rc, text = _main([*argv, "--out", str(tmp_path / "report")], capsys)
        assert rc == 0, text[-3000:]
        assert (tmp_path / "report" / "report.md").is_file()
