"""math-verify equivalence, including off the main thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from echotrain.rewards import math_equal
from echotrain.rewards.math import canonical_number, normalize_answer


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{1}{2}", "0.5", True),
        ("1,000", "1000", True),  # thousands separator
        ("1000", "1,000", True),
        ("114,200", "114200", True),
        (r"\frac{1}{3}", "1/3", True),
        ("x+1", "1+x", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)", True),
        ("18.0", "18", True),
        ("$18$.", "18", True),
        ("2", "3", False),
        ("0.33", r"\frac{1}{3}", False),
        ("1,2", "12", False),  # a tuple, not a thousands separator
        (None, "5", False),  # no answer
        ("", "5", False),
        ("banana", "5", False),
    ],
)
def test_math_equal(pred, gold, expected):
    assert math_equal(pred, gold) is expected


@pytest.mark.parametrize(
    ("text", "expected"), [(" $1,000$. ", "1000"), ("1,2", "1,2"), ("-12,345.5", "-12345.5"), ("3.", "3")]
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_bad_gold_is_a_clear_error():
    with pytest.raises(ValueError, match="gold answer is empty"):
        math_equal("1", "  ")
    with pytest.raises(TypeError, match="gold must be a str"):
        math_equal("1", 1)
    with pytest.raises(TypeError, match="pred must be a str or None"):
        math_equal(1, "1")


def test_math_equal_in_worker_threads():
    """math-verify's default SIGALRM timeout raises ValueError off the main thread; ours must not."""
    cases = [("0.5", r"\frac{1}{2}", True), ("1,000", "1000", True), ("2", "3", False), ("x+1", "1+x", True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: math_equal(c[0], c[1]), cases))
    assert results == [c[2] for c in cases]


# Issue 9 case 6: one canonical form per plain number (scientific notation, trailing zeros,
# thousands separators, leading '+'); true and false pairs.
@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("1e-3", "0.001", True),
        ("0.001", "1E-3", True),
        ("1.0e3", "1000", True),
        ("1e3", "1,000", True),
        ("2.50e+2", "250", True),
        ("+5", "5", True),
        ("1.500", "1.5", True),
        ("-0", "0", True),
        (".5", r"\frac{1}{2}", True),
        (r"1 \times 10^{-3}", "0.001", True),  # LaTeX form: math-verify evaluates it
        ("1e-3", "0.01", False),
        ("1e3", "100", False),
        ("1.0e3", "1001", False),
        ("+5", "-5", False),
        ("1,000", "100", False),
        ("1e-7", "0", False),  # no float rounding to zero
        ("1e100", "1e101", False),
    ],
)
def test_math_equal_numeric_normalisation(pred, gold, expected):
    assert math_equal(pred, gold) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1e-3", "0.001"), ("0.0010", "0.001"), ("1.0E3", "1000"), ("+1,000", "1000"), ("-0.0", "0"),
     ("1e100", "1E+100"), ("1,2", "1,2"), ("12,34", "12,34"), ("e5", "e5"), ("x+1", "x+1")],
)
def test_normalize_answer_canonical_numbers(text, expected):
    assert normalize_answer(text) == expected


def test_canonical_number_is_exact_beyond_28_digits():
    """Review: Decimal.normalize() rounded to the context's 28 significant digits, so two different
    31-digit integers had one canonical form and math_equal called them equal."""
    a, b = "1234567890123456789012345678901", "1234567890123456789012345678902"
    assert canonical_number(a) == a and canonical_number(b) == b
    assert math_equal(a, b) is False
    assert canonical_number("0.12345678901234567890123456789010") == "0.1234567890123456789012345678901"
    assert canonical_number("1234567890123456789012345678901.000") == a


def test_canonical_number_huge_exponents_neither_raise_nor_round():
    """Review: normalize() raised decimal.Overflow on 1e9999999 and turned 1e-9999999 into 0."""
    assert canonical_number("1e9999999") == "1E+9999999"
    assert canonical_number("10e9999998") == "1E+9999999"
    assert canonical_number("1e-9999999") == "1E-9999999"
    assert normalize_answer("1e-9999999") != normalize_answer("0")
