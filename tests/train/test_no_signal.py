"""The no-learning-signal warning, and what the start/end lines of `echotrain train` say, through
the real CLI on the CPU testbed with a reward that is always 0."""

from __future__ import annotations

import json

import pytest
import torch

from echotrain.train.no_signal import ALL_ZERO_VARIANCE, NoSignalWatch, all_zero_variance, summary_line


def test_all_zero_variance_needs_every_group_alike():
    gid = torch.tensor([0, 0, 1, 1])
    assert all_zero_variance(torch.tensor([0.0, 0.0, 1.0, 1.0]), gid)
    assert not all_zero_variance(torch.tensor([0.0, 0.0, 1.0, 0.0]), gid)  # one mixed group is signal


def test_watch_warns_once_after_k_leading_steps_and_never_after_signal():
    flat = {ALL_ZERO_VARIANCE: 1}
    w = NoSignalWatch(3)
    out = [w.update(flat) for _ in range(6)]
    assert out[:2] == [None, None] and out[3:] == [None] * 3
    assert "no learning signal: every group scored alike for 3 steps" in out[2]
    w = NoSignalWatch(3)
    assert [w.update(r) for r in (flat, {ALL_ZERO_VARIANCE: 0}, flat, flat, flat)] == [None] * 5  # not leading
    w = NoSignalWatch(3)  # a run shorter than K: checked over all its steps, at its last one
    assert w.update(flat) is None and "for 2 steps" in w.update(flat, last=True)
    assert NoSignalWatch(0).update(flat, last=True) is None
    with pytest.raises(ValueError, match="no_signal_steps must be >= 0"):
        NoSignalWatch(-1)
    assert summary_line([flat, {ALL_ZERO_VARIANCE: 0}, flat]).startswith("no learning signal on 2 of 3 steps")
    assert summary_line([{ALL_ZERO_VARIANCE: 0}]) is None


def test_bad_no_signal_steps_is_a_config_error():
    from echotrain.train.config import ConfigError, resolve_config

    with pytest.raises(ConfigError, match="no_signal_steps=-1: must be >= 0"):
        resolve_config(overrides={"no_signal_steps": -1})


@pytest.fixture
def zero_reward(tmp_path, monkeypatch):
    """A reward module in the working directory whose reward is always 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "always_zero_reward.py").write_text("def zero(completion, example):\n    return 0.0\n")
    return "always_zero_reward:zero"


@pytest.fixture
def testbed_model_check(monkeypatch):
    """Let ``model=testbed`` through the model preflight (the cached testbed is loadable offline)
    whether or not this checkout's preflight knows the name."""
    from echotrain.runtime import preflight

    original = preflight.check_model
    monkeypatch.setattr(preflight, "check_model", lambda name, key="model": None if name == "testbed"
                        else original(name, key))


def test_cli_warns_once_when_no_group_has_signal(tmp_path, zero_reward, testbed_model_check, capsys):
    from echotrain.cli import main

    run = tmp_path / "run"
    rc = main(["train", "model=testbed", "task=testbed", f"reward={zero_reward}", "steps=3", "no_signal_steps=2",
               "prompts_per_step=2", "num_generations=2", "num_mini_batches=1", "micro_batch_size=4",
               "max_new_tokens=4", "eval_prompts=0", "num_threads=1", "plots=false", "save_final_model=false",
               f"output_dir={run}"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r[ALL_ZERO_VARIANCE] for r in records] == [1, 1, 1]
    assert err.count("no learning signal: every group scored alike for 2 steps") == 1, err
    assert "Look at samples.jsonl" in err
    assert "no learning signal on 3 of 3 steps" in err  # the closing summary's count
    # the startup line says why autocast is off (the suite pins ECHOTRAIN_NATIVE_BF16=0); run_info too
    reason = "autocast=auto and ECHOTRAIN_NATIVE_BF16=0 says the hardware has no native bf16"
    assert f"no autocast, because {reason}" in err
    info = json.loads((run / "run_info.json").read_text())
    assert info["autocast"] == "off" and info["autocast_reason"] == reason
    # plots=false: neither line points to plots
    assert "plots/" not in err and not (run / "plots").exists()
    assert "(metrics.jsonl: one line per step; plots=false)" in err


def test_cli_stays_quiet_when_groups_vary(tmp_path, testbed_model_check, monkeypatch, capsys):
    from echotrain.cli import main
    from echotrain.train.trainer import Trainer

    drawn = []  # plots=true (the default): the lines name plots/; the drawing itself is not under test here
    monkeypatch.setattr(Trainer, "write_plots", lambda self, records=None: drawn.append(self.run_dir) or [])
    run = tmp_path / "run"
    # the testbed policy solves ~30% of its prompts: with 8 rollouts a group is mixed almost always
    rc = main(["train", "model=testbed", "task=testbed", "steps=1", "no_signal_steps=1", "prompts_per_step=4",
               "num_generations=8", "num_mini_batches=1", "micro_batch_size=32", "max_new_tokens=6",
               "eval_prompts=0", "num_threads=1", "save_final_model=false", f"output_dir={run}"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0, err
    assert json.loads((run / "metrics.jsonl").read_text())[ALL_ZERO_VARIANCE] == 0
    assert "no learning signal" not in err
    assert "samples.jsonl, plots/, checkpoints/" in err and "plots/summary.png: the run at a glance" in err
    assert drawn == [run]


def test_readme_quotes_the_warning_and_the_default_exactly():
    from pathlib import Path

    from echotrain.train.config import TrainConfig
    from echotrain.train.no_signal import warning_text

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    quoted = "warning: no learning signal: every group scored alike for 3 steps"
    assert quoted in readme and quoted in warning_text(3)
    assert "`no_signal_steps`, default 3" in readme and TrainConfig().no_signal_steps == 3
    assert f"`{ALL_ZERO_VARIANCE}`" in readme
