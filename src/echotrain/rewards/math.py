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
from decimal import Decimal, InvalidOperation

__all__ = ["canonical_number", "math_equal", "normalize_answer"]

# a plain decimal number: sign, digits (optionally in thousands groups), fraction, exponent
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?(?:[eE][-+]?\d+)?")
_MAX_EXPONENT = 50  # |exponent| beyond this: not expanded into digits (kept as canonical 1E+N)
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

    Strips whitespace, surrounding ``$`` and a trailing period. A plain decimal number is then
    rewritten in one canonical form (:func:`canonical_number`): thousands separators removed
    (``1,000`` -> ``1000``; ``1,2`` is left alone: a tuple, not a number), scientific notation
    expanded (``1e-3`` -> ``0.001``, ``1.0E3`` -> ``1000``), trailing fractional zeros and a
    leading ``+`` dropped (``18.0`` -> ``18``, ``+5`` -> ``5``, ``-0`` -> ``0``). LaTeX forms
    (``1 \\times 10^{-3}``) are left to math-verify, which evaluates them.
    """
    s, prev = text, None
    while s != prev:  # "$1,000$." -> "1,000"
        prev = s
        s = _WRAPPERS.sub("", s.strip()).strip()
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1]
    return canonical_number(s) or s


def canonical_number(text: str) -> str | None:
    """The canonical decimal form of a plain number, or None when ``text`` is not one.

    A plain number is an optional sign, digits (optionally grouped by commas in threes: ``1,000``,
    ``-12,345.5``), an optional fraction and an optional exponent (``e``/``E``). The canonical
    form has no sign for non-negative values, no exponent, no trailing fractional zeros and no
    thousands separators, so every spelling of one value gives one string: ``1e-3``, ``0.0010``,
    ``.001`` -> ``0.001``; ``1.0e3``, ``+1,000``, ``1000.`` -> ``1000``. Values with an exponent
    beyond +-50 keep the form ``1E+100`` (no 100-digit strings). Exact (``decimal``), no float
    rounding.
    """
    if not _PLAIN_NUMBER.fullmatch(text) or not any(c.isdigit() for c in text.split("e")[0].split("E")[0]):
        return None
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value.is_zero():
        return "0"
    # trailing zeros stripped by hand: Decimal.normalize() rounds to the context's 28 digits and
    # overflows/underflows beyond its exponent range (1e9999999 raised, 1e-9999999 became 0)
    sign, digits, exp = value.as_tuple()
    while len(digits) > 1 and digits[-1] == 0:
        digits, exp = digits[:-1], exp + 1
    value = Decimal((sign, digits, exp))
    if abs(value.adjusted()) > _MAX_EXPONENT:
        return str(value)
    return format(value, "f")


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
