"""``echotrain eval`` of a run directory or a testbed policy without ``--task`` (issue 40 item 1):
the run's task and task options on its held-out prompts, its ``max_new_tokens``, ``decode_loop``
and ``sampler``, said in the first line; ``--model testbed`` on its own task; a model/task
mismatch is one error line naming both (exit 2), for ``eval --task``, ``eval --suite`` and
``train``. Through the real CLI (``echotrain.cli.main``), offline, tiny settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from echotrain import cli
from echotrain.tasks.testbed import TestbedTask

TINY_TRAIN = ["steps=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4", "micro_batch_size=8",
              "eval_prompts=2", "eval_every=0", "num_threads=1", "progress=false", "plots=false",
              "save_final_model=false", "save_every=0"]
# 3 prompts, greedy, one sample each; --show 3 puts every prompt's question in the JSON
TINY_EVAL = ["--prompts", "3", "--n", "1", "--temperature", "0", "--threads", "1", "--json", "--show", "3"]


@pytest.fixture
def offline(tmp_path, monkeypatch, testbed_cache):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture
def testbed_run(offline, capsys):
    """A finished 1-step testbed run trained with sampler=multinomial (not the default)."""
    run = offline / "runs" / "tb"
    assert cli.main(["train", "model=testbed", "task=testbed", "sampler=multinomial", *TINY_TRAIN,
                     f"output_dir={run}"]) == 0
    capsys.readouterr()
    return run


def _eval(capsys, argv: list[str]) -> tuple[dict, list[str]]:
    capsys.readouterr()
    assert cli.main(["eval", *argv]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err.splitlines()


def _held_out_questions(n: int, seed: int = 1234) -> list[str]:
    """The questions ``echotrain eval --prompts n --seed seed`` draws from the testbed's held-out split."""
    return [e.question for e in TestbedTask(split="test", size=512, seed=0).sample(n, seed)]


def test_eval_of_a_testbed_run_takes_the_runs_task_and_settings(testbed_run, capsys):
    for model in (testbed_run, next((testbed_run / "checkpoints").glob("step_*.pt"))):  # a run and its checkpoint
        res, err = _eval(capsys, ["--model", str(model), *TINY_EVAL])
        assert err[0] == ("echotrain eval: evaluating on the run's task testbed, held-out prompts (TestbedTask("
                          "split='test', size=512, seed=0)); max_new_tokens=4, decode_loop=echotrain, "
                          f"sampler=multinomial as the run ({testbed_run / 'config.yaml'}); --task, --task-option, "
                          "--max-new-tokens, --decode-loop, --sampler set them")
        assert (res["task"], res["task_options"], res["held_out"]) == ("testbed", {}, True)
        assert (res["max_new_tokens"], res["decode_loop"], res["sampler"]) == (4, "echotrain", "multinomial")
        assert [s["question"] for s in res["samples"]] == _held_out_questions(3)
    # given options are laid over the run's and taken as given: the training split, no held-out swap
    res, err = _eval(capsys, ["--model", str(testbed_run), "--task-option", "size=100",
                              "--max-new-tokens", "6", "--sampler", "inverse_cdf", *TINY_EVAL])
    assert err[0].startswith("echotrain eval: evaluating on the run's task testbed (task_options {'size': 100}), "
                             "TestbedTask(split='train', size=100, seed=0); decode_loop=echotrain as the run")
    assert (res["held_out"], res["max_new_tokens"], res["sampler"]) == (False, 6, "inverse_cdf")
    train = TestbedTask(split="train", size=100, seed=0).sample(3, 1234)
    assert [s["question"] for s in res["samples"]] == [e.question for e in train]
    # an explicit --task, even the run's own: the run's max_new_tokens is not taken (the testbed policy's are not
    # either: a run is not the policy by name)
    res, err = _eval(capsys, ["--model", str(testbed_run), "--task", "testbed", *TINY_EVAL])
    assert res["max_new_tokens"] == 48 and not any("max_new_tokens=" in line for line in err)


def test_eval_of_the_testbed_policy_defaults_to_its_task(offline, capsys):
    res, err = _eval(capsys, ["--model", "testbed", *TINY_EVAL])
    assert err[0] == ("echotrain eval: evaluating on testbed's own task testbed, held-out prompts (TestbedTask("
                      "split='test', size=512, seed=0)); max_new_tokens=8 as testbed's runs (--max-new-tokens sets "
                      "another); --task sets another")
    assert (res["task"], res["held_out"], res["max_new_tokens"]) == ("testbed", True, 8)
    assert (res["decode_loop"], res["sampler"]) == ("echotrain", "inverse_cdf")
    assert [s["question"] for s in res["samples"]] == _held_out_questions(3)
    # an explicit --task is taken as written (no held-out swap); its own task keeps its response length
    res, err = _eval(capsys, ["--model", "testbed", "--task", "testbed", *TINY_EVAL])
    assert not err or not err[0].startswith("echotrain eval: evaluating")
    assert res["held_out"] is False and res["max_new_tokens"] == 8
    assert [s["question"] for s in res["samples"]] == [e.question for e in TestbedTask().sample(3, 1234)]


