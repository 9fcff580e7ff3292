"""The trainer's configuration: one dataclass, every field documented, validated before any work.

A run's configuration is resolved in layers, each overriding the one before:

    TrainConfig defaults  ->  preset (``preset=echo``)  ->  YAML file (``--config``)  ->  ``key=value``

The preset layer comes from :data:`echotrain.rl.PRESETS` (the objective each paper uses); any
preset accepts ``loss_agg_mode=balanced`` (Balanced Aggregation) on top, or the shorthand
``preset=<name>+balanced``. :func:`resolve_config` returns a validated :class:`TrainConfig` or
raises :class:`ConfigError` naming the key and the valid choices, before any model is loaded.

One module per job, all re-exported here:

- :mod:`~echotrain.train.config.schema`    ``TrainConfig``: every key's default, help, choices, group
- :mod:`~echotrain.train.config.coerce`    strings / YAML values -> each key's annotated type
- :mod:`~echotrain.train.config.parse`     ``key=value`` tokens, YAML files, presets, the layers
                                           (``resolve_config``), ``save_config``
- :mod:`~echotrain.train.config.validate`  every check before any work (``validate``)
- :mod:`~echotrain.train.config.help`      ``echotrain train --help``'s option reference
- :mod:`~echotrain.train.config.preset_report`  what a config keeps of its preset: the progress
                                           line's label (``echo+loss_mode=gspo``), the startup note
"""

from echotrain.errors import ConfigError
from echotrain.train.config.schema import BALANCED_SUFFIX, FIELDS, TrainConfig
from echotrain.train.config.coerce import COERCERS, coerce
from echotrain.train.config.validate import preset_names, registry_choices, unknown_value_msg, validate
from echotrain.train.config.parse import load_yaml, parse_overrides, preset_values, resolve_config, save_config
from echotrain.train.config.help import format_help

__all__ = ["BALANCED_SUFFIX", "COERCERS", "FIELDS", "ConfigError", "TrainConfig", "coerce", "format_help", "load_yaml",
           "parse_overrides", "preset_names", "preset_values", "registry_choices", "resolve_config", "save_config",
           "unknown_value_msg", "validate"]
