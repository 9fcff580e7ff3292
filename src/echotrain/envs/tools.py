"""Tools: plain Python callables, their JSON schema, Hermes/Qwen tool-call parsing, and calls that
never crash or hang an episode.

* :func:`tool_schema` -- the OpenAI/Hermes function schema of a callable, read from its signature
  and Google-style docstring by ``transformers.utils.get_json_schema`` (the same function TRL 1.16's
  ``tools=`` and transformers' chat templates use), so a tool is declared once, as code.
* :func:`parse_tool_calls` -- the calls in one model turn, written Hermes/Qwen style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3 chat templates, TRL's
  and verl's ``hermes`` parser). A malformed call (bad JSON, no ``name``, arguments not an object,
  an opening tag without its closing tag) is a :class:`ToolCall` with ``error`` set, never an
  exception.
* :func:`call_tool` -- one call under a wall-clock limit (``echotrain.rewards.call_with_timeout``:
  ``SIGALRM`` on the main thread, else a daemon thread told to stop), the tool's prints captured
  and capped, its result capped; every failure (unknown tool, bad arguments, an exception, a
  timeout, too much output) comes back as a :class:`ToolResult` with ``error=True`` and a short
  message the model sees as the tool's output. A tool stuck inside one C call cannot be stopped
  in-process: run such code through :mod:`echotrain.envs.python_exec` (a killed subprocess).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from echotrain.rewards.timeout import RewardTimeout, call_with_timeout

__all__ = ["ToolCall", "ToolResult", "call_tool", "parse_tool_calls", "tool_schema", "tools_by_name"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema ``{"type": "function", "function": {"name", "description", "parameters"}}``
    of ``fn`` from its type hints and Google-style docstring (``transformers.utils.get_json_schema``).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: the docstring or hints do not describe every argument (transformers'
            ``DocstringParsingException`` / ``TypeHintParsingException`` are ValueError-like; they
            are re-raised as ValueError naming the tool).
    """
    if not callable(fn):
        raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' parsing exceptions
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {exc}") from None


def tools_by_name(tools: Sequence[Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """``{fn.__name__: fn}`` of ``tools``.

    Raises:
        ValueError: two tools share a name.
    """
    out: dict[str, Callable[..., Any]] = {}
    for fn in tools:
        name = getattr(fn, "__name__", None) or type(fn).__name__
        if name in out:
            raise ValueError(f"two tools are named {name!r}")
        out[name] = fn
    return out


@dataclass
class ToolCall:
    """One parsed tool call: ``name`` and ``arguments`` (a dict), or ``error`` (why the text
    between the tags is not a valid call; ``name``/``arguments`` are then whatever was readable)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


@dataclass
class ToolResult:
    """What a call gave back: ``content`` (the text the model sees as the tool's output),
    ``error`` (True when the call failed: counted in ``episode/tool_errors``) and ``kind``
    (``ok``, ``malformed``, ``unknown_tool``, ``bad_arguments``, ``raised``, ``timeout``,
    ``output_too_long``)."""

    name: str | None
    content: str
    error: bool = False
    kind: str = "ok"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one model turn, in order (``[]``: the turn is a final answer).

    Args:
        text: the decoded model turn.

    Returns:
        One :class:`ToolCall` per ``<tool_call>...</tool_call>`` span (JSON ``{"name": str,
        "arguments": object}``; ``arguments`` may also be a JSON string holding an object, as
        some models write it), plus one malformed call for a trailing ``<tool_call>`` without its
        closing tag.
    """
    calls: list[ToolCall] = []
    end = 0
    for m in _CALL.finditer(text):
        end = m.end()
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, {}, 'the tool call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, '"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(obj["name"], args))
    if _OPEN in text[end:]:
        calls.append(ToolCall(None, {}, "<tool_call> without its closing </tool_call>"))
    return calls


class _CappedWriter(io.StringIO):
    """A ``sys.stdout`` stand-in that raises :class:`_TooMuchOutput` past ``cap`` characters."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap, self.n = cap, 0

    def write(self, s: str) -> int:
        self.n += len(s)
        if self.n > self.cap:
            raise _TooMuchOutput(self.n)
        return super().write(s)


class _TooMuchOutput(Exception):
    """A tool printed more than its cap."""


def call_tool(call: ToolCall, tools: Mapping[str, Callable[..., Any]], *, timeout_s: float = 5.0,
              max_output_chars: int = 2000) -> ToolResult:
    """Run one parsed call; every failure is a :class:`ToolResult` with ``error=True``.

    The tool's return value (``str()`` of it; its printed output when it returns None) is the
    content; prints (stdout and stderr) go to a capped buffer, not the terminal.

    Args:
        call: from :func:`parse_tool_calls`.
        tools: name -> callable.
        timeout_s: wall-clock limit of the call (seconds, > 0).
        max_output_chars: the most characters a tool may print or return.

    Returns:
        The result; ``kind`` says which failure, if any.
    """
    if call.error is not None:
        return ToolResult(call.name, f"Error: {call.error}", True, "malformed")
    fn = tools.get(call.name or "")
    if fn is None:
        return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available: {sorted(tools)}", True,
                          "unknown_tool")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolResult(call.name, f"Error: bad arguments for {call.name}: {exc}", True, "bad_arguments")
    except ValueError:  # no signature (a builtin): let the call say
        pass
    out = _CappedWriter(max_output_chars)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            value = call_with_timeout(fn, timeout_s=timeout_s, **call.arguments)
    except RewardTimeout:
        return ToolResult(call.name, f"Error: {call.name} did not finish within {timeout_s} s", True, "timeout")
    except _TooMuchOutput as exc:
        return ToolResult(call.name, f"Error: {call.name} printed more than {max_output_chars} characters "
                          f"({exc.args[0]} so far); output dropped", True, "output_too_long")
    except Exception as exc:
        return ToolResult(call.name, f"Error: {call.name} raised {type(exc).__name__}: {exc}", True, "raised")
    text = out.getvalue() if value is None else str(value)
    if len(text) > max_output_chars:
        return ToolResult(call.name, f"Error: {call.name} returned {len(text)} characters, more than "
                          f"{max_output_chars}; output dropped", True, "output_too_long")
    return ToolResult(call.name, text)
