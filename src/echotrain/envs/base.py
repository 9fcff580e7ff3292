"""The environment contract (docs/design/environments.md) and the tool-calling environment.

An **environment** takes turns with the policy in one episode:

1. ``reset(example) -> prompt``: the episode's start from a task example (chat messages, with
   the tools described in the system message, or a plain string for byte-level policies);
2. ``step(completion) -> EnvReply``: the environment's answer to one model turn (decoded text):
   the messages it sends back (``tool`` results, ``user`` feedback), whether the episode is over
   (the model gave its final answer) and an optional per-turn shaping reward (logged apart as
   ``episode/shaping``, added to the episode's reward);
3. the runner (:mod:`echotrain.runtime.episodes`) ends the episode at the final answer,
   ``max_turns`` model turns or the ``max_episode_tokens`` budget; the verifiable reward is the
   task's scorer on the final model turn (the trainer's reward function, timeouts and all).

A new environment is a class registered with :func:`register_env` (``env=<name>``); the trainer
builds one instance per episode with ``env_options`` as keyword arguments, as TRL 1.16's
``environment_factory`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from echotrain.envs.tools import ToolResult, call_tool, parse_tool_calls, tool_schema, tools_by_name
from echotrain.registry import Registry

__all__ = ["ENVIRONMENTS", "EnvReply", "Environment", "ToolEnvironment", "env_names", "get_env_factory",
           "register_env", "tool_system_prompt"]


@dataclass
class EnvReply:
    """The environment's answer to one model turn.

    Attributes:
        messages: chat messages ``{"role": "tool" | "user", "content": str}`` sent back (empty
            when ``done``); rendered into tokens by the chat template (never re-tokenising the
            model's text).
        done: True when the turn was the final answer.
        reward: per-turn shaping (0.0 = none), summed over the episode.
        tool_calls: tool calls in the turn (malformed ones included).
        tool_errors: calls that failed (malformed, unknown tool, bad arguments, raised, timed
            out, too much output); ``env=verifiers``: 1 when the environment raised.
    """

    messages: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Environment(Protocol):
    """What an episode's environment provides (one instance per episode)."""

    def reset(self, example: Any) -> list[dict[str, str]] | str: ...

    def step(self, completion: str) -> EnvReply: ...


#: env name -> factory ``factory(**env_options) -> Environment`` (one call per episode).
ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment", "env")


def register_env(name: str, *, for_testbed: bool = False) -> Callable[[Callable[..., Environment]],
                                                                         Callable[..., Environment]]:
    """Decorator registering an environment factory (a class) under ``name``.

    ``for_testbed``: it speaks the byte-level testbed's plain-string prompts.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return ENVIRONMENTS.register(name, for_testbed=for_testbed)


def env_names() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(ENVIRONMENTS)


def get_env_factory(name: str, **options: Any) -> Callable[[], Environment]:
    """A zero-argument factory of fresh environments ``name`` built with ``options``.

    One instance is built at once, so bad options fail here (before any rollout).

    Raises:
        ValueError: unknown ``name`` (lists the valid ones).
        TypeError / ValueError: the environment rejects ``options``.
    """
    cls = ENVIRONMENTS.lookup(name)
    cls(**options)

    def make() -> Environment:
        return cls(**options)

    return make


def tool_system_prompt(tools: Sequence[Callable[..., Any]], base: str = "") -> str:
    """A system message describing ``tools`` (for chat templates without a tools section, such as
    SmolLM2's plain ChatML): the Hermes-style ``<tools>`` block of their JSON schemas and the call
    format; results come back in a ``tool`` turn."""
    schemas = "\n".join(json.dumps(tool_schema(fn)) for fn in tools)
    head = (base.strip() + "\n\n") if base.strip() else ""
    return (f"{head}You may call these tools:\n<tools>\n{schemas}\n</tools>\n"
            'To call a tool, write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> and stop; '
            "its result comes back in a tool message. When you know the answer, reply without a tool call.")


class ToolEnvironment:
    """An environment whose replies are the results of the tool calls in each model turn.

    A turn with no ``<tool_call>`` is the final answer (``done``). Each call runs through
    :func:`echotrain.envs.tools.call_tool` (time limit, capped output, every failure an error
    message as the tool's output, counted); results come back as one ``tool`` message per call.

    Args:
        tools: plain callables with type hints and a Google-style docstring (their schema is
            :func:`~echotrain.envs.tools.tool_schema`).
        system: instructions put before the tool description in the system message.
        describe_tools: add the tool description to a chat prompt's system message (False for
            plain-string prompts, and for a model trained to call without it).
        timeout_s: each call's wall-clock limit (seconds).
        max_output_chars: the most characters a tool may print or return.

    Raises:
        ValueError: no tools, two tools of one name, or a tool whose schema cannot be read.
    """

    def __init__(self, tools: Sequence[Callable[..., Any]], *, system: str = "", describe_tools: bool = True,
                 timeout_s: float = 5.0, max_output_chars: int = 2000):
        if not tools:
            raise ValueError("a ToolEnvironment needs at least one tool")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        self.tools = tools_by_name(tools)
        self.schemas = [tool_schema(fn) for fn in tools]
        self.system, self.describe_tools = system, describe_tools
        self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)
        self.results: list[ToolResult] = []

    def reset(self, example: Any) -> list[dict[str, str]] | str:
        """The example's prompt; a chat prompt gets the tools described in its system message
        (prepended to an existing one)."""
        self.results = []
        prompt = example.messages
        if isinstance(prompt, str) or not self.describe_tools:
            return prompt
        messages = [dict(m) for m in prompt]
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = tool_system_prompt(list(self.tools.values()), self.system + "\n" + messages[0]["content"])
        else:
            messages.insert(0, {"role": "system", "content": tool_system_prompt(list(self.tools.values()), self.system)})
        return messages

    def step(self, completion: str) -> EnvReply:
        """Run the turn's tool calls; no call = the final answer."""
        calls = parse_tool_calls(completion)
        if not calls:
            return EnvReply(done=True)
        results = [call_tool(c, self.tools, timeout_s=self.timeout_s, max_output_chars=self.max_output_chars)
                   for c in calls]
        self.results.extend(results)
        return EnvReply(messages=[{"role": "tool", "content": r.content} for r in results], done=False,
                        tool_calls=len(calls), tool_errors=sum(r.error for r in results))
