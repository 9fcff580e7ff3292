"""Every bad input of ``echotrain train`` / ``echotrain eval`` fails before any heavy work: exit
status 2, one message naming the key or path, no traceback, nothing written or changed (issue 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from echotrain import cli
from echotrain.train.config import resolve_config
from echotrain.train.trainer import Trainer

TINY = dict(steps=3, prompts_per_step=2, num_generations=2, max_new_tokens=4, micro_batch_size=4, num_mini_batches=1,
            lr=1e-2, device="cpu", progress=False, plots=False, save_final_model=False, eval_prompts=0, seed=0)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to show nothing was written or changed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """Run the CLI in an empty folder with an empty Hugging Face cache, offline."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / ".hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return tmp_path


def fails(capsys, root: Path, argv: list[str], *needles: str) -> str:
    """Run ``echotrain argv``: exit 2, one error line holding every needle, nothing written."""
    before = snapshot(root)
    t0 = time.perf_counter()
    rc = cli.main(argv)
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"echotrain {argv[0]}: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err
    assert snapshot(root) == before  # nothing written or changed
    assert elapsed < 10, f"{argv} took {elapsed:.1f} s"  # before any model load
    return err


@pytest.fixture
def tiny_run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """A finished 3-step run of the tiny model, a checkpoint at every step (keep_last=3)."""

    def _make(name="run", **over):
        cfg = resolve_config(overrides={**TINY, "output_dir": str(tmp_path / name), "save_every": 1, "keep_last": 3,
                                        **over})
        trainer = Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task)
        trainer.train()
        return trainer.run_dir

    return _make


# ---------------------------------------------------------------- config file and keys
def test_malformed_yaml(cwd, capsys):
    (cwd / "bad.yaml").write_text("steps: 3\nlr: [1e-5\n")
    fails(capsys, cwd, ["train", "--config", "bad.yaml"], "--config 'bad.yaml'", "malformed YAML", "bad.yaml:3:1")


def test_yaml_not_a_mapping_and_missing_file(cwd, capsys):
    (cwd / "list.yaml").write_text("- a\n- b\n")
    fails(capsys, cwd, ["train", "--config", "list.yaml"], "expected a mapping")
    fails(capsys, cwd, ["train", "--config", "nope.yaml"], "'nope.yaml'", "file not found")


@pytest.mark.parametrize("token, suggestion", [("lerning_rate=1e-5", "'lr'"), ("learning_rate=1e-5", "'lr'"),
                                               ("max_step=3", "'steps'"), ("num_generation=4", "'num_generations'"),
                                               ("beta=0.04", "'kl_coef'")])
def test_unknown_key_suggests_by_edit_distance_and_alias(cwd, capsys, token, suggestion):
    key = token.split("=")[0]
    err = fails(capsys, cwd, ["train", token], f"unknown key {key!r}", "did you mean")
    assert err.split("did you mean ")[1].startswith(suggestion)


def test_bad_task_option_yaml(cwd, capsys):
    fails(capsys, cwd, ["train", "task_options.path=[oops"], "task_options.path", "not a valid YAML value")


# ---------------------------------------------------------------- paths
def test_missing_task_path_train_and_eval(cwd, capsys):
    fails(capsys, cwd, ["train", "task=gsm8k", "task_options.path=/nonexistent/train.jsonl"],
          "task='gsm8k'", "task_options.path='/nonexistent/train.jsonl'", "not found")
    fails(capsys, cwd, ["eval", "--task", "gsm8k", "--task-option", "path=/nonexistent/train.jsonl"],
          "--task='gsm8k'", "/nonexistent/train.jsonl", "not found")


def test_task_without_path_and_no_network_fails_fast(cwd, capsys):
    for argv in (["train", "task=gsm8k"], ["train", "task=math500"], ["eval", "--task", "gsm8k"]):
        err = fails(capsys, cwd, argv, "without task_options.path", "HF_HUB_OFFLINE", "not in the local cache",
                    "task_options.path=FILE.jsonl")
        assert "openai/gsm8k" in err or "HuggingFaceH4/MATH-500" in err


