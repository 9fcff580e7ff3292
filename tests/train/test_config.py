"""Config resolution, validation before any work, and the CLI's --help."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from echotrain import cli
from echotrain.rl import PRESETS
from echotrain.train.config import (
    ConfigError,
    TrainConfig,
    format_help,
    load_yaml,
    parse_overrides,
    preset_names,
    resolve_config,
)


def test_every_field_has_help_and_appears_in_help():
    text = format_help()
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f.name
        assert f"  {f.name}=" in text


def test_defaults_are_the_echo_preset():
    cfg = resolve_config()
    assert (cfg.preset, cfg.loss_mode, cfg.loss_agg_mode, cfg.adv_estimator) == ("echo", "echo", "token-mean", "grpo")
    assert cfg.num_mini_batches >= 2  # the default run is off-policy


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_and_balanced(name):
    p = PRESETS[name]
    cfg = resolve_config(overrides={"preset": name})
    assert (cfg.adv_estimator, cfg.loss_mode, cfg.loss_agg_mode) == (p.adv_estimator, p.loss_mode, p.loss_agg_mode)
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.kl_coef) == (p.config.clip_ratio_low,
                                                                      p.config.clip_ratio_high, p.kl_coef)
    assert cfg.dynamic_sampling == p.dynamic_sampling
    ba = resolve_config(overrides={"preset": name + "+balanced"})
    assert ba.loss_agg_mode == "balanced" and ba.loss_mode == p.loss_mode
    assert resolve_config(overrides={"preset": name, "loss_agg_mode": "balanced"}).loss_agg_mode == "balanced"


def test_precedence_preset_yaml_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"preset": "gspo", "clip_ratio_high": 0.001, "lr": 2e-6, "steps": 5}))
    cfg = resolve_config(load_yaml(path), parse_overrides(["steps=7", "task_options.size=20", "clip_ratio_c=3"]))
    assert cfg.loss_mode == "gspo" and cfg.clip_ratio_low == 3e-4  # from the preset
    assert cfg.clip_ratio_high == 0.001 and cfg.lr == 2e-6  # YAML over preset
    assert cfg.steps == 7 and cfg.task_options == {"size": 20} and cfg.clip_ratio_c == 3.0  # CLI over YAML


@pytest.mark.parametrize("tokens, needles", [
    (["lrr=1e-5"], ["'lrr'", "'lr'"]),
    (["loss_mode=ech"], ["loss_mode", "echo", "gspo", "vanilla"]),
    (["loss_agg_mode=tokenmean"], ["loss_agg_mode", "token-mean", "balanced"]),
    (["preset=gpro"], ["preset", "grpo", "echo+balanced"]),
    (["batch_ratio=mean"], ["batch_ratio", "geo", "arith"]),
    (["clip_ratio_c=1.0"], ["clip_ratio_c", "> 1"]),
    (["norm_constant=-2"], ["norm_constant=-2.0", "must be > 0"]),  # PolicyLossConfig's checks
    (["clip_ratio_low=1"], ["clip_ratio_low=1.0", "must be < 1"]),
    (["log_ratio_clamp=0"], ["log_ratio_clamp=0.0", "> 0"]),
    (["optimizer=adamx"], ["optimizer", "adamw"]),
    (["steps=1.5"], ["steps", "int"]),
    (["temperature=0"], ["temperature"]),
    (["num_mini_batches=9", "prompts_per_step=8"], ["num_mini_batches", "prompts_per_step"]),
    (["dynamic_sampling=maybe"], ["dynamic_sampling", "bool"]),
    (["steps"], ["key=value", "'steps'"]),
])
def test_bad_values_fail_naming_key_and_choices(tokens, needles):
    with pytest.raises(ConfigError) as exc:
        resolve_config(overrides=parse_overrides(tokens))
    for n in needles:
        assert n in str(exc.value), (n, str(exc.value))


def test_yaml_unknown_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lerning_rate: 1\n")
    with pytest.raises(ConfigError, match="lerning_rate"):
        load_yaml(path)


def test_shipped_yaml_configs_resolve():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert files
    for f in files:
        resolve_config(load_yaml(f))


def test_cli_rejects_before_work(capsys):
    # must return quickly with status 2 and name the key: no model is loaded
    assert cli.main(["train", "learning_rate=1e-5"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate" in err and "did you mean" in err
    assert cli.main(["train", "preset=nope"]) == 2
    assert "valid:" in capsys.readouterr().err
    assert cli.main(["train", "task=no_such_task"]) == 2
    assert "no_such_task" in capsys.readouterr().err
    assert cli.main(["train", "--print-config", "preset=dapo", "steps=3"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["preset"] == "dapo" and out["steps"] == 3 and out["dynamic_sampling"] is True


def test_cli_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"{f.name}=" in out
    assert "--resume" in out and "--config" in out
    assert set(preset_names()) >= {"echo", "gspo+balanced"}


@pytest.mark.parametrize("tokens,needles", [
    (["echo_token_clip=clip"], ["echo_token_clip='clip'", "ppo", "none", "truncate"]),
    (["echo_token_cap=0.5"], ["echo_token_cap=0.5", ">= 1"]),
    (["echo_pessimistic=maybe"], ["echo_pessimistic", "bool"]),
])
def test_echo_flags_are_validated(tokens, needles):
    with pytest.raises(ConfigError) as exc:
        resolve_config(overrides=parse_overrides(["loss_mode=echo"] + tokens))
    for n in needles:
        assert n in str(exc.value), (n, str(exc.value))


def test_echo_flags_reach_the_policy_loss_config_and_the_preset_keeps_its_defaults():
    from echotrain.rl import PolicyLossConfig

    cfg = resolve_config(overrides=parse_overrides(["preset=echo"]))
    assert (cfg.echo_pessimistic, cfg.echo_token_clip, cfg.echo_token_cap) == (False, "ppo", 2.0)
    cfg = resolve_config(overrides=parse_overrides(
        ["preset=echo", "echo_pessimistic=true", "echo_token_clip=truncate", "echo_token_cap=1.5", "batch_ratio=arith"]))
    plc = cfg.policy_loss_config()
    assert isinstance(plc, PolicyLossConfig)
    assert (plc.echo_pessimistic, plc.echo_token_clip, plc.echo_token_cap, plc.batch_ratio) == (True, "truncate", 1.5,
                                                                                                 "arith")


def test_testbed_model_needs_the_testbed_task():
    with pytest.raises(ConfigError, match="model=testbed .* use task=testbed"):
        resolve_config(overrides=parse_overrides(["model=testbed"]))
    assert resolve_config(overrides=parse_overrides(["model=testbed", "task=testbed"])).task == "testbed"


def test_loss_settings_are_policy_loss_config_fields_declared_once():
    """Every PolicyLossConfig field is a TrainConfig key with the same type, default, help and
    choices (derived, not restated), in the objective group right after loss_agg_mode."""
    from echotrain.rl.config import POLICY_LOSS_FIELDS, flat_loss_settings

    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    names = list(train)
    at = names.index("loss_agg_mode") + 1
    flat = flat_loss_settings()
    assert names[at:at + len(POLICY_LOSS_FIELDS) + len(flat)] == list(TrainConfig.policy_loss_keys)
    assert set(TrainConfig.policy_loss_keys) == set(POLICY_LOSS_FIELDS) | set(flat)
    for name, f in POLICY_LOSS_FIELDS.items():
        t = train[name]
        assert (t.type, t.default, t.metadata["help"], t.metadata["choices"]) == (
            f.type, f.default, f.metadata["help"], f.metadata["choices"]), name
        assert t.metadata["group"] == "objective"
    for name, s in flat.items():  # the settings a built-in loss declares in its registration, flat keys
        t = train[name]
        assert (t.type, t.default, t.metadata["help"], t.metadata["choices"], t.metadata["check"]) == (
            s.type, s.default, s.help, s.choices, s.check), name
        assert t.metadata["group"] == "objective"


def test_norm_constant_unset_is_the_max_response_length_and_old_zero_still_loads():
    cfg = resolve_config(overrides=parse_overrides(["max_new_tokens=24"]))
    assert cfg.norm_constant is None and cfg.policy_loss_config().norm_constant == 24.0
    cfg = resolve_config(overrides=parse_overrides(["max_new_tokens=24", "norm_constant=16"]))
    assert cfg.policy_loss_config().norm_constant == 16.0
    # a saved config.yaml without a key added later (log_ratio_clamp) resumes with its default
    old = resolve_config(overrides=parse_overrides(["preset=dr_grpo", "max_new_tokens=24"])).to_dict()
    del old["log_ratio_clamp"]
    resumed = resolve_config(base=yaml.safe_load(yaml.safe_dump(old)))
    assert resumed.norm_constant is None and resumed.log_ratio_clamp == 20.0
    assert resumed.policy_loss_config().norm_constant == 24.0
    with pytest.raises(ConfigError, match="norm_constant"):  # unset is none (no 0 = max_new_tokens)
        resolve_config(overrides=parse_overrides(["norm_constant=0"]))
