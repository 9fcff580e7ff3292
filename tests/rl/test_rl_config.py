"""PolicyLossConfig is the one declaration of every loss setting: default, help, choices, check."""

from __future__ import annotations

import dataclasses
import re

import pytest

from echotrain.rl import PolicyLossConfig
from echotrain.rl.config import POLICY_LOSS_FIELDS, check_setting, with_policy_loss_fields


def test_every_setting_carries_help_and_a_check_or_choices():
    for f in dataclasses.fields(PolicyLossConfig):
        assert f.metadata["help"], f.name
        assert f.metadata.get("check") or f.metadata.get("choices"), f.name


@pytest.mark.parametrize("name, value, message", [
    ("clip_ratio_low", 1.0, "clip_ratio_low must be < 1 (ratio floor 1 - eps_low > 0), got 1.0"),
    ("clip_ratio_high", -0.1, "clip_ratio_high must be a finite float >= 0, got -0.1"),
    ("batch_clip_low", True, "batch_clip_low must be a finite float >= 0, got True"),
    ("norm_constant", 0.0, "norm_constant must be > 0 (or none: the max response length), got 0.0"),
    ("ba_scope", "global", "ba_scope='global' is unknown; valid: ['batch', 'group']"),
])
def test_check_setting_names_the_field_and_the_value(name, value, message):
    with pytest.raises(ValueError) as exc:
        check_setting(POLICY_LOSS_FIELDS[name], value)
    assert str(exc.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        PolicyLossConfig(**{name: value})
    check_setting(POLICY_LOSS_FIELDS[name], getattr(PolicyLossConfig(), name))  # the default passes


def test_with_policy_loss_fields_inserts_every_field_after_the_named_one():
    @dataclasses.dataclass
    @with_policy_loss_fields(after="a", exclude=("log_ratio_clamp",), keep=("help",), tag=1)
    class Toy:
        a: int = 1
        z: int = 2

    names = [f.name for f in dataclasses.fields(Toy)]
    loss = [n for n in POLICY_LOSS_FIELDS if n != "log_ratio_clamp"]
    assert names == ["a", *loss, "z"]
    toy = Toy()
    for n in loss:
        f = {f.name: f for f in dataclasses.fields(Toy)}[n]
        assert getattr(toy, n) == getattr(PolicyLossConfig(), n)
        assert dict(f.metadata) == {"help": POLICY_LOSS_FIELDS[n].metadata["help"], "tag": 1}


def test_with_policy_loss_fields_refuses_a_restated_setting_or_a_missing_anchor():
    with pytest.raises(ValueError, match=r"restates PolicyLossConfig field\(s\) \['clip_ratio_high'\]"):
        @with_policy_loss_fields()
        class Restated:
            clip_ratio_high: float = 0.28
    with pytest.raises(ValueError, match="has no field 'nope'"):
        @with_policy_loss_fields(after="nope")
        class NoAnchor:
            a: int = 1


def test_policy_loss_config_is_hashable_and_equal_configs_hash_equally():
    from echotrain.rl.config import LOSS_SETTINGS, PolicyLossConfig, loss_setting

    with LOSS_SETTINGS.restoring():
        LOSS_SETTINGS.register("t_scale")(loss_setting(1.0, "a test setting"))
        LOSS_SETTINGS.register("t_list")(loss_setting([1], "a list-valued test setting"))
        a = PolicyLossConfig(loss_options={"t_scale": 0.5, "t_list": [1, 2]})
        b = PolicyLossConfig(loss_options={"t_list": [1, 2], "t_scale": 0.5})  # other insertion order
        c = PolicyLossConfig(loss_options={"t_scale": 0.25})
        assert a == b and hash(a) == hash(b)
        assert len({a, b, c, PolicyLossConfig(), PolicyLossConfig()}) == 3
        assert hash(PolicyLossConfig(clip_ratio_high=0.28)) != hash(PolicyLossConfig())
