"""avg@n, its standard error and unbiased pass@k against hand computations."""

from __future__ import annotations

import math

import pytest

from echotrain.evalsuite import accuracy_metrics


def test_accuracy_metrics_hand_computed():
    correct = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    m = accuracy_metrics(correct, ks=(1, 2, 4))
    assert m["num_problems"] == 3 and m["n"] == 4
    assert m["avg@4"] == pytest.approx(6 / 12)
    # per-problem means 0.5, 0, 1: population std sqrt(1/6), over sqrt(3) problems
    assert m["avg@4_stderr"] == pytest.approx(math.sqrt(1 / 6) / math.sqrt(3))
    assert m["pass@1"] == pytest.approx(0.5)  # = avg@n for binary scores
    # problem 1: c=2 of 4 -> 1 - C(2,2)/C(4,2) = 5/6; problem 2: 0; problem 3: 1
    assert m["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)  # any of 4 right: problems 1 and 3


def test_accuracy_metrics_single_sample_and_partial_scores():
    m = accuracy_metrics([[1], [0], [0], [1]], ks=(1,))
    assert m["avg@1"] == 0.5 and m["pass@1"] == 0.5 and m["avg@1_stderr"] == pytest.approx(0.5 / 2)
    # a partial score counts in avg@n but not as a pass (pass needs a score >= 1)
    m = accuracy_metrics([[0.5, 1.0]], ks=(1, 2))
    assert m["avg@2"] == 0.75 and m["pass@1"] == 0.5 and m["pass@2"] == 1.0 and m["avg@2_stderr"] == 0.0


@pytest.mark.parametrize("correct, ks, match", [
    ([], (1,), "no problems"),
    ([[1, 0], [1]], (1,), "same number"),
    ([[1, 2]], (1,), r"scores must be in \[0, 1\]"),
    ([[1, float("nan")]], (1,), r"scores must be in \[0, 1\]"),
    ([[1, 0]], (3,), r"k=3 must be in \[1, n=2\]"),
    ([[1, 0]], (0,), r"k=0 must be in \[1, n=2\]"),
])
def test_accuracy_metrics_errors(correct, ks, match):
    with pytest.raises(ValueError, match=match):
        accuracy_metrics(correct, ks)
