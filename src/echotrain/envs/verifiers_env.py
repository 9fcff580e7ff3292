"""prime-rl ``verifiers``-style multi-turn environments as echotrain environments (``env=verifiers``).

``env=verifiers env_options.env=my_envs:load_environment``: ``load_environment()`` (any
zero-argument callable named ``module:attr`` or ``file.py:attr``, a class included; keyword
arguments from ``env_options.kwargs.NAME=VALUE`` or a ``kwargs`` mapping) returns an object that
speaks verifiers 0.1.x's ``MultiTurnEnv`` protocol. It is read by duck typing: the ``verifiers``
package is not needed. The methods used, each plain or ``async def``:

* ``env_response(messages, state)``: the environment's reply to the model's last turn, a list of
  ``{"role", "content"}`` messages (newer verifiers, ``state`` changed in place), a tuple
  ``(messages, state)`` (older verifiers) or one message;
* ``setup_state(state)`` (optional): fills the per-episode ``state``; returns it (or None);
* ``is_completed(messages, state)`` (optional, older verifiers; newer ones' ``is_completed(state)``
  is called with ``state`` alone): True ends the episode before ``env_response``.

Semantics here:

* **One object per process, shared by all episodes**: ``load_environment`` usually loads a
  dataset, too slow to repeat per episode, and verifiers keeps per-rollout data in ``state``
  (one dict per episode, here per :class:`VerifiersEnvironment`). Loaded once per
  ``(env, kwargs)``; the object must not keep episode data on itself.
* ``reset(example)``: ``state = {"prompt": example.messages, "answer", "info":
  dict(example.metadata), "task", "trajectory": [], "responses": [], "turn": 0}``, then
  ``setup_state``; the prompt is returned unchanged. A plain-string prompt (the byte-level
  testbed) is one ``user`` message in the running message list the environment sees.
* ``step(completion)``: the turn is appended as ``{"role": "assistant", "content": completion}``
  (``state["responses"]`` gets the text, ``state["turn"]`` counts turns, ``state["trajectory"]``
  gets ``{"prompt": messages before it, "completion": [that message]}``); ``is_completed`` true
  ends the episode; else ``env_response`` replies. A reply that sets ``state["final_env_response"]``
  (newer verifiers' end signal) or is empty ends the episode: no model turn follows, so those
  messages are not shown to the model. Otherwise its messages (role and content as text) are the
  reply.
* **Failures end the episode, counted**: an exception from ``setup_state``, ``is_completed`` or
  ``env_response``, a call past ``env_options.timeout_s`` (default 30 s; plain methods interrupted
  as reward calls are, ``async def`` ones cancelled unless they block the event loop themselves),
  or a reply or state of the wrong type ends the episode at that turn (at the first turn for
  ``setup_state``) with ``tool_errors=1`` (``episode/tool_errors``), the text in
  ``state["error"]`` as newer verifiers do; the run goes on (an environment in an unknown state
  is not asked again).
* Async methods run on one private event loop per loaded object (created at first use, one call
  at a time, from any thread without a running event loop; echotrain's episode loop has none).
* Not used: the object's ``max_turns`` (echotrain's ``max_turns`` and ``max_episode_tokens`` end
  episodes; a newer ``is_completed`` that checks its own ``max_turns`` against
  ``state["trajectory"]`` may still end one earlier), its dataset (the task's examples are the
  prompts), its rubric (the reward is echotrain's task scorer on the final model turn), its
  parser and sampling settings.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
import time
from typing import Any, Callable, Mapping

from echotrain.envs.base import EnvReply, register_env
from echotrain.envs.library import load_callable_once
from echotrain.rewards.timeout import call_with_timeout

__all__ = ["VerifiersEnvironment"]


class _Runner:
    """Awaits an environment's coroutines on one private event loop (created at first use)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()

    def __call__(self, value: Any, timeout_s: float | None = None) -> Any:
        """``value`` itself, or its result when it is awaitable (cancelled after ``timeout_s`` seconds).

        Raises:
            TimeoutError: the awaitable did not finish within ``timeout_s``.
            RuntimeError: awaited from a thread whose event loop is running.
        """
        if not inspect.isawaitable(value):
            return value
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            return self.loop.run_until_complete(asyncio.wait_for(value, timeout_s))


#: (env spec or callable, repr of kwargs) -> (the loaded object, its runner).
_LOADED: dict[tuple[Any, str], tuple[Any, _Runner]] = {}


def _load(env: str | Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Any, _Runner]:
    """The shared object ``env(**kwargs)`` and its runner (loaded at the first call)."""
    make = load_callable_once(env) if isinstance(env, str) else env  # (a file spec imported once)
    key = (make, repr(sorted(kwargs.items())))
    if key not in _LOADED:
        try:
            obj = make(**kwargs)
        except Exception as exc:
            raise ValueError(f"{env!r} raised {type(exc).__name__}: {exc}") from None
        if not callable(getattr(obj, "env_response", None)):
            raise ValueError(f"{env!r} returned a {type(obj).__name__} without env_response "
                             "(verifiers' MultiTurnEnv protocol)")
        _LOADED[key] = (obj, _Runner())
    return _LOADED[key]


def _state(new: Any, old: dict[str, Any]) -> dict[str, Any]:
    """The state a verifiers method returned (``old``, changed in place, when it returned None).

    Raises:
        TypeError: it returned something other than a dict.
    """
    if new is None:
        return old
    if not isinstance(new, dict):
        raise TypeError(f"returned a {type(new).__name__} as the state, not a dict")
    return new


