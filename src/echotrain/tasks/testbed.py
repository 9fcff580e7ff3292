"""The testbed task: bare two-term arithmetic for the CPU testbed policy (``model=testbed``).

reasoning-gym ``basic_arithmetic`` (two terms, ``+``/``-``, operands of up to two digits, no
parentheses, no negation) written without chat, spaces or tags, exactly as the testbed policy
was warm-started on (:mod:`echotrain.models.testbed`): the prompt is the expression and ``=``,
the answer the integer, then ``"\\n"`` (the byte tokenizer's EOS)::

    prompt "81-88="   completion "-7\\n"

Reward: 1.0 when the completion (EOS stripped) is exactly an integer equal to the gold one,
else 0.0. ``is_formatted``: the completion is an integer.

Splits: a problem (its expression) is held out when ``crc32(expression) % 8 == 0`` (about 1/8 of
the ~12.7k distinct problems). ``split="train"`` never yields a held-out problem (the warm-up
trains on it and RL samples prompts from it); ``split="test"`` yields only held-out problems,
each once. :meth:`TestbedTask.eval_task` returns the test split, which the trainer uses for its
fixed greedy evaluation, so evaluation prompts were never seen in warm-up.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from echotrain.tasks.base import Example, register_task
from echotrain.tasks.indexed import IndexedTask

__all__ = ["TESTBED_GYM_CONFIG", "TestbedTask", "is_heldout", "prompt_of"]

#: reasoning-gym ``basic_arithmetic`` settings of the testbed (chosen from a probe of the policy's accuracy;
#: docs/testbed.md).
TESTBED_GYM_CONFIG: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 2,
    "max_digits": 2,
    "operators": ("+", "-"),
    "allow_parentheses": False,
    "allow_negation": False,
}
#: One problem in this many is held out (by a CRC32 of its expression; stable across processes).
HELDOUT_MODULUS = 8
SPLITS = ("train", "test", "all")
_INT = re.compile(r"-?\d+")


def is_heldout(expression: str) -> bool:
    """Whether the problem ``expression`` (e.g. ``"81-88"``) belongs to the held-out split."""
    return zlib.crc32(expression.encode()) % HELDOUT_MODULUS == 0


def prompt_of(expression: str) -> str:
    """The prompt text of a problem: the expression without spaces and ``=`` (``"81 - 88"`` -> ``"81-88="``)."""
    return expression.replace(" ", "") + "="


class TestbedTask(IndexedTask):
    """Bare ``a+b=`` / ``a-b=`` problems from reasoning-gym, scored by exact integer match.

    Args:
        split: ``"train"`` (default; no held-out problem), ``"test"`` (only held-out problems,
            each once) or ``"all"``.
        size: number of examples (``train``/``all``: draws of the generator, repeats possible;
            ``test``: distinct problems, at most the ~1.6k held-out ones).
        seed: reasoning-gym generator seed.

    Raises:
        ValueError: unknown ``split``, ``size`` < 1, or more test problems asked than exist.
    """

    __test__ = False  # not a pytest class
    answer_format = "integer"  # a bare integer, no tag (outside base.ANSWER_FORMATS on purpose)

    def __init__(self, split: str = "train", size: int = 10_000, seed: int = 0):
        import reasoning_gym

        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown; valid: {list(SPLITS)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.name, self.split, self.size, self.seed = "testbed", split, size, seed
        items: list[tuple[str, str]] = []
        seen: set[str] = set()
        chunk = size if split != "test" else 2 * HELDOUT_MODULUS * size
        offset = 0
        while len(items) < size:
            ds = reasoning_gym.create_dataset("basic_arithmetic", size=chunk, seed=seed + offset, **TESTBED_GYM_CONFIG)
            n_before = len(items)
            for i in range(chunk):
                entry = ds[i]
                expr = entry["metadata"]["expression"].replace(" ", "")
                held = is_heldout(expr)
                if (split == "train" and held) or (split == "test" and (not held or expr in seen)):
                    continue
                seen.add(expr)
                items.append((expr, str(entry["answer"])))
                if len(items) == size:
                    break
            if split == "test" and len(items) == n_before:
                raise ValueError(f"size={size}: only {len(items)} distinct held-out problems exist")
            offset += 1_000_003
        self._items = items

    def __getitem__(self, index: int) -> Example:
        self.check_index(index)
        expr, answer = self._items[index]
        prompt = prompt_of(expr)
        return Example(messages=prompt, question=prompt, answer=answer, task=self.name, index=index,
                       metadata={"expression": expr, "split": self.split})

    def eval_task(self) -> "TestbedTask":
        """The held-out split (512 distinct problems, same generator seed), for fixed evaluations."""
        return TestbedTask(split="test", size=512, seed=self.seed)

    def extract(self, completion: str) -> str | None:
        """The completion as an integer string (surrounding whitespace and EOS ignored), or None."""
        text = completion.strip()
        return text if _INT.fullmatch(text) else None

    def score(self, completion: str, example: Example) -> float:
        """1.0 if the completion is exactly the gold integer, else 0.0."""
        answer = self.extract(completion)
        return 1.0 if answer is not None and int(answer) == int(example.answer) else 0.0

    def __repr__(self) -> str:
        return f"TestbedTask(split={self.split!r}, size={self.size}, seed={self.seed})"


@register_task("testbed", for_testbed=True)
def _testbed(**options: Any) -> TestbedTask:
    """The testbed task (``split``, ``size``, ``seed`` options)."""
    return TestbedTask(**options)
