"""Mathematical equivalence of a predicted and a gold answer, via math-verify.

math-verify (Hugging Face) parses LaTeX / plain expressions into sympy and compares them
(``0.5`` equals ``\\frac{1}{2}``, ``(3, \\pi/2)`` equals ``\\left( 3, \\frac{\\pi}{2} \\right)``).
Its built-in timeouts arm ``SIGALRM`` and raise ``ValueError`` off the main thread, so we call it
with ``parsing_timeout=None`` / ``timeout_seconds=None`` (its documented thread-safe mode) and
bound the time ourselves with ``echotrain.rewards.timeout.call_with_timeout`` (the batched
reward does that for every sample).
"""

from __future__ import annotations

import logging
import re

__all__ = ["math_equal", "normalize_answer"]

_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_WRAPPERS = re.compile(r"^\$+|\$+$")


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its timeout is disabled; we bound the time ourselves (see above).
    Only that message is dropped; its other warnings still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def normalize_answer(text: str) -> str:
    """Light, format-only normalisation before parsing.

    Strips whitespace, surrounding ``$`` and a trailing period, and removes thousands
    separators from plain numbers (``1,000`` -> ``1000``; ``1,2`` is left alone because it is a
    tuple, not a number).
    """
    s, prev = text, None
    while s != prev:  # "$1,000$." -> "1,000"
        prev = s
        s = _WRAPPERS.sub("", s.strip()).strip()
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def _parse(text: str):
    from math_verify import parse

    # Wrapping in \boxed{} makes math-verify read the whole string as the answer.
    return parse("\\boxed{" + text + "}", parsing_timeout=None)


def math_equal(pred: str | None, gold: str, *, float_rounding: int = 6) -> bool:
    """Whether ``pred`` is mathematically equal to ``gold`` (math-verify).

    Identical strings after ``normalize_answer`` are equal without parsing; otherwise both are
    parsed by math-verify (LaTeX or plain expressions) and compared with its ``verify``
    (numbers to ``float_rounding`` decimals, symbolic simplification, sets, intervals, tuples).
    No time limit is applied here (thread-safe mode); wrap the call in ``call_with_timeout``.

    Args:
        pred: the extracted predicted answer; ``None`` or empty is never equal.
        gold: the gold answer (non-empty).
        float_rounding: decimals kept when comparing floats (math-verify's default, 6).

    Returns:
        ``True`` when equivalent. An unparsable ``pred`` gives ``False``.

    Raises:
        TypeError: ``pred`` is not ``str``/``None`` or ``gold`` is not ``str``.
        ValueError: ``gold`` is empty or cannot be parsed (a data error, not a model error).
    """
    if pred is not None and not isinstance(pred, str):
        raise TypeError(f"pred must be a str or None, got {type(pred).__name__}")
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str, got {type(gold).__name__}")
    gold_n = normalize_answer(gold)
    if not gold_n:
        raise ValueError("gold answer is empty")
    if pred is None:
        return False
    pred_n = normalize_answer(pred)
    if not pred_n:
        return False
    if pred_n == gold_n:
        return True
    from math_verify import verify

    gold_parsed = _parse(gold_n)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} could not be parsed by math-verify")
    pred_parsed = _parse(pred_n)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, float_rounding=float_rounding, timeout_seconds=None))
