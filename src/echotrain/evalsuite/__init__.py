"""echotrain.evalsuite: benchmark suites (``echotrain eval --suite math``) and their Python API.

Public API
----------
``run_suite(model, tokenizer, suite="math", *, benchmarks=None, data_dir=None, limit=None, n=1,
ks=(1,), temperature=0.0, top_p=1.0, max_new_tokens=1024, batch_size=8, seed=1234, out_dir=None,
progress=False, verify_timeout_s=3.0, model_name=None, decode_loop="echotrain", sampler="inverse_cdf") -> dict``
    Generate ``n`` samples per problem in batches, score them with the project's rewards (last
    ``\\boxed{}`` + math-verify in a killable worker for math; the stated letter for multiple
    choice), and return the summary: per benchmark ``avg@n`` (+ standard error), unbiased
    ``pass@k``, format rate, mean response tokens, truncation rate; their unweighted average.
    With ``out_dir`` it writes ``samples.jsonl`` (one line per sample) and ``summary.json``.
``evaluate_run_dir(run_dir, suite="math", *, out_dir=None, skip_existing=True, device="cpu",
**run_suite_kwargs) -> dict``
    The same on a finished ``echotrain train`` run directory, written to
    ``<run_dir>/suite/<suite>/``, generating with the run's ``decode_loop`` and ``sampler``
    unless given; an existing summary with the same settings is returned as is.
``load_suite(suite, benchmarks, *, data_dir, limit)``: resolve and check inputs only.
``accuracy_metrics(correct, ks)``: avg@n / pass@k of a P x n correctness matrix.
``extract_choice_letter(text, num_choices=26)``, ``normalize_choice_row(row)``, ``ChoiceTask``.

Registration: ``SUITES`` (suite -> {name -> Benchmark}), ``register_benchmark(suite,
Benchmark(name, kind, normalize, ...))``, ``KINDS`` / ``register_kind`` (``"math"``,
``"choice"``). Bad inputs raise ``SuiteInputError`` (a ``ValueError``) naming the argument;
malformed rows name ``file:line`` (1-based). See ``docs/evaluation.md``.
"""

from __future__ import annotations

from echotrain.evalsuite import benchmarks as _builtin  # noqa: F401  (registers the built-in suites)
from echotrain.evalsuite.choice import ChoiceTask, extract_choice_letter, normalize_choice_row
from echotrain.evalsuite.metrics import accuracy_metrics
from echotrain.evalsuite.registry import (
    KINDS,
    SUITES,
    Benchmark,
    HubSource,
    Kind,
    SuiteInputError,
    benchmark_names,
    get_benchmark,
    register_benchmark,
    register_kind,
)
from echotrain.evalsuite.runner import evaluate_run_dir, load_suite, run_suite

__all__ = [
    "KINDS",
    "SUITES",
    "Benchmark",
    "ChoiceTask",
    "HubSource",
    "Kind",
    "SuiteInputError",
    "accuracy_metrics",
    "benchmark_names",
    "evaluate_run_dir",
    "extract_choice_letter",
    "get_benchmark",
    "load_suite",
    "normalize_choice_row",
    "register_benchmark",
    "register_kind",
    "run_suite",
]
