"""Plugins: user modules that register losses, tasks, metrics, optimizers ... without editing echotrain.

Two routes, both imported before a configuration is validated (``echotrain train``, ``eval``
and ``compare``), so that a plugin's names are valid values of ``loss_mode=``, ``task=``,
``optimizer=``:

- the ``plugins`` trainer key: ``plugins=[my_losses,./extra/my_task.py]`` (a YAML list in
  ``--config``; ``echotrain eval --plugins``): each entry is an importable module name
  (the current directory is searched first, as for ``reward=``) or the path of a ``.py`` file;
- the ``echotrain.plugins`` entry-point group of installed packages (``pyproject.toml``:
  ``[project.entry-points."echotrain.plugins"] mine = "my_pkg.echotrain_plugin"``): every
  entry is imported once per process; an entry naming a callable (``"my_pkg:register"``) is
  called with no arguments after its import.

A plugin module registers with the public decorators (``echotrain.rl.register_policy_loss``,
``echotrain.tasks.register_task``, ``echotrain.optim.register_optimizer``,
``echotrain.metrics.declare_metric`` ...). Importing is idempotent: a module or file already
loaded is not executed again. This module imports nothing from echotrain.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

#: the entry-point group installed packages declare their plugin modules under
ENTRY_POINT_GROUP = "echotrain.plugins"

_FILES: dict[Path, ModuleType] = {}
_ENTRY_POINTS_LOADED = False


class PluginError(ImportError):
    """A plugin could not be imported; the message names it and the cause."""


def is_path(spec: str) -> bool:
    """Whether a ``plugins`` entry is a file path (ends in ``.py`` or has a path separator)."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def parse_plugins(value: Any) -> list[str]:
    """The ``plugins`` value as a list of entries: a list/tuple of strings, or a string holding
    ``[a, b]`` or ``a,b`` (the command line); None/empty -> [].

    Raises:
        PluginError: an entry that is not a non-empty string.
    """
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        value = [v.strip().strip("'\"") for v in text.split(",")]
        value = [v for v in value if v]
    if not isinstance(value, (list, tuple)):
        raise PluginError(f"plugins must be a list of module names or .py paths, got {value!r}")
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise PluginError(f"plugins: each entry must be a module name or a .py path, got {v!r}")
    return [v.strip() for v in value]


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin: a module name or a ``.py`` file path (relative to the current directory).

    Raises:
        PluginError: the file does not exist, the module cannot be found, or its import raised
            (the message names the plugin and the error).
    """
    if is_path(spec):
        path = Path(spec).expanduser().resolve()
        if path in _FILES:
            return _FILES[path]
        for module in list(sys.modules.values()):  # imported by its module name already
            if _origin(module) == path:
                _FILES[path] = module
                return module
        if not path.is_file():
            raise PluginError(f"plugins: {spec!r}: no such file")
        name = f"echotrain_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise PluginError(f"plugins: {spec!r}: not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise PluginError(f"plugins: importing {spec!r} failed: {type(exc).__name__}: {exc}") from exc
        _FILES[path] = module
        return module
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        found = spec in sys.modules or importlib.util.find_spec(spec)
        origin = Path(found.origin).resolve() if getattr(found, "origin", None) else None
        if origin is not None and origin in _FILES:  # loaded from its path already
            sys.modules[spec] = _FILES[origin]
            return _FILES[origin]
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name == spec or spec.startswith(f"{exc.name}."):
            raise PluginError(f"plugins: no module named {spec!r} (not importable from {cwd} or sys.path; "
                              "give a .py path or install the package)") from None
        raise PluginError(f"plugins: importing {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise PluginError(f"plugins: importing {spec!r} failed: {type(exc).__name__}: {exc}") from exc


def _origin(module: ModuleType) -> Path | None:
    f = getattr(module, "__file__", None)
    try:
        return Path(f).resolve() if f else None
    except (OSError, ValueError):
        return None


def load_entry_points() -> list[str]:
    """Import every ``echotrain.plugins`` entry point of the installed packages (once per process);
    returns their names.

    Raises:
        PluginError: an entry point whose import (or call) raised.
    """
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return []
    _ENTRY_POINTS_LOADED = True
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, ModuleType):
                obj()
        except Exception as exc:
            raise PluginError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        names.append(ep.name)
    return names


def load_plugins(plugins: Iterable[str] | str | None = (), *, entry_points: bool = True) -> list[ModuleType]:
    """Load the installed entry points (with ``entry_points``, once per process) and then each
    entry of ``plugins`` (see :func:`parse_plugins`), in order; returns the modules.

    Raises:
        PluginError: see :func:`load_plugin` and :func:`load_entry_points`.
    """
    if entry_points:
        load_entry_points()
    return [load_plugin(spec) for spec in parse_plugins(plugins)]