def test_eval_of_a_testbed_policy_generates_as_its_runs(offline, capsys):
    """``--model testbed-length`` / ``testbed-calc`` evaluate with their runs' response length (72 / 96 new tokens:
    the 48 of other models cut their chains and tool calls) and testbed-calc as episodes with the calculator
    (max_turns 2); ``--max-new-tokens`` and ``--env none`` override."""
    res, err = _eval(capsys, ["--model", "testbed-length", *TINY_EVAL])
    assert res["max_new_tokens"] == 72 and "max_new_tokens=72 as testbed-length's runs" in err[0]
    res, err = _eval(capsys, ["--model", "testbed-calc", *TINY_EVAL])
    assert res["max_new_tokens"] == 96
    assert err[0].startswith("echotrain eval: episodes with testbed-calc's environment (env=calculator, max_turns=2, ")
    res, err = _eval(capsys, ["--model", "testbed-calc", "--max-new-tokens", "12", "--env", "none", *TINY_EVAL])
    assert res["max_new_tokens"] == 12 and "episodes" not in err[0] and "max_new_tokens=" not in err[0]
    res, err = _eval(capsys, ["--model", "testbed-calc", "--max-turns", "1", *TINY_EVAL])
    assert "env=calculator, max_turns=1, " in err[0]
    # --task naming the policy's own task keeps its settings (taken as written: no held-out swap); another drops them
    res, err = _eval(capsys, ["--model", "testbed-calc", "--task", "testbed-calc", *TINY_EVAL])
    assert res["max_new_tokens"] == 96 and res["held_out"] is False
    assert err[0] == ("echotrain eval: episodes with testbed-calc's environment (env=calculator, max_turns=2, "
                      "max_episode_tokens=384); max_new_tokens=96 as testbed-calc's runs (--max-new-tokens sets another)")
    res, err = _eval(capsys, ["--model", "testbed-length", "--task", "testbed", *TINY_EVAL])
    assert res["max_new_tokens"] == 48 and not any("max_new_tokens=" in line for line in err)


def test_the_default_n_follows_the_temperature(offline, capsys):
    """Without ``--n``: 4 samples a prompt when sampling, 1 at ``--temperature 0`` (greedy: the same sample n times);
    an explicit ``--n 4`` there is refused (tests/train/test_cli_errors.py)."""
    rest = ["--prompts", "2", "--threads", "1", "--json", "--max-new-tokens", "4"]
    assert _eval(capsys, ["--model", "testbed", "--temperature", "0", *rest])[0]["n"] == 1
    assert _eval(capsys, ["--model", "testbed", *rest])[0]["n"] == 4