def test_unreachable_hub_detected_without_offline_flag(cwd, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://echotrain-no-such-host.invalid")
    fails(capsys, cwd, ["train", "task=gsm8k"], "is not reachable (no network)", "task_options.path=FILE.jsonl")


def test_jsonl_errors_use_one_based_line_numbers(cwd, capsys):
    rows = [{"question": "1+1", "answer": "#### 2"}, {"question": "2+2", "answer": "#### 4"}, {"question": "3+3"}]
    (cwd / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fails(capsys, cwd, ["train", "task=gsm8k", "task_options.path=d.jsonl"], "d.jsonl:3: line 3 lacks field(s) ['answer']")
    (cwd / "e.jsonl").write_text('{"question": "a", "answer": "#### 1"}\n\n{"question": "b", "answer": "x"}\n')
    fails(capsys, cwd, ["train", "task=gsm8k", "task_options.path=e.jsonl"], "e.jsonl:3", "'####'")
    (cwd / "f.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": 2\n')
    fails(capsys, cwd, ["train", "task=jsonl", "task_options.path=f.jsonl"], "f.jsonl:2: invalid JSON")
    (cwd / "g.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "solution": "2"}\n')
    fails(capsys, cwd, ["train", "task=jsonl", "task_options.path=g.jsonl"], "g.jsonl:2: line 2 lacks field(s) ['answer']",
          "task_options.answer_field")


@pytest.mark.parametrize("model, needles", [
    ("/nonexistent", ["model='/nonexistent'", "no such file or folder"]),
    ("./missing/model", ["no such file or folder"]),
    ("missing.gguf", ["model='missing.gguf'", "GGUF file not found"]),
    ("not a hub id!", ["not a Hugging Face hub id"]),
    ("SomeOrg/some-model", ["'SomeOrg/some-model'", "HF_HUB_OFFLINE", "not in the local cache"]),
])
def test_bad_model_paths(cwd, capsys, model, needles):
    fails(capsys, cwd, ["train", f"model={model}"], *needles)
    fails(capsys, cwd, ["eval", "--model", model], *[n.replace("model=", "--model=") for n in needles])


def test_model_folder_without_config(cwd, capsys):
    (cwd / "empty_model").mkdir()
    fails(capsys, cwd, ["train", "model=empty_model"], "no config.json")


def test_output_dir_is_a_file_or_another_run(cwd, capsys):
    (cwd / "afile").write_text("x")
    fails(capsys, cwd, ["train", "output_dir=afile"], "output_dir='afile' is a file")
    (cwd / "old").mkdir()
    (cwd / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    fails(capsys, cwd, ["train", "output_dir=old"], "holds a run already", "--resume old")


def test_chat_template_and_reward_paths(cwd, capsys):
    fails(capsys, cwd, ["train", "chat_template=missing.jinja"], "chat_template='missing.jinja'")
    fails(capsys, cwd, ["train", "chat_template={% for m in messages %}"], "chat_template: invalid Jinja")
    fails(capsys, cwd, ["train", "reward=no_such_module:fn"], "reward='no_such_module:fn'", "cannot import")
    fails(capsys, cwd, ["train", "reward=os.path"], "expected 'module:function'")
    fails(capsys, cwd, ["train", "reward=os:no_such_fn"], "has no callable 'no_such_fn'")


# ---------------------------------------------------------------- devices and threads
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda(cwd, capsys, device):
    fails(capsys, cwd, ["train", f"device={device}"], f"device={device!r}", "no CUDA", "device=cpu")
    fails(capsys, cwd, ["eval", "--device", device], f"--device={device!r}", "no CUDA")


def test_bad_device_names(cwd, capsys):
    fails(capsys, cwd, ["train", "device=gpu"], "device='gpu'", "valid: auto, cpu, cuda")
    fails(capsys, cwd, ["eval", "--device", "tpu"], "--device='tpu'", "not a device")


def test_absurd_thread_counts(cwd, capsys):
    fails(capsys, cwd, ["train", "num_threads=100000"], "num_threads=100000", f"[0, {os.cpu_count()}]")
    fails(capsys, cwd, ["eval", "--threads", "100000"], "--threads=100000")
    fails(capsys, cwd, ["eval", "--threads", "-1"], "--threads=-1")


# ---------------------------------------------------------------- resume
def test_resume_cases_without_a_run(cwd, capsys):
    fails(capsys, cwd, ["train", "--resume"], "--resume needs a run directory")
    fails(capsys, cwd, ["train", "--resume", "nowhere"], "'nowhere'", "no such run directory")
    (cwd / "notrun").mkdir()
    fails(capsys, cwd, ["train", "--resume", "notrun"], "no config.yaml")
    (cwd / "badcfg").mkdir()
    (cwd / "badcfg" / "config.yaml").write_text("steps: [\n")
    fails(capsys, cwd, ["train", "--resume", "badcfg"], "malformed YAML", "config.yaml:2")


def test_resume_without_checkpoint(cwd, capsys, tiny_run):
    run = tiny_run("r", save_every=0, steps=1)
    for p in (run / "checkpoints").iterdir():
        p.unlink()
    capsys.readouterr()  # the tiny run's own warnings are not the resume's error
    fails(capsys, run.parent, ["train", "--resume", str(run)], "no checkpoint in", "save_every")


def test_resume_with_steps_below_reached(cwd, capsys, tiny_run):
    run = tiny_run("r")
    fails(capsys, run.parent, ["train", "--resume", str(run), "steps=2"],
          "steps=2 is below the step the run already reached (3", "steps=3 or more")


def test_resume_of_a_finished_run_without_more_steps_writes_nothing(cwd, capsys, tiny_run):
    run = tiny_run("r")
    before = snapshot(run.parent)
    assert cli.main(["train", "--resume", str(run)]) == 0
    assert "already reached steps=3; nothing to do (give steps=4 or more" in capsys.readouterr().err
    assert snapshot(run.parent) == before


def test_resume_truncated_only_checkpoint(cwd, capsys, tiny_run):
    run = tiny_run("r", keep_last=1)
    (ckpt,) = list((run / "checkpoints").iterdir())
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    fails(capsys, run.parent, ["train", "--resume", str(run), "steps=4"], "damaged", ckpt.name,
          "no earlier checkpoint")
    fails(capsys, run.parent, ["eval", "--model", str(ckpt)], "checkpoint file is damaged")


def test_resume_falls_back_to_previous_checkpoint(tiny_run, tiny_tokenizer, make_tiny_model, digit_task, capsys):
    from echotrain.runtime import preflight

    run = tiny_run("r")
    ckpts = sorted((run / "checkpoints").iterdir())
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:1000])
    assert preflight.check_resume(run, steps=4) == ckpts[-2]
    assert f"checkpoint {ckpts[-1]} is damaged" in capsys.readouterr().err
    cfg = resolve_config(overrides={**TINY, "output_dir": str(run), "steps": 4})
    trainer = Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task,
                      resume=True)
    assert trainer.start_step == 2
    assert [r["step"] for r in trainer.train()] == [1, 2, 3, 4]


# ---------------------------------------------------------------- a real process
def test_subprocess_exit_code_no_traceback_and_debug(tmp_path):
    (tmp_path / "bad.yaml").write_text("lr: [\n")
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])}
    base = [sys.executable, "-m", "echotrain.cli", "train", "--config", "bad.yaml"]
    out = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "malformed YAML" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(base + ["--debug"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" in out.stderr and "ConfigError" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


# ---------------------------------------------------------------- output_dir, eval settings, model paths
@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: these errors must come first."""
    import echotrain.models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(echotrain.models, "load_policy", refuse)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_output_dir_before_any_model_load(cwd, capsys, no_model_load):
    """/proc accepts no new entry, even for root (whom os.access always allows)."""
    fails(capsys, cwd, ["train", "model=testbed", "task=testbed", "output_dir=/proc/forbidden/run"],
          "output_dir='/proc/forbidden/run'", "cannot write in /proc")
    # --debug adds the traceback and keeps exit 2
    assert cli.main(["train", "model=testbed", "task=testbed", "output_dir=/proc/forbidden", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err and "output_dir='/proc/forbidden'" in err


def test_read_only_output_dir(cwd, capsys, no_model_load):
    ro = cwd / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        from echotrain.runtime import preflight

        try:
            preflight.check_writable(ro, "output_dir")
            can_write = True
        except Exception:
            can_write = False
        if can_write:
            pytest.skip("this user (root) can write into a 0o555 folder; the /proc case above covers root")
        fails(capsys, cwd, ["train", f"output_dir={ro / 'run'}"], "output_dir=", "cannot write in", str(ro))
    finally:
        ro.chmod(0o755)


def test_eval_suite_options_without_a_suite_are_refused(cwd, capsys, no_model_load):
    """--out, --limit, --top-p ... belong to the benchmark suites: with --task (or none) they would be silently unused."""
    fails(capsys, cwd, ["eval", "--model", "testbed", "--out", "x"], "--out is an option of --suite / --benchmark")
    fails(capsys, cwd, ["eval", "--limit", "5", "--top-p", "0.9", "--data-dir", "d"],
          "--data-dir, --limit, --top-p are options of --suite / --benchmark")
    fails(capsys, cwd, ["eval", "--batch-size", "4", "--no-progress"], "--batch-size, --no-progress are options")


def test_eval_greedy_with_several_samples_is_refused(cwd, capsys, no_model_load):
    fails(capsys, cwd, ["eval", "--temperature", "0", "--n", "4"], "temperature=0", "n=4", "--n 1")
    fails(capsys, cwd, ["eval", "--temperature", "0", "--n", "2", "--k", "1,2"], "n=2", "identical")
    fails(capsys, cwd, ["eval", "--temperature", "-1", "--n", "1"], "--temperature must be >= 0")
    # the suite path refuses with the same rule
    fails(capsys, cwd, ["eval", "--benchmark", "gsm8k=nowhere.jsonl", "--temperature", "0", "--n", "4"],
          "decodes greedily", "--n 1")


def test_eval_missing_path_like_model_says_no_such_folder(cwd, capsys, no_model_load):
    (cwd / "runs").mkdir()
    err = fails(capsys, cwd, ["eval", "--model", "runs/does-not-exist"], "'runs/does-not-exist'", "no such folder",
                "runs/ exists")
    assert "hub" not in err
    # no local runs/ folder: could be a hub id, so the message says both
    fails(capsys, cwd, ["eval", "--model", "other/does-not-exist"], "no such local file or folder",
          "needs the Hugging Face hub model")
    fails(capsys, cwd, ["train", "model=runs/none"], "model='runs/none'", "no such folder")


def test_every_local_model_name_passes_the_preflight_offline(cwd):
    """Each name load_policy resolves without the hub (one table) is accepted with HF_HUB_OFFLINE=1."""
    from echotrain.models.hf import LOCAL_MODELS
    from echotrain.runtime import preflight

    assert "testbed" in LOCAL_MODELS and "smollm2-135m-instruct" in LOCAL_MODELS
    for name in LOCAL_MODELS:
        preflight.check_model(name)
        preflight.check_eval_model(name)
