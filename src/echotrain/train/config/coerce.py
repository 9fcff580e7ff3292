"""Typed values of :class:`~echotrain.train.config.schema.TrainConfig` keys from strings and YAML values.

A key's type is its field's annotation, read once at import with ``typing.get_type_hints`` and
taken apart with ``typing.get_origin`` / ``get_args``; each supported annotation maps to one
converter (:func:`coercer`):

    bool                 true/false, yes/no, on/off, 1/0 (any case), a bool, or the ints 0 and 1
    int                  an int, an integral float (2.0), or a string ``int(s, 0)`` reads ("8", "0x10");
                         never a bool or "1.5"
    float                an int, a float or a string ``float(s)`` reads ("1e-5", "inf"); never a bool
    str                  any value but None, as ``str(value)``
    list, list[X]        a YAML flow list string ("[a, b]"), a list or tuple, a single non-list value
                         (one element), "" or None (empty); with ``X`` each element converted as X
    dict, dict[K, V]     a YAML mapping string ("{a: 1}") or a mapping; "" is empty; with ``K``/``V``
                         each key/value converted
    Literal[a, b, ...]   a value equal to one of them after conversion to that value's type
    X | None             "", "none", "null" (any case) and None are None, all else as X
    Any                  the value unchanged

An annotation outside this list (``tuple``, ``set``, ``int | str``, a class) raises ``TypeError``
naming the field when the table is built, i.e. when this module is imported, so a new field with an
unsupported type fails every test at once rather than one run later.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Literal, Union

import yaml

from echotrain.errors import ConfigError
from echotrain.train.config.schema import TrainConfig

#: A converter: the raw value -> the typed value; raises ValueError or TypeError when it does not fit.
Coercer = Callable[[Any], Any]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null")
_SUPPORTED = "bool, int, float, str, list[X], dict[K, V], Literal[...], X | None, Any"


class _Unfit(ValueError):
    """A value that does not convert; ``value`` is what the message shows (a container's parsed
    YAML, e.g. ``plugins=1`` for the string "1")."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE:
        return True
    if isinstance(value, str) and value.lower() in _FALSE:
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _Unfit(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Unfit(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise _Unfit(value)
        return int(value)
    return int(str(value), 0) if isinstance(value, str) else int(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Unfit(value)
    return float(value)


def _to_str(value: Any) -> str:
    if value is None:
        raise _Unfit(value)
    return str(value)


def _identity(value: Any) -> Any:
    return value


def _list_of(item: Coercer | None) -> Coercer:
    def to_list(value: Any) -> list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip() else []
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _Unfit(value)
        if item is None:
            return list(value)
        try:
            return [item(v) for v in value]
        except (TypeError, ValueError, yaml.YAMLError):
            raise _Unfit(value) from None

    return to_list


def _dict_of(key: Coercer | None, val: Coercer | None) -> Coercer:
    def to_dict(value: Any) -> dict:
        if isinstance(value, str):
            value = yaml.safe_load(value) or {}
        if not isinstance(value, dict):
            raise _Unfit(value)
        if key is None and val is None:
            return dict(value)
        try:
            return {(key or _identity)(k): (val or _identity)(v) for k, v in value.items()}
        except (TypeError, ValueError, yaml.YAMLError):
            raise _Unfit(value) from None

    return to_dict


def _literal_of(options: tuple) -> Coercer:
    converters = [(opt, coercer(type(opt))) for opt in options]

    def to_literal(value: Any) -> Any:
        for opt, conv in converters:
            try:
                if conv(value) == opt:
                    return opt
            except (TypeError, ValueError, yaml.YAMLError):
                pass
        raise _Unfit(value)

    return to_literal


def _optional(inner: Coercer) -> Coercer:
    def to_optional(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.lower() in _NONE):
            return None
        return inner(value)

    return to_optional


def _element(annotation: Any) -> Coercer | None:
    """The converter of a container's element type; None for ``Any`` (elements kept as they are)."""
    return None if annotation is Any else coercer(annotation)


def coercer(annotation: Any) -> Coercer:
    """The converter for a field annotated ``annotation`` (an evaluated type, not a string).

    Raises:
        TypeError: an annotation this module has no converter for (the message lists the supported ones).
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            return _optional(coercer(inner[0]))
    elif origin is Literal:
        return _literal_of(args)
    elif annotation is list or origin is list:
        return _list_of(_element(args[0]) if args else None)
    elif annotation is dict or origin is dict:
        return _dict_of(_element(args[0]), _element(args[1])) if args else _dict_of(None, None)
    elif annotation is Any:
        return _identity
    else:
        simple = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}.get(annotation)
        if simple is not None:
            return simple
    raise TypeError(f"no conversion from strings for the annotation {annotation!r}; supported: {_SUPPORTED}")


def type_name(annotation: Any) -> str:
    """How an error message names the type: ``int`` for ``int | None``, ``list`` for ``list[str]``,
    ``choice of 'a', 'b'`` for ``Literal['a', 'b']``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union or origin is types.UnionType:
        return type_name(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return "choice of " + ", ".join(repr(a) for a in args)
    return getattr(origin or annotation, "__name__", str(annotation))


def field_coercers(cls: type) -> dict[str, tuple[Coercer, str]]:
    """Field name -> (its converter, its type's name) for every field of the dataclass ``cls``,
    from its evaluated annotations (``typing.get_type_hints``).

    Raises:
        TypeError: a field whose annotation has no converter, naming ``cls.field``.
    """
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        try:
            out[f.name] = (coercer(hints[f.name]), type_name(hints[f.name]))
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{f.name}: {exc}") from None
    return out


#: Every :class:`TrainConfig` key -> (converter, type name), built from the annotations at import.
COERCERS: dict[str, tuple[Coercer, str]] = field_coercers(TrainConfig)


def coerce(key: str, value: Any) -> Any:
    """``value`` (a string from the command line or a YAML value) as the annotated type of key ``key``.

    Raises:
        ConfigError: ``"<key>=<value> is not a valid <type>"`` when it does not convert (a list or
            mapping shown as parsed from YAML).
        KeyError: ``key`` is not a TrainConfig field (callers check the keys first).
    """
    convert, name = COERCERS[key]
    try:
        return convert(value)
    except (TypeError, ValueError, yaml.YAMLError) as exc:
        shown = exc.value if isinstance(exc, _Unfit) else value
        raise ConfigError(f"{key}={shown!r} is not a valid {name}") from None
