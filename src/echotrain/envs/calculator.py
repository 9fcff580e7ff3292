"""The calculator environment (``env=calculator``): one tool, :func:`calculator`, that evaluates
arithmetic (exact on integers; `/` gives a float).

On the byte-level testbed (``model=testbed task=testbed-calc``) prompts stay the bare
``4817+2933=`` (no tool description: the 427k-parameter policy reads no JSON schema); a call is
``<tool_call>{"name": "calculator", "arguments": {"expression": "4817+2933"}}</tool_call>`` and
its result comes back as ``<tool_response>7750</tool_response>``. On a chat model (the embedded
SmolLM2-135M-Instruct on a reasoning-gym task) the tool's schema is described in the system
message (SmolLM2's ChatML template has no tools section) and the result comes back as a ``tool``
turn.

A 135M chat model never calls a tool it has only read about (SmolLM2-135M-Instruct on
``rg:basic_arithmetic``: 0 calls in 32 samples), so ``env_options.demonstrate=true`` turns each
worked example already in a chat prompt (a user message followed by an assistant answer, such as
reasoning-gym's one-shot exchange) into a worked tool use: before the example's answer, an
assistant turn calling :func:`calculator` on the longest arithmetic expression of the question and
the ``tool`` turn with its result. Examples whose question holds no expression the calculator
evaluates stay as they are. Our choice (a documented flag, off by default): a prompt-side
warm-up of the call format. The supervised warm-up (``sft_steps``, echotrain.train.warmup) trains
on :meth:`CalculatorEnv.demonstration`'s worked episodes instead: the call, the tool's reply, the
answer.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from echotrain.envs.base import ToolEnvironment, register_env

__all__ = ["CalculatorEnv", "calculator", "demonstrate_calls", "find_expression", "worked_call"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_MAX_ABS = 10 ** 30


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        v = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if abs(v) > _MAX_ABS:
            raise ValueError("result too large")
        return v
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "4817+2933".
    """
    value = _eval(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


#: the longest expression :func:`find_expression` tries (longer runs are skipped)
MAX_EXPRESSION_CHARS = 500

#: runs of characters an arithmetic expression is made of (digits, operators, parentheses, spaces)
_EXPR_RUN = re.compile(r"[-+*/%().\d\s]+")


def find_expression(text: str) -> tuple[str, str] | None:
    """The longest run of ``text`` that :func:`calculator` evaluates and that holds an operator,
    with its value: ``("717 + -55 * -709", "39712")``; None when there is none. Runs longer than
    :data:`MAX_EXPRESSION_CHARS` are skipped, and a run the calculator fails on for any reason
    (syntax, division by zero, nesting too deep for the parser) is skipped.

    Args:
        text: any string (e.g. a user question, "Calculate 3 + 4 * 2.").

    Returns:
        ``(expression, result)`` strings (the expression stripped of spaces and trailing dots at
        its ends), or None.
    """
    best: tuple[str, str] | None = None
    for m in _EXPR_RUN.finditer(text):
        expr = m.group(0).strip().rstrip(".").strip()
        if (not re.search(r"\d\s*[-+*/%]", expr) or len(expr) > MAX_EXPRESSION_CHARS
                or (best is not None and len(expr) <= len(best[0]))):
            continue
        try:
            best = (expr, calculator(expr))
        except Exception:  # (RecursionError included: a deeply nested or very long run)
            continue
    return best


def demonstrate_calls(messages: list[dict[str, str]], name: str = "calculator") -> list[dict[str, str]]:
    """``messages`` with every worked example (a ``user`` message directly followed by an
    ``assistant`` one, before the last ``user`` message: never the question being asked) given a
    tool use before its answer: an ``assistant`` turn
    ``<tool_call>{"name": name, "arguments": {"expression": ...}}</tool_call>`` on the question's
    longest evaluable expression (:func:`find_expression`) and a ``tool`` turn with its result.
    Examples without an expression, or whose answer already calls a tool, are kept as they are.
    A new list; the input is not modified."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        out.append(dict(m))
        if (i < last_user and m.get("role") == "user" and nxt is not None and nxt.get("role") == "assistant"
                and isinstance(m.get("content"), str) and "<tool_call>" not in str(nxt.get("content", ""))):
            found = find_expression(m["content"])
            if found is not None:
                out += worked_call(found, name)
    return out


def worked_call(found: tuple[str, str], name: str = "calculator", compact: bool = False) -> list[dict[str, str]]:
    """The two turns of one worked calculator use: the ``assistant`` call
    ``<tool_call>{"name": name, "arguments": {"expression": E}}</tool_call>`` and the ``tool``
    turn with its result, for ``found = (E, result)`` (:func:`find_expression`); ``compact``: JSON
    without spaces (the byte-level testbed's form, :func:`echotrain.tasks.testbed_calc.tool_trace`)."""
    call = json.dumps({"name": name, "arguments": {"expression": found[0]}},
                      separators=(",", ":") if compact else None)
    return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}, {"role": "tool", "content": found[1]}]


@register_env("calculator", for_testbed=True)
class CalculatorEnv(ToolEnvironment):
    """:class:`~echotrain.envs.base.ToolEnvironment` with the :func:`calculator` tool.

    Args:
        timeout_s: each call's wall-clock limit (seconds).
        max_output_chars: the most characters of a result.
        demonstrate: turn the worked examples of a chat prompt into worked tool uses
            (:func:`demonstrate_calls`; module docstring). Plain-string prompts (the testbed) are
            left as they are.
    """

    def __init__(self, timeout_s: float = 5.0, max_output_chars: int = 200, demonstrate: bool = False,
                 **kwargs: Any):
        if not isinstance(demonstrate, bool):
            raise ValueError(f"env_options.demonstrate must be true or false, got {demonstrate!r}")
        super().__init__([calculator], timeout_s=timeout_s, max_output_chars=max_output_chars, **kwargs)
        self.demonstrate = demonstrate

    def reset(self, example: Any) -> list[dict[str, str]] | str:
        """The prompt of :meth:`ToolEnvironment.reset`, with its worked examples turned into
        worked tool uses when ``demonstrate``."""
        prompt = super().reset(example)
        return demonstrate_calls(prompt) if self.demonstrate and not isinstance(prompt, str) else prompt

    def demonstration(self, example: Any, answer: str) -> list[dict[str, str]] | None:
        """A worked episode for the supervised warm-up (``sft_steps``; echotrain.train.warmup): the
        call of :func:`calculator` on the question's longest evaluable expression
        (:func:`find_expression`), its result as a ``tool`` turn, then ``answer`` (the task's
        reference completion) as the final assistant turn; None when the question holds no
        expression. Plain-string prompts (the testbed) get the compact JSON its warm-up taught."""
        found = find_expression(example.question)
        if found is None:
            return None
        return worked_call(found, compact=isinstance(example.messages, str)) + [{"role": "assistant", "content": answer}]
