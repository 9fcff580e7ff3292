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
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from echotrain.envs.base import EnvReply, ToolEnvironment, register_env
from echotrain.envs.library import load_callable

__all__ = ["TrlEnvironment"]


@register_env("trl", for_testbed=True)
class TrlEnvironment(ToolEnvironment):
    """An echotrain environment around one TRL ``environment_factory`` instance.

    Args:
        factory: ``module:Class`` (or ``file.py:Class``) or the callable itself.
        **kwargs: :class:`~echotrain.envs.base.ToolEnvironment`'s settings.

    Raises:
        ValueError: no ``factory``, one that cannot be imported, an instance without ``reset``
            or without a public method.
    """

    def __init__(self, factory: str | Callable[[], Any] = "", **kwargs: Any):
        if not factory:
            raise ValueError("env=trl needs env_options.factory=module:Class (TRL's environment_factory)")
        make = factory if callable(factory) else load_callable(factory)
        self.instance = make()
        cls = type(self.instance)
        if not callable(getattr(self.instance, "reset", None)):
            raise ValueError(f"{cls.__name__} has no reset method (TRL's environment_factory contract)")
        methods = [getattr(self.instance, name) for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                   if not name.startswith("_") and name not in ("reset", "get_reward")]
        if not methods:
            raise ValueError(f"{cls.__name__} has no public method to use as a tool")
        super().__init__(methods, **kwargs)
        self._get_reward = getattr(self.instance, "get_reward", None)

    def reset(self, example: Any) -> list[dict[str, str]] | str:
        """The example's prompt (tools described), with ``reset``'s string appended to the last user message."""
        row = {"prompt": example.messages, "question": example.question, "answer": example.answer,
               **dict(example.metadata)}
        observation = self.instance.reset(**row)
        prompt = super().reset(example)
        if not observation:
            return prompt
        if isinstance(prompt, str):
            return prompt + str(observation)
        last = max(i for i, m in enumerate(prompt) if m["role"] == "user")
        prompt[last] = {**prompt[last], "content": prompt[last]["content"] + str(observation)}
        return prompt

    def step(self, completion: str) -> EnvReply:
        """The tool calls of the turn; at the final answer, ``get_reward()`` (if defined) as shaping."""
        reply = super().step(completion)
        if reply.done and self._get_reward is not None:
            reply.reward = float(self._get_reward())
        return reply
