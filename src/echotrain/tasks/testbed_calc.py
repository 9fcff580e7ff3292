"""The calculator testbed task: ``a+b=`` / ``a-b=`` with four-digit operands, too large for the
byte-level testbed policy (warm-started on two-digit operands, :mod:`echotrain.tasks.testbed`) to
add alone, for the ``calculator`` environment (:mod:`echotrain.envs.calculator`)::

    prompt "4817+2933="   completion "7750\\n"

Problems are drawn by ``random.Random(seed)`` (operands 1000-9999, ``+`` or ``-`` with equal
probability); scored like ``testbed``: 1.0 when the final model turn is exactly the gold integer.
``split="train"`` / ``"test"`` keep only the problems of one side of a fixed hash (a tenth are
held out), so a warm-up on the train split never sees a test problem; ``"all"`` (the default) keeps
every draw.

The warm-up of ``model=testbed-calc`` (:mod:`echotrain.models.testbed`) trains on
:meth:`CalcTestbedTask.warmup_target`: with probability :data:`TOOL_SHARE` a worked tool use in the
calculator environment's byte-level format (the call, the environment's reply, the answer; the
reply's bytes are not trained), else the bare answer. RL then starts from a policy that calls the
tool on some problems and answers alone on others (docs/testbed.md, "The calculator testbed").
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any

from echotrain.tasks.base import Example, register_task
from echotrain.tasks.testbed import TestbedTask

__all__ = ["CalcTestbedTask", "TOOL_SHARE", "tool_trace"]

#: Share of the warm-up targets that are worked tool uses (the rest: the bare answer).
TOOL_SHARE = 0.5
#: splits of the task: every draw, or one side of the held-out hash
CALC_SPLITS = ("all", "train", "test")


def _held_out(a: int, op: str, b: int) -> bool:
    """Whether ``a op b`` is a test problem: ``crc32`` of its text is 0 mod 10 (a fixed tenth of all
    problems, unrelated to the answer's digits)."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0


def tool_trace(expression: str, answer: str) -> list[tuple[str, bool]]:
    """The byte-level episode of a worked tool use, as ``(text, trained)`` segments after the prompt:
    the call and its end-of-turn ``"\n"`` (trained), the calculator environment's reply as the
    testbed renders it (not trained: environment tokens), the answer (trained; the warm-up adds the
    final end-of-turn). Compact JSON (no spaces), which the calculator's parser reads."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return [(f"<tool_call>{call}</tool_call>\n", True), (f"<tool_response>{answer}</tool_response>\n", False),
            (answer, True)]


class CalcTestbedTask(TestbedTask):
    """Four-digit ``a+b=`` / ``a-b=`` problems in the testbed's bare format.

    Args:
        size: number of problems (>= 1).
        seed: generator seed.
        low, high: operand range (inclusive), ``1 <= low <= high``.
        split: ``"all"`` (every draw), ``"train"`` or ``"test"`` (module docstring).

    Raises:
        ValueError: ``size`` < 1, a bad operand range or an unknown split.
    """

    __test__ = False

    def __init__(self, size: int = 10_000, seed: int = 0, low: int = 1000, high: int = 9999, split: str = "all"):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
        if split not in CALC_SPLITS:
            raise ValueError(f"split={split!r} is unknown; valid: {list(CALC_SPLITS)}")
        self.name, self.split, self.size, self.seed = "testbed-calc", split, size, seed
        rng = random.Random(seed)
        self._items = []
        while len(self._items) < size:
            a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice("+-")
            if split != "all" and _held_out(a, op, b) != (split == "test"):
                continue
            self._items.append((f"{a}{op}{b}", str(a + b if op == "+" else a - b)))

    def __getitem__(self, index: int) -> Example:
        ex = super().__getitem__(index)
        ex.task = self.name
        return ex

    def eval_task(self) -> "CalcTestbedTask":
        """512 problems of another seed (the test split's when this is the train split)."""
        return CalcTestbedTask(size=512, seed=self.seed + 1, split="test" if self.split == "train" else "all")

    def warmup_target(self, example: Example, rng: random.Random) -> str | list[tuple[str, bool]]:
        """The warm-up's supervised target: with probability :data:`TOOL_SHARE` the worked tool
        use :func:`tool_trace`, else the bare answer."""
        if rng.random() < TOOL_SHARE:
            return tool_trace(example.question.rstrip("="), example.answer)
        return example.answer

    def __repr__(self) -> str:
        return f"CalcTestbedTask(size={self.size}, seed={self.seed}, split={self.split!r})"


@register_task("testbed-calc", for_testbed=True)
def _testbed_calc(**options: Any) -> CalcTestbedTask:
    """The calculator testbed task (``size``, ``seed``, ``low``, ``high``, ``split`` options)."""
    return CalcTestbedTask(**options)