def _message(m: Any) -> dict[str, str]:
    """``{"role": str, "content": str}`` of a dict message (content None -> "", a list of parts -> their texts).

    Raises:
        TypeError / KeyError: not a message.
    """
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
    return {"role": str(m["role"]), "content": "" if content is None else str(content)}


@register_env("verifiers", for_testbed=True)
class VerifiersEnvironment:
    """An echotrain environment playing one episode with a shared verifiers ``MultiTurnEnv``-style object.

    Args:
        env: ``module:load_environment`` (or ``file.py:function``, a class) or the callable itself.
        kwargs: keyword arguments of ``env`` (``env_options.kwargs.NAME=VALUE`` on the command line).
        timeout_s: wall-clock limit of each call of the object's methods (seconds, default 30): a call
            past it ends the episode as a counted failure (``episode/tool_errors``), as a tool that
            hangs does; plain methods are interrupted as reward calls are
            (:func:`echotrain.rewards.call_with_timeout`), ``async def`` ones cancelled.
        **dotted: ``kwargs.NAME`` options (how ``env_options.kwargs.NAME=VALUE`` arrives).

    Raises:
        ValueError: no ``env``, one that cannot be imported, that raises, or whose object has no
            ``env_response``; a ``timeout_s`` that is not a positive number.
        TypeError: an option other than ``env``, ``kwargs``, ``timeout_s`` and ``kwargs.NAME``.
    """

    def __init__(self, env: str | Callable[..., Any] = "", kwargs: Mapping[str, Any] | None = None,
                 timeout_s: float = 30.0, **dotted: Any):
        if not env:
            raise ValueError("env=verifiers needs env_options.env=module:load_environment (a verifiers-style environment)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"env_options.timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        bad = sorted(k for k in dotted if not k.startswith("kwargs."))
        if bad:
            raise TypeError(f"unknown env_options {bad}; env=verifiers takes env, timeout_s and kwargs.NAME")
        kwargs = {**dict(kwargs or {}), **{k.split(".", 1)[1]: v for k, v in dotted.items()}}
        self.vf_env, self._run = _load(env, kwargs)
        self.state: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []

    def _call(self, name: str, *args: Any) -> Any:
        """The object's method ``name`` called with ``args``, awaited when async, within ``timeout_s``.

        Raises:
            RewardTimeout: a plain method ran past ``timeout_s`` (interrupted, see
                :func:`echotrain.rewards.call_with_timeout`).
            TimeoutError: an ``async def`` method did not finish within ``timeout_s`` (cancelled; a
                coroutine that blocks the event loop, e.g. in ``time.sleep``, cannot be cancelled and
                runs to its end, as in asyncio).
        """
        fn = getattr(self.vf_env, name)
        start = time.monotonic()
        value = fn(*args) if inspect.iscoroutinefunction(fn) else call_with_timeout(fn, *args, timeout_s=self.timeout_s)
        try:  # (a plain method that returns an awaitable: the limit is for both together)
            return self._run(value, max(self.timeout_s - (time.monotonic() - start), 1e-3))
        except asyncio.TimeoutError:
            raise TimeoutError(f"{name} did not finish within {self.timeout_s} s") from None

    def reset(self, example: Any) -> list[dict[str, str]] | str:
        """A fresh ``state`` for ``example`` (``setup_state`` applied); returns the example's prompt unchanged."""
        prompt = example.messages
        self.messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        # (copies: the G episodes of an example share its messages and metadata, and setup_state may edit them)
        self.state = {"prompt": copy.deepcopy(prompt), "answer": example.answer, "info": copy.deepcopy(dict(example.metadata)),
                      "task": example.task, "trajectory": [], "responses": [], "turn": 0}
        if hasattr(self.vf_env, "setup_state"):
            try:
                self.state = _state(self._call("setup_state", self.state), self.state)
            except Exception as exc:
                self.state["error"] = f"setup_state raised {type(exc).__name__}: {exc}"
        return prompt

    def _completed(self) -> bool:
        """``is_completed(messages, state)`` (older verifiers) or ``is_completed(state)`` (newer); False without one."""
        fn = getattr(self.vf_env, "is_completed", None)
        if fn is None:
            return False
        P = inspect.Parameter
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        old = kinds.count(P.POSITIONAL_ONLY) + kinds.count(P.POSITIONAL_OR_KEYWORD) >= 2 or P.VAR_POSITIONAL in kinds
        return bool(self._call("is_completed", self.messages, self.state) if old else self._call("is_completed", self.state))

    def step(self, completion: str) -> EnvReply:
        """The environment's reply to the model turn ``completion``; done at the end or at a failure (counted)."""
        turn = {"role": "assistant", "content": completion}
        before, self.messages = self.messages, self.messages + [turn]
        if self.state.get("error"):  # setup_state failed: end at the first turn
            return EnvReply(done=True, tool_errors=1)
        try:  # the environment's state may lack our keys: a failure too
            self.state["trajectory"].append({"prompt": before, "completion": [turn]})
            self.state["responses"].append(completion)
            self.state["turn"] += 1
            if self._completed():
                return EnvReply(done=True)
            reply = self._call("env_response", self.messages, self.state)
            if isinstance(reply, tuple):  # older verifiers: (messages, state)
                reply, state = reply
                self.state = _state(state, self.state)
            reply = [_message(m) for m in ([reply] if isinstance(reply, Mapping) else reply or [])]
        except Exception as exc:
            self.state["error"] = f"{type(exc).__name__}: {exc}"
            return EnvReply(done=True, tool_errors=1)
        if not reply or self.state.get("final_env_response") is not None:
            return EnvReply(done=True)
        self.messages.extend(reply)
        return EnvReply(messages=reply, done=False)
