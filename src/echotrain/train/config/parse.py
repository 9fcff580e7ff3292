"""Resolving a run's configuration from its layers, each overriding the one before:

    TrainConfig defaults  ->  preset (``preset=echo``)  ->  YAML file (``--config``)  ->  ``key=value``

The preset layer comes from :data:`echotrain.rl.PRESETS` (the objective each paper uses); any
preset accepts ``loss_agg_mode=balanced`` (Balanced Aggregation) on top, or the shorthand
``preset=<name>+balanced``. :func:`resolve_config` returns a validated :class:`TrainConfig` or
raises :class:`ConfigError` naming the key and the valid choices, before any model is loaded.

Here: ``key=value`` tokens and YAML files to raw values, unknown keys refused with "did you mean"
hints, the layers merged, each value converted to its field's annotated type
(:mod:`~echotrain.train.config.coerce`), then :func:`~echotrain.train.config.validate.validate`;
and :func:`save_config`, the resolved config written back as YAML.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from echotrain.errors import ConfigError
from echotrain.train.config.coerce import coerce
from echotrain.train.config.schema import BALANCED_SUFFIX, FIELDS, TrainConfig
from echotrain.train.config.validate import preset_names, unknown_value_msg, validate


def preset_values(name: str) -> dict[str, Any]:
    """TrainConfig values set by preset ``name`` (``<preset>`` or ``<preset>+balanced``).

    Raises:
        ConfigError: unknown preset (lists the valid names).
    """
    from echotrain.rl import PRESETS, get_preset
    from echotrain.rl.config import flat_values

    base, balanced = (name[: -len(BALANCED_SUFFIX)], True) if name.endswith(BALANCED_SUFFIX) else (name, False)
    if base not in PRESETS:
        raise ConfigError(unknown_value_msg("preset", name, preset_names()))
    preset = get_preset(base)
    raw = {f.name: getattr(preset, f.name) for f in fields(preset) if f.name in FIELDS}
    raw.update(flat_values(preset.config))
    raw["overlong_buffer_len"] = -1 if preset.overlong_shaping else 0
    raw["overlong_filtering"] = bool(preset.overlong_shaping)
    if balanced:
        raw["loss_agg_mode"] = "balanced"
    return raw


def _check_keys(values: dict[str, Any], where: str) -> None:
    for key in values:
        if key not in FIELDS:
            raise ConfigError(f"unknown key {key!r} in {where}" + _suggest(key))


# Names other frameworks use (TRL, verl) -> our key, for "did you mean" hints only.
_OTHER_NAMES = {"learning_rate": "lr", "beta": "kl_coef", "kl_beta": "kl_coef", "kl_loss_coef": "kl_coef",
                "epsilon": "clip_ratio_low", "epsilon_high": "clip_ratio_high", "num_iterations": "ppo_epochs",
                "max_completion_length": "max_new_tokens", "max_response_length": "max_new_tokens",
                "model_name_or_path": "model", "max_steps": "steps", "total_training_steps": "steps",
                "adv_method": "adv_estimator", "loss_type": "loss_agg_mode", "max_grad_clip": "max_grad_norm"}


def _suggest(key: str) -> str:
    """' (did you mean ...)' from our keys and the TRL/verl names in :data:`_OTHER_NAMES`, both by
    edit distance (``lerning_rate`` -> ``lr`` through ``learning_rate``); else the valid keys."""
    close: list[str] = []
    for alias in difflib.get_close_matches(key, list(_OTHER_NAMES), n=2, cutoff=0.8):
        close.append(_OTHER_NAMES[alias])
    close += difflib.get_close_matches(key, list(FIELDS), n=3, cutoff=0.6)
    close = list(dict.fromkeys(close))[:3]
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else f"; valid keys: {', '.join(FIELDS)}"


#: The mapping keys set one entry at a time with ``KEY.NAME=VALUE`` (merged over the layers).
NESTED_KEYS = ("task_options", "loss_options", "env_options")


def parse_overrides(tokens: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` tokens (``task_options.KEY=VALUE`` nests into ``task_options``, and
    likewise for every key of :data:`NESTED_KEYS`).

    Values are parsed as YAML scalars later, against the field's type; ``*_options`` values as YAML.

    Raises:
        ConfigError: a token without '=' or an unknown key (naming close matches).
    """
    out: dict[str, Any] = {}
    for tok in tokens:
        if "=" not in tok:
            raise ConfigError(f"expected key=value, got {tok!r}" + ("" if tok.startswith("-") else _suggest(tok)))
        key, _, value = tok.partition("=")
        key = key.strip().replace("-", "_")
        if key.startswith(tuple(k + "." for k in NESTED_KEYS)):
            try:
                out.setdefault(key.split(".", 1)[0], {})[key.split(".", 1)[1]] = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ConfigError(f"{key}={value!r}: not a valid YAML value (quote strings with ':' or '#')") from None
            continue
        if key not in FIELDS:
            raise ConfigError(f"unknown key {key!r}" + _suggest(key))
        out[key] = value
    return out


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config file (a flat mapping of TrainConfig keys).

    Raises:
        ConfigError: the file is missing, not a mapping, or has unknown keys.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(path)!r}: " + ("is a folder, not a YAML file" if p.is_dir() else "file not found"))
    data = _safe_load_file(p, "--config")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {str(path)!r}: expected a mapping of keys to values")
    _check_keys(data, str(path))
    return data


def _safe_load_file(p: Path, what: str) -> Any:
    """``yaml.safe_load`` of file ``p``; a syntax error becomes a ConfigError with its 1-based line."""
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{what} {str(p)!r}: malformed YAML at {where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {str(p)!r}: cannot read it ({exc})") from None


def resolve_config(yaml_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                   base: dict[str, Any] | None = None) -> TrainConfig:
    """Build and validate a config: defaults -> ``base`` -> preset -> YAML -> overrides.

    ``base`` (e.g. a resumed run's saved config) replaces the defaults, and then its preset is not
    re-applied unless ``preset`` is overridden.

    Raises:
        ConfigError: unknown key, value of the wrong type, or invalid value (see :func:`validate`).
    """
    yaml_values, overrides = dict(yaml_values or {}), dict(overrides or {})
    _check_keys(yaml_values, "config file")
    _check_keys(overrides, "command line")
    values: dict[str, Any] = {}
    if base is not None:
        _check_keys(base, "saved config")
        values.update(base)
    preset = overrides.get("preset", yaml_values.get("preset", values.get("preset", FIELDS["preset"].default)))
    preset = coerce("preset", preset)
    if base is None or "preset" in overrides or "preset" in yaml_values:
        values.update(preset_values(preset))
    values["preset"] = preset
    for layer in (yaml_values, overrides):
        for key, value in layer.items():
            if key in NESTED_KEYS and isinstance(value, dict):
                merged = dict(values.get(key) or {})
                merged.update(value)
                values[key] = merged
            else:
                values[key] = value
    from echotrain.plugins import PluginError, load_plugins

    try:  # before the values are checked: a plugin's loss, task or optimizer name is valid then
        load_plugins(coerce("plugins", values.get("plugins", [])))
    except PluginError as exc:
        raise ConfigError(str(exc)) from None
    cfg = TrainConfig(**{k: coerce(k, v) for k, v in values.items()})
    validate(cfg)
    return cfg


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically: temp file + rename)."""
    from echotrain.atomic import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))

