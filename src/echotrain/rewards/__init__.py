"""echotrain.rewards: answer extraction, math equivalence and safe batched reward calls.

Public API
----------
Extraction (``rewards/extract.py``; pure string functions):
    ``extract_answer_tag(text) -> str | None``  content of the LAST ``<answer>...</answer>``.
    ``extract_boxed(text) -> str | None``       content of the LAST ``\\boxed{...}`` or
                                                ``\\fbox{...}``, brace-balanced (nested braces
                                                as in ``\\boxed{\\frac{1}{3}}`` kept whole).
    Both return ``None`` when no answer is present; there is no "any number in the text"
    fallback, so an answer-less completion scores 0.

Equivalence (``rewards/math.py``):
    ``math_equal(pred, gold) -> bool``  math-verify equivalence (``0.5 == \\frac{1}{2}``,
        ``1,000 == 1000``). math-verify's own timeouts use SIGALRM, which fails off the main
        thread, so we call it with them disabled and bound the time with ``call_with_timeout``.

Timeouts (``rewards/timeout.py``):
    ``call_with_timeout(fn, *args, timeout_s, **kwargs)`` runs ``fn`` and raises
    ``RewardTimeout`` after ``timeout_s`` seconds; works on the main thread (SIGALRM interval
    timer, interrupts the work) and in worker threads (the call runs in a daemon thread that is
    told to stop on timeout with an asynchronous exception; best effort).

Process isolation (``rewards/isolated.py``):
    ``call_isolated(fn, *args, timeout_s, **kwargs)`` runs a picklable module-level ``fn`` in a
    long-lived worker process that is killed (and restarted on the next call) when it overruns:
    the only limit that also stops work stuck inside C code holding the GIL (sympy on
    ``9^{9^{9^{9}}}``). ``JsonlMathTask.score`` runs math-verify this way (3 s per comparison).

Batched rewards (``rewards/batch.py``):
    ``RewardFunction(task, *, timeout_s=5.0, format_weight=0.0)``; calling it with
    ``(completions: list[str], examples: list[Example])`` returns
    ``(rewards: FloatTensor (B,), info: dict)``. ``rewards = correct + format_weight *
    format_ok`` (binary correctness by default). ``info`` holds ``correct`` (float32 (B,)),
    ``format_ok`` (bool (B,)), ``n_timeouts``, ``n_exceptions``, ``n_format_ok`` (ints),
    ``accuracy`` and ``format_rate`` (floats in [0, 1]). A timeout or an exception scores 0 for
    that sample, is counted in ``info`` and logged (logger ``echotrain.rewards``); it never
    stops the run.
    ``score_batch(completions, examples, score_fn, *, format_fn=None, format_weight=0.0,
    timeout_s=5.0)`` is the same as a function of plain callables.
"""

from __future__ import annotations

from echotrain.rewards.batch import RewardFunction, score_batch
from echotrain.rewards.extract import extract_answer_tag, extract_boxed
from echotrain.rewards.isolated import IsolatedWorker, call_isolated
from echotrain.rewards.math import math_equal
from echotrain.rewards.timeout import RewardTimeout, call_with_timeout

__all__ = [
    "IsolatedWorker",
    "RewardFunction",
    "RewardTimeout",
    "call_isolated",
    "call_with_timeout",
    "extract_answer_tag",
    "extract_boxed",
    "math_equal",
    "score_batch",
]
