"""The length testbed task: sums of 2-8 terms worked out step by step, then a final answer.

The second CPU testbed (``model=testbed-length``, docs/testbed.md): responses are reasoning
chains whose length grows with the problem, so that response-length effects (length collapse
or blow-up, the coupling of the advantage's sign with length, overlong truncation) can show on a
policy that runs an RL step in about a second on one CPU thread. Written bare, without chat, for
the byte tokenizer (``"\\n"`` = EOS, so the steps are separated by ``";"``)::

    prompt "7+25+3+14="   completion "7+25=32;32+3=35;35+14=49;#49\\n"

A problem has ``n`` terms (uniform in ``[min_terms, max_terms]``), all with the same number of
digits ``d`` (uniform in ``[1, max_digits]``; 1-digit terms are 1-9, 2-digit terms 10-99). The
worked trace (:func:`clean_trace`) writes one line ``partial+term=partial'`` per term after the
first, then ``#`` and the sum: 9 tokens for ``3+4=`` (``"3+4=7;#7\\n"``) up to ~80 for eight
2-digit terms; the length grows with ``n`` and ``d`` (:func:`clean_length`).

Reward: 1.0 when the completion ends with ``#<integer>`` (after the last ``#``, only digits and
whitespace) and that integer is the sum, else 0.0: only the final answer counts, not the steps.
A response truncated before its ``#`` line (no EOS within ``max_new_tokens``) scores 0. The
scorer sees the text without EOS, so a response cut exactly after a complete final answer
counts as answered.

Warm-up traces (:meth:`LengthTestbedTask.warmup_target`, used by :mod:`echotrain.models.testbed`
to warm-start the policy) mix the clean trace with imperfect ones (:data:`TRACE_KINDS`), so that
the start policy writes chains of several lengths for one problem and RL can move the length
either way: ``skip`` merges two steps into one line (shorter, harder), ``repeat`` writes a line
twice (longer, no harm), ``guess`` stops after ``j`` of the ``n - 1`` steps and writes the sum
at once (shortest; right only if the policy can guess it).

``check_steps=True`` (a task option; docs/testbed.md, "Right and wrong within a group") scores
the steps too: 1.0 only when the final answer is right **and** the lines before it are the clean
chain, one term added per line in order with the right partial sums, a line written twice in a
row counted once. A skipped step (two terms on one line) or a guess (``#`` before the last step)
is then wrong even with the right sum, a repeated line is not: wrong answers to one problem are
shorter than right ones, the premise of Balanced Aggregation, on the same policy.

Splits: a problem (its prompt) is held out when ``crc32(prompt) % 8 == 0``. ``split="train"``
never yields a held-out problem (warm-up and RL prompts); ``split="test"`` yields distinct
held-out problems; :meth:`LengthTestbedTask.eval_task` is 512 of them (the trainer's fixed
greedy evaluation).
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

from echotrain.tasks.base import Example, register_task
from echotrain.tasks.indexed import IndexedTask

__all__ = ["LengthTestbedTask", "TRACE_KINDS", "WARMUP_MIX", "clean_length", "clean_trace", "is_heldout",
           "make_trace", "parse_answer", "steps_are_clean"]

#: One problem in this many is held out (by a CRC32 of its prompt; stable across processes).
HELDOUT_MODULUS = 8
SPLITS = ("train", "test", "all")
#: The kinds of warm-up trace (see the module docstring).
TRACE_KINDS = ("clean", "skip", "repeat", "guess")
#: Share of each trace kind in the warm-up data (ours; a documented flag of the testbed).
WARMUP_MIX: dict[str, float] = {"clean": 0.55, "skip": 0.15, "repeat": 0.15, "guess": 0.15}
_ANSWER = re.compile(r"#(\d+)\s*\Z")


def is_heldout(prompt: str) -> bool:
    """Whether the problem with prompt ``prompt`` (e.g. ``"7+25+3="``) belongs to the held-out split."""
    return zlib.crc32(prompt.encode()) % HELDOUT_MODULUS == 0


def prompt_of(terms: list[int]) -> str:
    """The prompt of a problem: ``"7+25+3="`` for ``[7, 25, 3]``."""
    return "+".join(map(str, terms)) + "="


def _line(left: int, parts: list[int]) -> str:
    return f"{left}+{'+'.join(map(str, parts))}={left + sum(parts)};"


def clean_trace(terms: list[int]) -> str:
    """The worked trace of ``terms`` (without EOS): one ``a+b=c;`` line per term after the first,
    then ``#`` and the sum. ``[7, 25, 3]`` -> ``"7+25=32;32+3=35;#35"``.

    Raises:
        ValueError: fewer than 2 terms.
    """
    return make_trace(terms, "clean", random.Random(0))


def clean_length(terms: list[int]) -> int:
    """Tokens (bytes) of the clean response of ``terms``, EOS included."""
    return len(clean_trace(terms)) + 1


def make_trace(terms: list[int], kind: str, rng: random.Random) -> str:
    """A warm-up trace of ``terms`` of one of :data:`TRACE_KINDS` (without EOS).

    ``clean``: every step; ``skip``: one line adds two terms at once (``7+25+3=35;``), the rest
    as ``clean`` (3+ terms; else clean); ``repeat``: one line written twice; ``guess``: the first
    ``j`` steps (``j`` uniform in ``[0, n-2]``), then ``#`` and the sum. Every trace ends with the
    correct ``#sum``; ``rng`` draws the position of the change.

    Raises:
        ValueError: fewer than 2 terms, or an unknown ``kind``.
    """
    if len(terms) < 2:
        raise ValueError(f"terms: a problem needs at least 2 terms, got {terms!r}")
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind={kind!r} is unknown; valid: {list(TRACE_KINDS)}")
    steps = len(terms) - 1
    groups = [[t] for t in terms[1:]]  # the terms each line adds to the running sum
    if kind == "skip" and steps >= 2:
        i = rng.randrange(steps - 1)
        groups[i: i + 2] = [groups[i] + groups[i + 1]]
    lines, acc = [], terms[0]
    for g in groups:
        lines.append(_line(acc, g))
        acc += sum(g)
    if kind == "repeat":
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif kind == "guess":
        lines = lines[: rng.randrange(steps)]
    return "".join(lines) + f"#{sum(terms)}"


def parse_answer(completion: str) -> str | None:
    """The final answer: the digits after the last ``#`` when nothing but whitespace follows them, else None."""
    m = _ANSWER.search(completion)
    return m.group(1) if m else None


