"""What evaluation's samples estimate: unbiased pass@k, and the check that refuses repeated
greedy samples.

pass@k uses the unbiased estimator of Chen et al. 2021 (Codex, arXiv 2107.03374, Eq. 1): with
n samples per problem of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over
problems.
"""

from __future__ import annotations

import math

__all__ = ["greedy_samples_error", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` correct (Chen et al. 2021, Eq. 1).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def greedy_samples_error(n: int, temperature: float) -> str | None:
    """Why ``n`` samples at ``temperature`` are refused, or None: ``temperature=0`` decodes
    greedily, so every sample of a prompt is the same and ``n > 1`` only repeats the work (and
    makes pass@k for k > 1 equal pass@1). ``echotrain eval`` (``--task`` and ``--suite``) refuses
    an explicit ``--n`` > 1 with ``--temperature 0`` (exit 2) rather than silently resetting it (a documented
    choice: the command line the user wrote is the one that runs); without ``--n`` its default is 1 there."""
    if temperature == 0 and n > 1:
        return (f"temperature=0 (--temperature 0) decodes greedily, so the n={n} samples of a prompt would be "
                "identical; use --n 1, or a temperature > 0 to sample")
    return None
