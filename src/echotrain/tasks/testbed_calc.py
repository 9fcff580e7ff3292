"""The calculator testbed task: ``a+b=`` / ``a-b=`` with four-digit operands, too large for the
byte-level testbed policy (warm-started on two-digit operands, :mod:`echotrain.tasks.testbed`) to
add alone, for the ``calculator`` environment (:mod:`echotrain.envs.calculator`)::

    prompt "4817+2933="   completion "7750\\n"

Problems are drawn by ``random.Random(seed)`` (operands 1000-9999, ``+`` or ``-`` with equal
probability); scored like ``testbed``: 1.0 when the final model turn is exactly the gold integer.
"""

from __future__ import annotations

import random
from typing import Any

from echotrain.tasks.base import Example, register_task
from echotrain.tasks.testbed import TestbedTask

__all__ = ["CalcTestbedTask"]


class CalcTestbedTask(TestbedTask):
    """Four-digit ``a+b=`` / ``a-b=`` problems in the testbed's bare format.

    Args:
        size: number of problems (>= 1).
        seed: generator seed.
        low, high: operand range (inclusive), ``1 <= low <= high``.

    Raises:
        ValueError: ``size`` < 1 or a bad operand range.
    """

    __test__ = False

    def __init__(self, size: int = 10_000, seed: int = 0, low: int = 1000, high: int = 9999):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
        self.name, self.split, self.size, self.seed = "testbed-calc", "all", size, seed
        rng = random.Random(seed)
        self._items = []
        for _ in range(size):
            a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice("+-")
            self._items.append((f"{a}{op}{b}", str(a + b if op == "+" else a - b)))

    def __getitem__(self, index: int) -> Example:
        ex = super().__getitem__(index)
        ex.task = self.name
        return ex

    def eval_task(self) -> "CalcTestbedTask":
        """512 problems of another seed."""
        return CalcTestbedTask(size=512, seed=self.seed + 1)

    def __repr__(self) -> str:
        return f"CalcTestbedTask(size={self.size}, seed={self.seed})"


@register_task("testbed-calc", for_testbed=True)
def _testbed_calc(**options: Any) -> CalcTestbedTask:
    """The calculator testbed task (``size``, ``seed``, ``low``, ``high`` options)."""
    return CalcTestbedTask(**options)
