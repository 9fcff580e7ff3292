"""Every loss setting is declared once, with default, help, choices and check: the shared ones as
PolicyLossConfig fields, a loss's own in its registration (LOSS_SETTINGS)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from echotrain.rl import PolicyLossConfig
from echotrain.rl.config import LOSS_SETTINGS, POLICY_LOSS_FIELDS, check_loss_option, check_setting, with_policy_loss_fields


def test_every_setting_carries_help_and_a_check_or_choices():
    for f in dataclasses.fields(PolicyLossConfig):
        assert f.metadata["help"], f.name
        assert f.metadata.get("check") or f.metadata.get("choices"), f.name
    for name in LOSS_SETTINGS:  # the settings the built-in losses declare in their registrations
        s = LOSS_SETTINGS[name]
        assert s.help and (s.check or s.choices), name


@pytest.mark.parametrize("name, value, message", [
    ("clip_ratio_low", 1.0, "clip_ratio_low must be < 1 (ratio floor 1 - eps_low > 0), got 1.0"),
    ("clip_ratio_high", -0.1, "clip_ratio_high must be a finite float >= 0, got -0.1"),
    ("batch_clip_low", True, "batch_clip_low must be a finite float >= 0, got True"),
    ("norm_constant", 0.0, "norm_constant must be > 0 (or none: the max response length), got 0.0"),
    ("ba_scope", "global", "ba_scope='global' is unknown; valid: ['batch', 'group']"),
])
def test_check_setting_names_the_field_and_the_value(name, value, message):
    def check(v):  # a field's check, or that of a setting a loss declared (batch_clip_low: ECHO's)
        return check_setting(POLICY_LOSS_FIELDS[name], v) if name in POLICY_LOSS_FIELDS else check_loss_option(name, v)

    with pytest.raises(ValueError) as exc:
        check(value)
    assert str(exc.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        PolicyLossConfig(**{name: value})
    check(getattr(PolicyLossConfig(), name))  # the default passes


def test_with_policy_loss_fields_inserts_every_field_after_the_named_one():
    @dataclasses.dataclass
    @with_policy_loss_fields(after="a", exclude=("log_ratio_clamp",), keep=("help",), tag=1)
    class Toy:
        a: int = 1
        z: int = 2

    from echotrain.rl.config import LOSS_SETTINGS, flat_loss_settings

    names = [f.name for f in dataclasses.fields(Toy)]
    loss = [n for n in POLICY_LOSS_FIELDS if n != "log_ratio_clamp"]
    flat = list(flat_loss_settings())  # the built-in losses' flat settings, right after loss_options
    at = loss.index("loss_options") + 1
    assert names == ["a", *loss[:at], *flat, *loss[at:], "z"]
    assert Toy.policy_loss_keys == tuple(names[1:-1])
    toy = Toy()
    for n in loss + flat:
        f = {f.name: f for f in dataclasses.fields(Toy)}[n]
        assert getattr(toy, n) == getattr(PolicyLossConfig(), n)
        help = POLICY_LOSS_FIELDS[n].metadata["help"] if n in POLICY_LOSS_FIELDS else LOSS_SETTINGS[n].help
        assert dict(f.metadata) == {"help": help, "tag": 1}


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


def test_a_built_in_losss_settings_live_in_its_registration_and_keep_their_flat_names():
    """tau_pos (sapo), ppo_kl_coef (kl_cov), cispo_lower_clip (cispo), ...: declared by the loss's
    registration (LOSS_SETTINGS, owner loss_mode), not PolicyLossConfig fields; the flat name still
    works as a keyword, a dict key and an attribute, and equals loss_options.NAME."""
    from echotrain.rl.config import LOSS_SETTINGS, as_policy_loss_config, flat_loss_settings, flat_values

    owners = {"tau_pos": "sapo", "tau_neg": "sapo", "cispo_lower_clip": "cispo", "clip_cov_ratio": "clip_cov",
              "clip_cov_lb": "clip_cov", "clip_cov_ub": "clip_cov", "kl_cov_ratio": "kl_cov", "ppo_kl_coef": "kl_cov",
              "dro_beta": "dro", "vespo_k_pos": "vespo", "vespo_lambda_pos": "vespo", "vespo_k_neg": "vespo",
              "vespo_lambda_neg": "vespo", "batch_clip_low": "echo", "batch_clip_high": "echo", "batch_ratio": "echo",
              "detach_kappa": "echo", "echo_pessimistic": "echo", "echo_token_clip": "echo", "echo_token_cap": "echo"}
    for name, loss_mode in owners.items():
        assert name not in POLICY_LOSS_FIELDS and name in flat_loss_settings()
        assert LOSS_SETTINGS.info(name)["loss_mode"] == loss_mode
    a = PolicyLossConfig(tau_pos=1.3, ppo_kl_coef=0.4)
    assert a == PolicyLossConfig(loss_options={"tau_pos": 1.3, "ppo_kl_coef": 0.4}) == as_policy_loss_config(
        {"tau_pos": 1.3, "ppo_kl_coef": 0.4})
    assert (a.tau_pos, a.ppo_kl_coef, a.tau_neg) == (1.3, 0.4, 1.05)
    assert PolicyLossConfig(tau_pos=1.0) == PolicyLossConfig() and hash(PolicyLossConfig(tau_pos=1.0)) == hash(
        PolicyLossConfig())  # an explicit default is no setting
    assert dataclasses.replace(a, tau_pos=2.0).tau_pos == 2.0  # the flat keyword wins over loss_options
    assert flat_values(a)["tau_pos"] == 1.3 and flat_values(a)["loss_options"] == {}
    with pytest.raises(ValueError, match="tau_pos must be a finite float > 0"):
        PolicyLossConfig(tau_pos=0.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tau_posx'"):
        PolicyLossConfig(tau_posx=1.0)
    with pytest.raises(ValueError, match=r"echo_token_clip='clip' is unknown; valid: \['none', 'ppo', 'truncate'\]"):
        PolicyLossConfig(echo_token_clip="clip")
    # the shared settings stay PolicyLossConfig fields
    assert {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "ba_scope", "ba_count_zero_adv", "norm_constant",
            "log_ratio_clamp", "loss_options", "rollout_correction"} <= set(POLICY_LOSS_FIELDS)
    assert not set(owners) & set(POLICY_LOSS_FIELDS)


def test_flat_loss_settings_are_trainer_keys_and_loss_options_of_them_is_refused():
    from echotrain.errors import ConfigError
    from echotrain.train.config import parse_overrides, resolve_config

    cfg = resolve_config(overrides=parse_overrides(["loss_mode=sapo", "tau_pos=1.3", "ppo_kl_coef=0.4"]))
    assert (cfg.tau_pos, cfg.policy_loss_config().tau_pos, cfg.policy_loss_config().ppo_kl_coef) == (1.3, 1.3, 0.4)
    assert cfg.to_dict()["tau_pos"] == 1.3 and resolve_config(cfg.to_dict()) == cfg  # config.yaml round trip
    with pytest.raises(ConfigError, match="loss_options.tau_pos: tau_pos is a trainer key of its own; set tau_pos=1.3"):
        resolve_config(overrides=parse_overrides(["loss_mode=sapo", "loss_options.tau_pos=1.3"]))
    with pytest.raises(ConfigError, match="tau_neg=0.0: must be a finite float > 0"):
        resolve_config(overrides=parse_overrides(["tau_neg=0"]))


def test_clip_cov_band_rule_is_registered_with_the_loss_and_checked_with_every_config():
    """clip_cov_lb < clip_cov_ub: Clip-Cov's rule (settings_check= in its registration), checked by
    PolicyLossConfig and the trainer's validation alike, naming both keys; gone with the loss."""
    from echotrain.rl.config import SETTINGS_CHECKS
    from echotrain.errors import ConfigError
    from echotrain.train.config import parse_overrides, resolve_config

    assert "clip_cov" in SETTINGS_CHECKS
    with pytest.raises(ValueError, match=r"clip_cov_lb=2.0 must be < clip_cov_ub=2.0"):
        PolicyLossConfig(clip_cov_lb=2.0, clip_cov_ub=2.0)
    with pytest.raises(ConfigError, match=r"clip_cov_lb=6.0 must be < clip_cov_ub=5.0"):
        resolve_config(overrides=parse_overrides(["clip_cov_lb=6"]))
    assert PolicyLossConfig(clip_cov_lb=-1.0, clip_cov_ub=0.5).clip_cov_ub == 0.5


def test_a_plugins_settings_check_is_run_and_removed_with_it():
    import torch

    from echotrain.rl import register_policy_loss, unregister_policy_loss
    from echotrain.rl.config import SETTINGS_CHECKS, loss_setting

    @register_policy_loss("_two_bounds", settings={"t_lo": loss_setting(0.0, "lower", lambda v: None),
                                                   "t_hi": loss_setting(1.0, "upper", lambda v: None)},
                          settings_check=lambda c: None if c.t_lo < c.t_hi else "t_lo must be < t_hi")
    def _two_bounds(old_log_prob, log_prob, *args, **kwargs):
        return torch.zeros(()), {}

    try:
        with pytest.raises(ValueError, match="t_lo must be < t_hi"):
            PolicyLossConfig(loss_options={"t_lo": 2.0})
        assert PolicyLossConfig(loss_options={"t_lo": 0.5}).t_lo == 0.5
    finally:
        unregister_policy_loss("_two_bounds")
    assert "_two_bounds" not in SETTINGS_CHECKS
