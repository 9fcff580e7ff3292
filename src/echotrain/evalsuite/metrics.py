"""Per-benchmark accuracy from a correctness matrix: avg@n and unbiased pass@k.

With ``P`` problems and ``n`` samples each, ``correct[i][j]`` in [0, 1] (1 = sample ``j`` of
problem ``i`` is right):

- ``avg@n`` = (1 / (P n)) sum_ij correct[i][j], the expected accuracy of a single sample
  (what DeepSeek-R1 reports as pass@1 over k samples), with its standard error over problems
  ``std_i(mean_j correct[i][j]) / sqrt(P)`` (population std; 0 for P = 1);
- ``pass@k`` = (1 / P) sum_i [1 - C(n - c_i, k) / C(n, k)], ``c_i`` the number of samples with
  ``correct >= 1``: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, Eq. 1), from
  ``echotrain.runtime.sampling_stats.pass_at_k``. ``pass@1`` equals ``avg@n`` for binary scores.
"""

from __future__ import annotations

import math
from typing import Sequence

from echotrain.runtime.sampling_stats import pass_at_k

__all__ = ["accuracy_metrics"]


def accuracy_metrics(correct: Sequence[Sequence[float]], ks: Sequence[int] = (1,)) -> dict[str, float]:
    """avg@n, its standard error and pass@k for each k, from a P x n correctness matrix.

    Args:
        correct: P rows (problems) of n scores in [0, 1], every row the same length n >= 1.
        ks: the k values of pass@k, each in [1, n].

    Returns:
        ``{"num_problems": P, "n": n, "avg@n": ..., "avg@n_stderr": ..., "pass@k": ... for k in
        ks}`` (keys spelled with the numbers, e.g. ``"avg@4"``, ``"pass@1"``).

    Raises:
        ValueError: no problems, ragged rows, a score outside [0, 1] or not finite, or a k
            outside [1, n].
    """
    rows = [list(map(float, r)) for r in correct]
    if not rows:
        raise ValueError("correct is empty: no problems")
    n = len(rows[0])
    if n < 1 or any(len(r) != n for r in rows):
        raise ValueError(f"every problem needs the same number n >= 1 of samples, got lengths "
                         f"{sorted({len(r) for r in rows})}")
    for i, r in enumerate(rows):
        for v in r:
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"correct[{i}] holds {v}; scores must be in [0, 1]")
    for k in ks:
        if not 1 <= int(k) <= n:
            raise ValueError(f"pass@k: k={k} must be in [1, n={n}] (k is at most the samples per problem)")
    P = len(rows)
    means = [sum(r) / n for r in rows]
    avg = sum(means) / P
    std = math.sqrt(sum((m - avg) ** 2 for m in means) / P)
    out: dict[str, float] = {"num_problems": P, "n": n, f"avg@{n}": avg, f"avg@{n}_stderr": std / math.sqrt(P)}
    counts = [sum(1 for v in r if v >= 1.0) for r in rows]
    for k in ks:
        out[f"pass@{int(k)}"] = sum(pass_at_k(n, c, int(k)) for c in counts) / P
    return out
