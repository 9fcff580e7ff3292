"""TRL 1.16's ``environment_factory`` objects as echotrain environments (``env=trl``).

``env=trl env_options.factory=my_envs:Counter``: ``Counter()`` is built once per episode, as TRL
does (one instance per rollout). Its contract (``trl.GRPOTrainer``'s ``environment_factory``):

* ``reset(**row) -> str | None``: called at the episode's start with the example's fields
  (``prompt``, ``question``, ``answer`` and the example's ``metadata``); a returned string is
  appended to the last user message (to a plain-string prompt, at its end);
* every public method (a function of the class not starting with ``_``, other than ``reset`` and
  ``get_reward``) is a tool (schema from its signature and docstring, as for ``tools=``);
* an optional ``get_reward() -> float`` scores the episode from the environment's state: here it
  is called once when the episode ends with a final answer and added to the reward as shaping
  (``episode/shaping``; TRL adds it as a reward source of weight 1).

**Several environments** (TRL's ``environment_factory={name: factory}``):
``env_options.factory.NAME=module:Class`` once per environment. Each example then selects its
environment by an ``environment`` field of its metadata (a column of a ``task=jsonl`` file, as
TRL reads it from the dataset row); only that environment's methods are the episode's tools.
Every class is imported and built once per process when the options are checked (its ``reset`` and public
methods validated, as TRL probes one instance of each); the episode's instance is built at
``reset``. An example without the field, or naming no environment, is a ``ValueError`` naming
the valid names (``ConfigError``: one line from the CLI; TRL raises too). The field is compared
as text (``1`` from a JSONL column selects ``factory.1``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Mapping

from echotrain.envs.base import EnvReply, ToolEnvironment, register_env
from echotrain.envs.library import load_callable_once
from echotrain.errors import ConfigError

__all__ = ["TrlEnvironment"]


#: factory -> the tools of a probe instance, for the classes of a several-environments mapping
#: already validated in this process (keyed by the object itself: a strong reference, so an id
#: is never reused for another factory)
_PROBED: dict[Callable[..., Any], list[Callable[..., Any]]] = {}


def _methods(instance: Any) -> list[Callable[..., Any]]:
    """The tools of a TRL environment instance: its class's public functions but ``reset`` and
    ``get_reward``, bound to it.

    Raises:
        ValueError: no ``reset``, or no public method.
    """
    cls = type(instance)
    if not callable(getattr(instance, "reset", None)):
        raise ValueError(f"{cls.__name__} has no reset method (TRL's environment_factory contract)")
    methods = [getattr(instance, name) for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
               if not name.startswith("_") and name not in ("reset", "get_reward")]
    if not methods:
        raise ValueError(f"{cls.__name__} has no public method to use as a tool")
    return methods


@register_env("trl", for_testbed=True)
class TrlEnvironment(ToolEnvironment):
    """An echotrain environment around one TRL ``environment_factory`` instance.

    Args:
        factory: ``module:Class`` (or ``file.py:Class``) or the callable itself; or a mapping
            ``{name: one of those}`` (several environments, selected per example by its
            metadata's ``environment``; module docstring).
        **kwargs: :class:`~echotrain.envs.base.ToolEnvironment`'s settings, and ``factory.NAME``
            entries (how ``env_options.factory.NAME=module:Class`` arrives from the command line).

    Raises:
        ValueError: no ``factory``, one that cannot be imported, an instance without ``reset``
            or without a public method.
    """

    def __init__(self, factory: str | Callable[[], Any] | Mapping[str, Any] = "", **kwargs: Any):
        named = {k.split(".", 1)[1]: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("factory.")]}
        if named:
            if factory:
                raise ValueError("env=trl takes env_options.factory=module:Class or env_options.factory.NAME=..., "
                                 "not both")
            factory = named
        if not factory:
            raise ValueError("env=trl needs env_options.factory=module:Class (TRL's environment_factory)")
        self._options = kwargs
        if isinstance(factory, Mapping):  # several environments: the instance is built at reset
            self.factories = {str(name): f if callable(f) else load_callable_once(f) for name, f in factory.items()}
            for name, make in self.factories.items():
                if make not in _PROBED:
                    try:
                        _PROBED[make] = _methods(make())
                    except ValueError as e:
                        raise ValueError(f"env_options.factory.{name}: {e}") from None
            # (the options checked against a probe's tools; reset binds the example's own instance)
            super().__init__(_PROBED[next(iter(self.factories.values()))], **kwargs)
            self.instance, self._get_reward = None, None
            return
        self.factories = None
        self._bind((factory if callable(factory) else load_callable_once(factory))())

    def _bind(self, instance: Any) -> None:
        """Make ``instance``'s methods the tools."""
        self.instance = instance
        super().__init__(_methods(instance), **self._options)
        self._get_reward = getattr(instance, "get_reward", None)

    def reset(self, example: Any) -> list[dict[str, str]] | str:
        """The example's prompt (tools described), with ``reset``'s string appended to the last user message."""
        row = {"prompt": copy.deepcopy(example.messages), "question": example.question, "answer": example.answer,
               **copy.deepcopy(dict(example.metadata))}
        if self.factories is not None:  # several environments: the example's own
            name = row.get("environment")
            if name is None or str(name) not in self.factories:
                raise ConfigError(f"example {example.index} of task {example.task!r} has environment={name!r}; with "
                                  f"several env_options.factory entries each example needs an 'environment' field, "
                                  f"one of {sorted(self.factories)}")
            self._bind(self.factories[str(name)]())
        observation = self.instance.reset(**row)
        prompt = super().reset(example)
        if not observation:
            return prompt
        if isinstance(prompt, str):
            return prompt + str(observation)
        prompt = [dict(m) for m in prompt]  # (never the example's own list: its G episodes share it)
        last = max(i for i, m in enumerate(prompt) if m["role"] == "user")
        prompt[last] = {**prompt[last], "content": prompt[last]["content"] + str(observation)}
        return prompt

    def step(self, completion: str) -> EnvReply:
        """The tool calls of the turn; at the final answer, ``get_reward()`` (if defined) as shaping."""
        reply = super().step(completion)
        if reply.done and self._get_reward is not None:
            reply.reward = float(self._get_reward())
        return reply
