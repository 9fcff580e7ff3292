"""Run a suite: resolve and load every benchmark, generate in batches, score, write the outputs.

All inputs are checked and every benchmark's rows are loaded before the first token is
generated, so a missing file or a malformed row fails in seconds, not after an hour of
generation. Per benchmark the torch RNG is re-seeded with ``seed``, so a benchmark's samples do
not depend on which other benchmarks ran before it.

Outputs under ``out_dir`` (when given):

- ``samples.jsonl``: one line per sample: ``benchmark, index, line, sample, question, gold,
  completion, extracted, correct, format_ok, response_tokens, truncated``;
- ``summary.json``: the dict that :func:`run_suite` returns.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from echotrain.atomic import atomic_write_json
from echotrain.runtime.cpu_linear import DECODE_LINEARS, DEFAULT_DECODE_LINEAR, linear_backend
from echotrain.runtime.decode import DECODE_LOOPS, DEFAULT_DECODE_LOOP, DEFAULT_SAMPLER, SAMPLERS
from echotrain.evalsuite.metrics import accuracy_metrics
from echotrain.evalsuite.registry import (
    KINDS,
    SUITES,
    Benchmark,
    SuiteInputError,
    get_benchmark,
    load_benchmark_rows,
    resolve_source,
)

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "evaluate_run_dir", "load_suite", "parse_benchmark_spec", "run_suite"]

DEFAULT_MAX_NEW_TOKENS = 1024  # answer cap of a suite run (math solutions need hundreds of tokens)


def parse_benchmark_spec(spec: str) -> tuple[str, str | None]:
    """``"NAME"`` -> (NAME, None); ``"NAME=SOURCE"`` -> (NAME, SOURCE). NAME may be ``KIND:NAME``.

    Raises:
        SuiteInputError: empty name or source.
    """
    name, sep, source = spec.partition("=")
    name, source = name.strip(), source.strip()
    if not name or (sep and not source):
        raise SuiteInputError(f"benchmark spec {spec!r} (--benchmark) must be NAME, NAME=PATH, NAME=hf:DATASET or "
                              f"KIND:NAME=PATH")
    return name, (source if sep else None)


def load_suite(suite: str | None = None, benchmarks: Sequence[str] | Mapping[str, Any] | None = None, *,
               data_dir: str | Path | None = None, limit: int | None = None,
               verify_timeout_s: float | None = 3.0) -> list[tuple[Benchmark, str, Any]]:
    """Resolve, load and check the benchmarks to run, building their tasks.

    Args:
        suite: a key of ``SUITES`` (``"math"``, ``"mc"``) or None.
        benchmarks: extra benchmarks or source overrides: a sequence of specs (``"gsm8k"``,
            ``"gsm8k=PATH"``, ``"aime24=hf:HuggingFaceH4/aime_2024@train"``,
            ``"choice:mysci=rows.jsonl"``) or a mapping name -> source (None = from
            ``data_dir`` or the hub). A name in ``suite`` overrides its source; others are added.
        data_dir: folder holding ``<name>/test.jsonl`` (or ``<name>.jsonl``) files.
        limit: keep the first ``limit`` rows of each benchmark.
        verify_timeout_s: math-verify time limit per comparison (killable worker; math kind).

    Returns:
        ``[(benchmark, source description, task)]`` in suite order, then added ones.

    Raises:
        SuiteInputError: neither suite nor benchmarks, unknown suite/benchmark/kind, a
            ``data_dir`` that is not a folder, a missing file, a malformed row (file:line).
    """
    if suite is None and not benchmarks:
        raise SuiteInputError("nothing to evaluate: give a suite (--suite " + "|".join(sorted(SUITES)) +
                              ") or benchmarks (--benchmark NAME[=PATH])")
    if suite is not None and suite not in SUITES:
        raise SuiteInputError(f"unknown suite {suite!r} (--suite); suites: {', '.join(sorted(SUITES))}")
    if data_dir is not None and not Path(data_dir).expanduser().is_dir():
        raise SuiteInputError(f"data_dir (--data-dir) {str(data_dir)!r} is not a directory")
    data_dir = Path(data_dir).expanduser() if data_dir is not None else None
    wanted: dict[str, tuple[Benchmark, Any]] = {}
    if suite is not None:
        for name, bench in SUITES[suite].items():
            wanted[name] = (bench, None)
    if isinstance(benchmarks, Mapping):
        items = [(str(k), v) for k, v in benchmarks.items()]
    else:
        items = [parse_benchmark_spec(s) for s in (benchmarks or [])]
    seen: set[str] = set()
    for key, source in items:
        bench = get_benchmark(key)
        if bench.name in seen:
            raise SuiteInputError(f"benchmark {bench.name!r} is given twice (--benchmark)")
        seen.add(bench.name)
        wanted[bench.name] = (bench, source)
    out = []
    for bench, source in wanted.values():
        src = resolve_source(bench, source, data_dir)
        rows = load_benchmark_rows(bench, src, limit=limit)
        try:
            task = KINDS[bench.kind].build(bench.name, rows, bench.system, bench.template, verify_timeout_s)
        except (KeyError, ValueError) as exc:
            raise SuiteInputError(f"benchmark {bench.name!r}: {exc}") from exc
        out.append((bench, str(src), task))
    return out


def _check_settings(n: int, ks: Sequence[int], temperature: float, top_p: float, max_new_tokens: int,
                    batch_size: int, decode_loop: str = DEFAULT_DECODE_LOOP, sampler: str = DEFAULT_SAMPLER,
                    decode_linear: str = DEFAULT_DECODE_LINEAR) -> None:
    def positive_int(value: Any, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SuiteInputError(f"{what} must be a positive integer, got {value!r}")

    positive_int(n, "n (--n)")
    positive_int(max_new_tokens, "max_new_tokens (--max-new-tokens)")
    positive_int(batch_size, "batch_size (--batch-size)")
    if not ks:
        raise SuiteInputError("ks (--k) must name at least one k")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise SuiteInputError(f"ks (--k): every k must be an integer in [1, n={n}], got {list(ks)}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SuiteInputError(f"temperature (--temperature) must be >= 0 (0 = greedy), got {temperature!r}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SuiteInputError(f"top_p (--top-p) must be in (0, 1], got {top_p!r}")
    if decode_loop not in DECODE_LOOPS:
        raise SuiteInputError(f"decode_loop (--decode-loop) must be one of {', '.join(DECODE_LOOPS)}, got {decode_loop!r}")
    if sampler not in SAMPLERS:
        raise SuiteInputError(f"sampler (--sampler) must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    if decode_linear not in DECODE_LINEARS:
        raise SuiteInputError(f"decode_linear (--decode-linear) must be one of {', '.join(DECODE_LINEARS)}, "
                              f"got {decode_linear!r}")
    from echotrain.runtime.sampling_stats import greedy_samples_error

    greedy = greedy_samples_error(n, temperature)
    if greedy:
        raise SuiteInputError(greedy)


_SETTING_KEYS = ("n", "ks", "temperature", "top_p", "max_new_tokens", "batch_size", "seed", "limit",
                 "verify_timeout_s", "data_dir", "decode_loop", "sampler")


def _settings(*, n: int, ks: Sequence[int], temperature: float, top_p: float, max_new_tokens: int,
              batch_size: int, seed: int, limit: int | None, verify_timeout_s: float | None,
              data_dir: str | Path | None, decode_loop: str, sampler: str) -> dict[str, Any]:
    """The settings block of a summary (what makes two evaluations the same evaluation)."""
    return {"n": n, "ks": [int(k) for k in ks], "temperature": float(temperature), "top_p": float(top_p),
            "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed, "limit": limit,
            "verify_timeout_s": verify_timeout_s, "data_dir": str(data_dir) if data_dir is not None else None,
            "decode_loop": decode_loop, "sampler": sampler}


def _evaluate_task(model: Any, tokenizer: Any, bench: Benchmark, task: Any, *, n: int, ks: Sequence[int],
                   temperature: float, top_p: float, max_new_tokens: int, batch_size: int, seed: int,
                   write: Callable[[dict[str, Any]], None], advance: Callable[[int, float], None],
                   decode_loop: str, sampler: str, decode_linear: str) -> dict[str, Any]:
    import torch

    from echotrain.rewards import RewardFunction
    from echotrain.runtime.rollout import generate_rollouts

    reward_fn = RewardFunction(task)
    torch.manual_seed(seed)
    examples = list(task)
    correct: list[list[float]] = []
    n_format = n_trunc = 0
    tokens = 0.0
    for start in range(0, len(examples), batch_size):
        exs = examples[start:start + batch_size]
        batch = generate_rollouts(model, tokenizer, [e.messages for e in exs], n, max_new_tokens=max_new_tokens,
                                  temperature=temperature if temperature > 0 else 1.0, top_p=top_p,
                                  do_sample=temperature > 0, record_log_prob=False, decode_loop=decode_loop,
                                  sampler=sampler, decode_linear=decode_linear)
        texts = [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(batch.response_ids, batch.response_mask)]
        flat = [e for e in exs for _ in range(n)]
        _, info = reward_fn(texts, flat)
        lengths = batch.response_length.tolist()
        truncated = batch.truncated.tolist()
        for i, (text, ex) in enumerate(zip(texts, flat)):
            ok = float(info["correct"][i])
            write({"benchmark": bench.name, "index": ex.index, "line": ex.metadata.get("line"), "sample": i % n,
                   "question": ex.question, "gold": ex.answer, "completion": text,
                   "extracted": _safe_extract(task, text), "correct": ok,
                   "format_ok": bool(info["format_ok"][i]), "response_tokens": int(lengths[i]),
                   "truncated": bool(truncated[i])})
        scores = info["correct"].view(len(exs), n).tolist()
        correct.extend(scores)
        n_format += int(info["n_format_ok"])
        n_trunc += int(sum(truncated))
        tokens += float(sum(lengths))
        advance(len(exs), sum(map(sum, correct)) / (len(correct) * n))
    total = len(examples) * n
    out: dict[str, Any] = accuracy_metrics(correct, ks)
    out.update(format_rate=n_format / total, mean_response_tokens=tokens / total, truncated_rate=n_trunc / total,
               n_timeouts=reward_fn.total_timeouts, n_exceptions=reward_fn.total_exceptions)
    return out


def _safe_extract(task: Any, text: str) -> str | None:
    try:
        return task.extract(text)
    except Exception:  # extraction is pure string work; never lose a sample record over it
        return None


def run_suite(model: Any, tokenizer: Any, suite: str | None = "math", *,
              benchmarks: Sequence[str] | Mapping[str, Any] | None = None, data_dir: str | Path | None = None,
              limit: int | None = None, n: int = 1, ks: Sequence[int] = (1,), temperature: float = 0.0,
              top_p: float = 1.0, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = 8, seed: int = 1234,
              out_dir: str | Path | None = None, progress: bool = False, verify_timeout_s: float | None = 3.0,
              model_name: str | None = None, decode_loop: str = DEFAULT_DECODE_LOOP,
              sampler: str = DEFAULT_SAMPLER, decode_linear: str = DEFAULT_DECODE_LINEAR) -> dict[str, Any]:
    """Evaluate ``model`` on every benchmark of a suite; the Python entry point (and the hook
    that ``echotrain compare`` calls at the end of a cell).

    Args:
        model, tokenizer: a causal LM with ``generate`` and its tokenizer (chat template used).
        suite: ``"math"`` (GSM8K, MATH-500, AIME24, AMC23, Minerva Math, OlympiadBench), ``"mc"``
            (GPQA, MMLU-Pro, ARC-Challenge) or None (then ``benchmarks`` only).
        benchmarks: specs or a mapping name -> source, see :func:`load_suite`.
        data_dir: folder of ``<name>/test.jsonl`` files; None = explicit sources or hub defaults.
        limit: first ``limit`` problems of each benchmark (None = all).
        n: samples per problem (the n of avg@n).
        ks: k values of unbiased pass@k, each in [1, n].
        temperature: sampling temperature; 0 = greedy (then n must be 1).
        top_p: nucleus sampling mass in (0, 1].
        max_new_tokens: response length cap in tokens.
        batch_size: problems per ``generate`` call (each with its n samples, KV cache shared).
        seed: torch seed, set again at the start of each benchmark.
        out_dir: where to write ``samples.jsonl`` and ``summary.json`` (created); None = no files.
        progress: show a tqdm progress bar on stderr (problems done, running accuracy).
        verify_timeout_s: math-verify limit per comparison (worker killed on overrun).
        model_name: recorded in the summary (default: the model's ``name_or_path``).
        decode_loop, sampler: how tokens are generated, as the trainer's keys of those names
            (:func:`echotrain.runtime.rollout.generate_rollouts`); recorded in ``settings``.
        decode_linear: how the float32 linear layers run on a CPU while generating, as the
            trainer's key (:mod:`echotrain.runtime.cpu_linear`); like the thread count, it changes
            results by float rounding only, so it is not among ``settings``.

    Returns:
        The summary: ``{"suite", "model", "settings": {...}, "benchmarks": {name: {"num_problems",
        "n", "avg@n", "avg@n_stderr", "pass@k"..., "format_rate", "mean_response_tokens",
        "truncated_rate", "n_timeouts", "n_exceptions", "source", "seconds"}}, "average":
        {"avg@n": ..., "pass@k": ...} (unweighted mean over benchmarks), "seconds", "files"}``.

    Raises:
        SuiteInputError (a ValueError): any bad input, before generation starts.
    """
    _check_settings(n, ks, float(temperature), float(top_p), max_new_tokens, batch_size, decode_loop, sampler,
                    decode_linear)
    loaded = load_suite(suite, benchmarks, data_dir=data_dir, limit=limit, verify_timeout_s=verify_timeout_s)
    settings = _settings(n=n, ks=ks, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                         batch_size=batch_size, seed=seed, limit=limit, verify_timeout_s=verify_timeout_s,
                         data_dir=data_dir, decode_loop=decode_loop, sampler=sampler)
    summary: dict[str, Any] = {
        "suite": suite or "custom",
        "model": model_name or getattr(model, "name_or_path", None) or type(model).__name__,
        "settings": settings, "benchmarks": {}, "average": {}, "seconds": 0.0, "files": {}}
    sample_file = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary["files"] = {"samples": str(out / "samples.jsonl"), "summary": str(out / "summary.json")}
        sample_file = (out / "samples.jsonl").open("w", encoding="utf-8")

    def write(record: dict[str, Any]) -> None:
        if sample_file is not None:
            sample_file.write(json.dumps(record, ensure_ascii=False) + "\n")

    from tqdm.auto import tqdm

    bar = tqdm(total=sum(len(task) for _, _, task in loaded), unit="problem", disable=not progress,
               file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
    t_all = time.perf_counter()
    try:
        with linear_backend(model, decode_linear):  # one context: weights packed once for all benchmarks
            for bench, source, task in loaded:
                bar.set_description(bench.name)
                t0 = time.perf_counter()

                def advance(k: int, acc: float) -> None:
                    bar.update(k)
                    bar.set_postfix(acc=f"{acc:.3f}", refresh=False)

                res = _evaluate_task(model, tokenizer, bench, task, n=n, ks=ks, temperature=float(temperature),
                                     top_p=float(top_p), max_new_tokens=max_new_tokens, batch_size=batch_size,
                                     seed=seed, write=write, advance=advance, decode_loop=decode_loop,
                                     sampler=sampler, decode_linear=decode_linear)
                res.update(source=source, seconds=time.perf_counter() - t0)
                summary["benchmarks"][bench.name] = res
                if sample_file is not None:
                    sample_file.flush()
    finally:
        bar.close()
        if sample_file is not None:
            sample_file.close()
    per = list(summary["benchmarks"].values())
    for key in [f"avg@{n}"] + [f"pass@{k}" for k in ks]:
        summary["average"][key] = sum(r[key] for r in per) / len(per)
    summary["seconds"] = time.perf_counter() - t_all
    if out_dir is not None:
        atomic_write_json(Path(out_dir) / "summary.json", summary)
    return summary


def evaluate_run_dir(run_dir: str | Path, suite: str | None = "math", *, out_dir: str | Path | None = None,
                     skip_existing: bool = True, device: str = "cpu", **kwargs: Any) -> dict[str, Any]:
    """Run a suite on a finished ``echotrain train`` run directory (its ``final_model`` or latest
    checkpoint, as ``echotrain eval --model RUN_DIR`` loads it), generating as the run did: its
    ``decode_loop`` and ``sampler`` unless given in ``kwargs``.

    Writes ``<run_dir>/suite/<suite>/{samples.jsonl,summary.json}`` unless ``out_dir`` is given.
    With ``skip_existing``, a ``summary.json`` already there whose ``settings`` and benchmark
    sources match this call is returned without loading the model (so a re-invoked comparison does
    not evaluate a cell twice).

    Args:
        run_dir: the run directory.
        suite, **kwargs: as :func:`run_suite` (``benchmarks``, ``data_dir``, ``limit``, ``n``, ...).
        device: where to load the model.

    Raises:
        SuiteInputError: bad suite inputs (checked before the model is loaded).
        FileNotFoundError: a run directory without a model or checkpoint.
    """
    import inspect

    from echotrain.runtime.loading import generation_settings

    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "suite" / (suite or "custom")
    loaded = load_suite(suite, kwargs.get("benchmarks"), data_dir=kwargs.get("data_dir"), limit=kwargs.get("limit"))
    kwargs.update(generation_settings(str(run_dir), kwargs.get("decode_loop"), kwargs.get("sampler"))[0])
    if skip_existing and (out / "summary.json").is_file():
        defaults = {k: p.default for k, p in inspect.signature(run_suite).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        wanted = {**defaults, **kwargs}
        settings = json.loads(json.dumps(_settings(**{k: wanted[k] for k in _SETTING_KEYS})))
        old = json.loads((out / "summary.json").read_text())
        sources = [src for _, src, _ in loaded]
        if old.get("settings") == settings and [r.get("source") for r in old.get("benchmarks", {}).values()] == sources:
            return old
    from echotrain.runtime.loading import load_for_eval

    model, tokenizer, desc = load_for_eval(str(run_dir), device=device)
    kwargs.setdefault("model_name", desc)
    return run_suite(model, tokenizer, suite, out_dir=out, **kwargs)
