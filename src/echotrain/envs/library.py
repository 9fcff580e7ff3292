"""Generic environments: ``tools`` (plain callables by import path, TRL's ``tools=``),
``python`` (the sandboxed Python tool) and ``feedback`` (a fixed reply after every turn).

``env=tools tools=[mypkg.tools:search,./my_tools.py:lookup]``: a
:class:`~echotrain.envs.base.ToolEnvironment` over the named callables (``module:function`` or
``file.py:function``, imported like ``reward=``). ``env=feedback env_options.message=...``: after each model
turn the environment answers ``message`` as a ``user`` turn, until ``max_turns`` (every turn is
trained; a multi-turn episode on any policy, used by the token-continuity tests).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from echotrain.envs.base import EnvReply, ToolEnvironment, register_env
from echotrain.envs.python_exec import python

__all__ = ["FeedbackEnv", "PythonEnv", "ToolsEnv", "load_callable", "load_callable_once"]


#: ``load_callable_once``'s callables by their spec (a ``.py`` file by its absolute path)
_ONCE: dict[str, Callable[..., Any]] = {}


def load_callable_once(spec: str) -> Callable[..., Any]:
    """:func:`load_callable` of ``spec``, imported once per process: later calls (one per
    episode) return the same object instead of executing a ``file.py`` again. The key is the
    spec with a ``.py`` path made absolute (two working directories' ``my_env.py`` differ).

    Raises:
        ValueError: as :func:`load_callable`.
    """
    mod, _, attr = spec.partition(":")
    key = f"{Path(mod).resolve()}:{attr}" if mod.endswith(".py") else spec
    if key not in _ONCE:
        _ONCE[key] = load_callable(spec)
    return _ONCE[key]


def load_callable(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module:attr"`` or ``"path/file.py:attr"`` (the current directory
    importable first).

    Raises:
        ValueError: no ``:``, the module cannot be imported, or the attribute is missing or not callable.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(f"{spec!r} must be 'module:function' or 'file.py:function'")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name).resolve()
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or not path.exists():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(mod_name)
    except Exception as exc:
        raise ValueError(f"cannot import {mod_name!r} for {spec!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: {mod_name} has no callable {attr!r}")
    return fn


@register_env("tools", for_testbed=True)
class ToolsEnv(ToolEnvironment):
    """A :class:`ToolEnvironment` over callables named by import path (the trainer's ``tools=``).

    Args:
        tools: ``module:function`` specs or callables.
        **kwargs: :class:`ToolEnvironment`'s settings.

    Raises:
        ValueError: no tools or one that cannot be imported.
    """

    def __init__(self, tools: Sequence[str | Callable[..., Any]] = (), **kwargs: Any):
        super().__init__([t if callable(t) else load_callable(t) for t in tools], **kwargs)


@register_env("feedback", for_testbed=True)
class FeedbackEnv:
    """Answers every model turn with ``message`` (role ``role``); never ``done`` (``max_turns``
    ends the episode).

    Args:
        message: the reply text.
        role: ``"user"`` or ``"tool"``.
    """

    def __init__(self, message: str = "Check your answer.", role: str = "user"):
        if role not in ("user", "tool"):
            raise ValueError(f"role must be 'user' or 'tool', got {role!r}")
        self.message, self.role = message, role

    def reset(self, example: Any) -> Any:
        """The example's prompt, unchanged."""
        return example.messages

    def step(self, completion: str) -> EnvReply:
        """The fixed reply."""
        return EnvReply(messages=[{"role": self.role, "content": self.message}])


@register_env("python")
class PythonEnv(ToolEnvironment):
    """A :class:`ToolEnvironment` with the sandboxed ``python`` tool
    (:mod:`echotrain.envs.python_exec`: a limited subprocess per call, no network).

    Args:
        timeout_s: each call's wall-clock limit in-process (seconds; the subprocess has its own 5 s).
        **kwargs: :class:`ToolEnvironment`'s settings.
    """

    def __init__(self, timeout_s: float = 10.0, **kwargs: Any):
        super().__init__([python], timeout_s=timeout_s, **kwargs)
