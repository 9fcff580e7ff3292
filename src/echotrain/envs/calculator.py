"""The calculator environment (``env=calculator``): one tool, :func:`calculator`, that evaluates
arithmetic exactly.

On the byte-level testbed (``model=testbed task=testbed-calc``) prompts stay the bare
``4817+2933=`` (no tool description: the 427k-parameter policy reads no JSON schema); a call is
``<tool_call>{"name": "calculator", "arguments": {"expression": "4817+2933"}}</tool_call>`` and
its result comes back as ``<tool_response>7750</tool_response>``. On a chat model (the embedded
SmolLM2-135M-Instruct on a reasoning-gym task) the tool's schema is described in the system
message (SmolLM2's ChatML template has no tools section) and the result comes back as a ``tool``
turn.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from echotrain.envs.base import ToolEnvironment, register_env

__all__ = ["CalculatorEnv", "calculator"]

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


@register_env("calculator", for_testbed=True)
class CalculatorEnv(ToolEnvironment):
    """:class:`~echotrain.envs.base.ToolEnvironment` with the :func:`calculator` tool.

    Args:
        timeout_s: each call's wall-clock limit (seconds).
        max_output_chars: the most characters of a result.
    """

    def __init__(self, timeout_s: float = 5.0, max_output_chars: int = 200, **kwargs: Any):
        super().__init__([calculator], timeout_s=timeout_s, max_output_chars=max_output_chars, **kwargs)
