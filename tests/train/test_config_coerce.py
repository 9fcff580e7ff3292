"""Each TrainConfig key's value converted from a string to its annotated type
(echotrain.train.config.coerce reads the annotations with typing.get_type_hints)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Literal, Optional

import pytest
import yaml

from echotrain.train.config import COERCERS, FIELDS, ConfigError, TrainConfig, coerce, resolve_config
from echotrain.train.config.coerce import coercer, field_coercers, type_name

HINTS = typing.get_type_hints(TrainConfig)


def _optional(annotation) -> bool:
    return type(None) in typing.get_args(annotation)


def _as_string(value) -> str:
    """The command-line spelling of a default value (what a user types after key=)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def test_every_field_has_a_converter_from_its_annotation():
    assert set(COERCERS) == set(FIELDS) and len(FIELDS) > 100
    assert COERCERS["steps"][1] == "int" and COERCERS["model"][1] == "str" and COERCERS["clip_ratio_c"][1] == "float"
    assert COERCERS["plugins"][1] == "list" and COERCERS["task_options"][1] == "dict"


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_every_field_is_coerced_from_a_string_to_its_annotated_type(key):
    default = TrainConfig().to_dict()[key]
    annotation = HINTS[key]
    base = next(a for a in typing.get_args(annotation) if a is not type(None)) if _optional(annotation) else annotation
    expected_type = typing.get_origin(base) or base
    sample = default if default is not None else {int: 3, float: 0.5, str: "x"}[base]
    got = coerce(key, _as_string(sample))
    assert type(got) is expected_type and got == sample, (key, sample, got)
    if _optional(annotation):
        for none in ("none", "null", "None", "", None):
            assert coerce(key, none) is None


def test_optional_fields_accept_none_and_null_and_others_do_not():
    assert coerce("model", "null") is None and coerce("clip_ratio_c", "None") is None
    assert coerce("clip_ratio_c", "3") == 3.0 and type(coerce("clip_ratio_c", "3")) is float
    with pytest.raises(ConfigError, match=r"^steps=None is not a valid int$"):
        coerce("steps", None)
    assert coerce("preset", "none") == "none"  # not optional: the string, refused later by validate


@pytest.mark.parametrize("text,expected", [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
                                           ("false", False), ("0", False), ("no", False), ("off", False),
                                           (1, True), (0, False), (True, True)])
def test_bool_from_strings_and_zero_one(text, expected):
    assert coerce("plots", text) is expected


@pytest.mark.parametrize("bad", ["2", "maybe", "", 2, 1.0, None])
def test_bool_refuses_anything_else(bad):
    with pytest.raises(ConfigError, match=rf"^plots={bad!r} is not a valid bool$".replace("(", r"\(")):
        coerce("plots", bad)


def test_int_refuses_fractions_and_bools_and_reads_bases():
    assert coerce("steps", "8") == 8 and coerce("steps", "0x10") == 16 and coerce("steps", 2.0) == 2
    for bad in ("1.5", 1.5, True, "eight", "[1]"):
        with pytest.raises(ConfigError, match=r"is not a valid int$"):
            coerce("steps", bad)
    with pytest.raises(ConfigError, match=r"^steps='1.5' is not a valid int$"):
        coerce("steps", "1.5")


def test_float_from_strings_not_bools():
    assert coerce("lr", "1e-5") == 1e-5 and type(coerce("lr", 3)) is float
    with pytest.raises(ConfigError, match=r"^lr=True is not a valid float$"):
        coerce("lr", True)


def test_list_from_a_yaml_flow_list_a_single_value_or_nothing():
    assert coerce("plugins", "[a, b]") == ["a", "b"]
    assert coerce("plugins", "a") == ["a"] and coerce("plugins", "") == [] and coerce("plugins", None) == []
    assert coerce("plugins", ("a",)) == ["a"]
    with pytest.raises(ConfigError, match=r"^plugins=1 is not a valid list$"):  # shown as parsed from YAML
        coerce("plugins", "1")
    with pytest.raises(ConfigError, match=r"^plugins='\[a' is not a valid list$"):
        coerce("plugins", "[a")


def test_dict_from_a_yaml_mapping():
    assert coerce("task_options", "{n: 3, name: x}") == {"n": 3, "name": "x"} and coerce("task_options", "") == {}
    with pytest.raises(ConfigError, match=r"^task_options=\[1\] is not a valid dict$"):
        coerce("task_options", "[1]")


def test_resolve_config_applies_the_annotated_types():
    cfg = resolve_config(overrides={"steps": "3", "lr": "2e-5", "plots": "0", "model": "none", "plugins": "[]",
                                    "clip_ratio_c": "3"})
    assert (cfg.steps, cfg.lr, cfg.plots, cfg.model, cfg.plugins, cfg.clip_ratio_c) == (3, 2e-5, False, None, [], 3.0)


# ---- the converter table itself, on annotations TrainConfig does not (yet) use -------------------------------

def test_parametrised_containers_convert_their_elements():
    assert coercer(list[int])("[1, '2', 3.0]") == [1, 2, 3]
    assert coercer(dict[str, float])("{a: 1, b: '2.5'}") == {"a": 1.0, "b": 2.5}
    assert coercer(dict[str, Any])("{a: [1]}") == {"a": [1]}
    assert coercer(Optional[list[str]])("null") is None
    with pytest.raises(ValueError):
        coercer(list[int])("[1, 1.5]")


def test_literal_accepts_its_values_only():
    conv = coercer(Literal["a", "b", 3])
    assert conv("a") == "a" and conv("3") == 3 and conv(3) == 3
    with pytest.raises(ValueError):
        conv("c")
    assert type_name(Literal["a", "b"]) == "choice of 'a', 'b'" and type_name(int | None) == "int"
    assert type_name(list[str]) == "list"


@pytest.mark.parametrize("annotation", [tuple, set, int | str, complex, dataclasses.Field])
def test_an_unsupported_annotation_is_refused_when_the_table_is_built(annotation):
    Odd = dataclasses.make_dataclass("Odd", [("fine", int, field(default=0)), ("odd", annotation, field(default=None))])
    with pytest.raises(TypeError, match=r"^Odd\.odd: no conversion from strings for the annotation .*; supported: bool"):
        field_coercers(Odd)