def steps_are_clean(completion: str, terms: list[int]) -> bool:
    """Whether the lines before the last ``#`` of ``completion`` are the clean chain of ``terms``
    (:func:`clean_trace`'s lines: ``partial+term=partial'`` for every term after the first, in order),
    a line repeated right after itself counted once. A skipped step (``7+25+3=35;``), a guess (``#``
    before the last step) or a wrong partial sum is not; the final answer is not checked here."""
    at = completion.rfind("#")
    if at < 0:
        return False
    lines = [line.strip() for line in completion[:at].split(";")]
    if lines and lines[-1] == "":
        lines.pop()  # the ";" that closes the last line
    distinct = [line for i, line in enumerate(lines) if i == 0 or line != lines[i - 1]]
    want = clean_trace(terms).split("#")[0].split(";")[:-1]
    return distinct == want


class LengthTestbedTask(IndexedTask):
    """Sums of ``min_terms``-``max_terms`` terms of 1-``max_digits`` digits, scored on the final answer.

    Args:
        split: ``"train"`` (default; no held-out problem), ``"test"`` (distinct held-out
            problems) or ``"all"``.
        size: number of examples (``train``/``all``: independent draws, repeats possible).
        seed: generator seed (Python ``random.Random``).
        min_terms, max_terms: range of the number of terms (2 <= min <= max <= 8 by default).
        max_digits: digits per term drawn uniformly in ``[1, max_digits]`` (1 or 2... up to 4).
        check_steps: score the steps too (:func:`steps_are_clean`; module docstring).

    Raises:
        ValueError: unknown ``split``, ``size`` < 1, bad term or digit ranges, or more test
            problems asked than the generator finds.
    """

    __test__ = False  # not a pytest class
    answer_format = "hash-integer"  # ``#<int>`` at the end (outside base.ANSWER_FORMATS on purpose)

    def __init__(self, split: str = "train", size: int = 10_000, seed: int = 0, min_terms: int = 2,
                 max_terms: int = 8, max_digits: int = 2, check_steps: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown; valid: {list(SPLITS)}")
        for name, v in (("size", size), ("min_terms", min_terms), ("max_terms", max_terms),
                        ("max_digits", max_digits)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got min_terms={min_terms}, max_terms={max_terms}")
        if max_digits > 4:
            raise ValueError(f"max_digits must be <= 4, got {max_digits}")
        if not isinstance(check_steps, bool):
            raise ValueError(f"check_steps must be true or false, got {check_steps!r}")
        self.check_steps = check_steps
        self.name, self.split, self.size, self.seed = "testbed-length", split, size, seed
        self.min_terms, self.max_terms, self.max_digits = min_terms, max_terms, max_digits
        rng = random.Random(f"testbed-length/{seed}")
        items: list[list[int]] = []
        seen: set[str] = set()
        tries = 0
        while len(items) < size:
            tries += 1
            if split == "test" and tries > 100 * HELDOUT_MODULUS * size:
                raise ValueError(f"size={size}: only {len(items)} distinct held-out problems found")
            n = rng.randint(min_terms, max_terms)
            d = rng.randint(1, max_digits)
            terms = [rng.randint(10 ** (d - 1), 10 ** d - 1) for _ in range(n)]
            p = prompt_of(terms)
            held = is_heldout(p)
            if (split == "train" and held) or (split == "test" and (not held or p in seen)):
                continue
            seen.add(p)
            items.append(terms)
        self._items = items

    def __getitem__(self, index: int) -> Example:
        self.check_index(index)
        terms = self._items[index]
        prompt = prompt_of(terms)
        return Example(messages=prompt, question=prompt, answer=str(sum(terms)), task=self.name, index=index,
                       metadata={"terms": list(terms), "n_terms": len(terms), "digits": len(str(terms[0])),
                                 "clean_length": clean_length(terms), "split": self.split})

    def eval_task(self) -> "LengthTestbedTask":
        """The held-out split (512 distinct problems, same seed and ranges), for fixed evaluations."""
        return LengthTestbedTask(split="test", size=512, seed=self.seed, min_terms=self.min_terms,
                                 max_terms=self.max_terms, max_digits=self.max_digits, check_steps=self.check_steps)

    def warmup_target(self, example: Example, rng: random.Random) -> str:
        """A supervised target for ``example``: a trace of a kind drawn from :data:`WARMUP_MIX`."""
        kind = rng.choices(list(WARMUP_MIX), weights=list(WARMUP_MIX.values()))[0]
        return make_trace(example.metadata["terms"], kind, rng)

    def extract(self, completion: str) -> str | None:
        """The final answer (:func:`parse_answer`), or None (no ``#<int>`` at the end, e.g. truncated)."""
        return parse_answer(completion)

    def score(self, completion: str, example: Example) -> float:
        """1.0 if the final answer equals the sum (and, with ``check_steps``, the steps are the
        clean chain: :func:`steps_are_clean`), else 0.0."""
        answer = self.extract(completion)
        if answer is None or int(answer) != int(example.answer):
            return 0.0
        return 1.0 if not self.check_steps or steps_are_clean(completion, example.metadata["terms"]) else 0.0

    def __repr__(self) -> str:
        return (f"LengthTestbedTask(split={self.split!r}, size={self.size}, seed={self.seed}, "
                f"min_terms={self.min_terms}, max_terms={self.max_terms}, max_digits={self.max_digits}, "
                f"check_steps={self.check_steps})")


@register_task("testbed-length")
def _testbed_length(**options: Any) -> LengthTestbedTask:
    """The length testbed task (``split``, ``size``, ``seed``, ``min_terms``, ``max_terms``, ``max_digits``,
    ``check_steps``)."""
    return LengthTestbedTask(**options)