def test_testbed_eval_settings_are_those_of_its_configs():
    """``TESTBED_EVAL_SETTINGS`` (what ``echotrain eval --model NAME`` uses) agree with ``configs/testbed*.yaml``,
    one entry for each testbed policy."""
    from pathlib import Path

    import yaml

    from echotrain.models.testbed import TESTBED_CONFIGS, TESTBED_EVAL_SETTINGS

    configs = Path(__file__).resolve().parents[2] / "configs"
    seen = set()
    for path in sorted(configs.glob("testbed*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        settings = TESTBED_EVAL_SETTINGS[cfg["model"]]
        assert settings == {k: cfg.get(k) for k in settings}, path.name
        assert cfg.get("env") == settings.get("env"), path.name
        seen.add(cfg["model"])
    assert seen == set(TESTBED_EVAL_SETTINGS) == set(TESTBED_CONFIGS)


def _fails(capsys, argv: list[str], *needles: str, loaded: bool = False) -> str:
    """Exit 2, no traceback, nothing on stdout; the error is the one stderr line (the last one
    when a model was ``loaded``: torch's import-time warnings may precede it)."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert (loaded or len(lines) == 1) and "Traceback" not in out.err and out.out == "", out.err
    err = lines[-1]
    assert err.startswith("echotrain eval: error: ") or err.startswith("echotrain train: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_a_model_task_mismatch_is_one_line_naming_both(offline, capsys):
    run = offline / "handmade"  # a testbed run directory (config.yaml + final_model/): nothing is loaded
    (run / "final_model").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "testbed", "task": "testbed"}))
    rows = offline / "mc.jsonl"
    rows.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    fix = "use --task testbed"
    _fails(capsys, ["eval", "--model", "testbed", "--task", "default"], "--model 'testbed'", "--task 'default'", fix)
    _fails(capsys, ["eval", "--model", "testbed-length", "--task", "gsm8k"], "--model 'testbed-length'",
           "--task 'gsm8k'", "use --task testbed-length")
    _fails(capsys, ["eval", "--model", str(run), "--task", "default"],
           f"--model {str(run)!r} (a run of model=testbed)", "--task 'default'", fix)
    _fails(capsys, ["eval", "--model", "testbed", "--benchmark", f"choice:mini={rows}", "--out", str(offline / "o")],
           "--model 'testbed'", f"--benchmark choice:mini={rows} (chat prompts)", fix)
    _fails(capsys, ["eval", "--model", str(run), "--suite", "math"], "(a run of model=testbed)", "--suite math")
    _fails(capsys, ["train", "model=testbed", f"output_dir={offline / 't'}"], "model=testbed", "task=default",
           "use task=testbed")
    assert not (offline / "o").exists() and not (offline / "t").exists()


def test_a_model_without_chat_template_on_a_chat_task_is_one_line(tmp_path, monkeypatch, capsys):
    """A Hugging Face model whose tokenizer has no chat template, on a task (or suite) of chat
    prompts: exit 2 naming both (was a traceback from transformers); plain-text prompts still run."""
    from tests.train.conftest import make_model, make_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = make_tokenizer()
    tok.chat_template = None
    make_model(tok).save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    rows = tmp_path / "mc.jsonl"
    rows.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    model = str(tmp_path / "plain")
    _fails(capsys, ["eval", "--model", model, "--prompts", "1", "--n", "1", "--threads", "1"],
           f"--model {model!r} has no chat template", "--task 'default' has chat prompts", loaded=True)
    _fails(capsys, ["eval", "--model", model, "--benchmark", f"choice:mini={rows}", "--out", str(tmp_path / "o"),
                    "--no-progress", "--threads", "1"],
           f"--model {model!r} has no chat template", f"--benchmark choice:mini={rows} (chat prompts)", loaded=True)
    capsys.readouterr()
    assert cli.main(["eval", "--model", model, "--task", "testbed", "--prompts", "1", "--n", "1", "--threads", "1",
                     "--max-new-tokens", "2", "--json"]) == 0


def test_a_testbed_run_asked_for_its_final_model_says_where_its_weights_are(offline, capsys):
    """The byte-level testbed has no save_pretrained: save_final_model=true wrote nothing, silently
    (found by a distillation study whose teacher run had no final_model/). Now one line says so,
    and the run directory still works as a model for eval (its last checkpoint)."""
    run = offline / "runs" / "fm"
    argv = ["train", "model=testbed", "task=testbed", *TINY_TRAIN, "save_every=1", f"output_dir={run}"]
    assert cli.main([*argv[:-1], "save_final_model=true", argv[-1]]) == 0
    err = capsys.readouterr().err
    assert "no final_model/ written: LoopedTransformer has no save_pretrained" in err
    assert "; 1 thread, device cpu" in err  # num_threads=1: singular (was "1 threads")
    assert not (run / "final_model").exists() and list((run / "checkpoints").glob("step_*.pt"))
    out, _ = _eval(capsys, ["--model", str(run), *TINY_EVAL])
    assert out
    assert cli.main([*argv[:-1], f"output_dir={offline / 'runs' / 'nofm'}"]) == 0  # save_final_model=false: quiet
    assert "final_model" not in capsys.readouterr().err


@pytest.mark.parametrize("omp", ["1", None, "x"])
def test_num_threads_0_honours_omp_num_threads(offline, capsys, monkeypatch, omp):
    """num_threads=0 took all cores even with OMP_NUM_THREADS=1 set (a new user's surprise; torch's
    own default honours it): now OMP_NUM_THREADS when it is a positive integer, else all cores, and
    the startup line says which."""
    import torch

    from echotrain.runtime import preflight

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    try:
        argv = [a for a in TINY_TRAIN if not a.startswith("num_threads=")]
        assert cli.main(["train", "model=testbed", "task=testbed", *argv, "num_threads=0",
                         f"output_dir={offline / 'runs' / 'threads'}"]) == 0
        err = capsys.readouterr().err
        if omp == "1":
            assert "; 1 thread (num_threads=0: OMP_NUM_THREADS=1), device" in err
            assert preflight.default_threads() == (1, "OMP_NUM_THREADS=1")
        else:  # unset or not a number: every core this process may use
            n = preflight.affinity_cores()
            assert f"; {n} thread{'s' if n > 1 else ''} (num_threads=0: all cores), device" in err
            assert preflight.default_threads() == (n, "all cores")
    finally:
        torch.set_num_threads(before)
