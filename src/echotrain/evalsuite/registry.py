"""Benchmarks and suites as registrations, and where a benchmark's rows come from.

A :class:`Benchmark` is one entry: a name, a *kind* (which task class scores it: ``"math"`` =
last ``\\boxed{}`` + math-verify, ``"choice"`` = the stated letter), a row normaliser (raw row ->
``{"question", "answer", ...}``), the prompt (system text and user template), where to find
it under a data folder, and its hub default. A suite is a dict ``name -> Benchmark`` in
:data:`SUITES`; adding a benchmark is one :func:`register_benchmark` call.

Sources, in order of precedence (:func:`resolve_source`):

1. an explicit source for the benchmark: a local path (file, or folder holding
   ``test.jsonl``), or ``hf:DATASET[:CONFIG][@SPLIT]`` for the Hugging Face hub;
2. the data folder: the first of ``benchmark.files`` that exists under it (default
   ``<name>/test.jsonl``, then ``<name>.jsonl``);
3. the benchmark's hub default (needs network and ``datasets``).

Every input error is a :class:`SuiteInputError` naming the argument, the benchmark and, for a
malformed row, ``file:line`` (1-based).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from echotrain.registry import Registry

__all__ = [
    "KINDS",
    "SUITES",
    "Benchmark",
    "HubSource",
    "Kind",
    "SuiteInputError",
    "benchmark_names",
    "get_benchmark",
    "load_benchmark_rows",
    "parse_source",
    "register_benchmark",
    "register_kind",
    "resolve_source",
]


class SuiteInputError(ValueError):
    """A bad suite input (unknown suite/benchmark, missing folder/file, malformed row)."""


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face hub dataset: ``load_dataset(path, config, split=split)``."""

    path: str
    config: str | None = None
    split: str = "test"

    def __str__(self) -> str:
        return f"hf:{self.path}" + (f":{self.config}" if self.config else "") + f"@{self.split}"


@dataclass(frozen=True)
class Kind:
    """How a kind of benchmark is scored.

    Attributes:
        build: ``build(name, rows, system, template, verify_timeout_s) -> task`` with the
            ``echotrain.tasks`` task protocol (``extract``, ``score``, ``is_formatted``, items).
        normalize: the default row normaliser for files of this kind given as ``KIND:NAME=PATH``.
    """

    build: Callable[..., Any]
    normalize: Callable[[dict[str, Any]], dict[str, Any]]


#: kind name -> :class:`Kind`; fill it with :func:`register_kind`.
KINDS: Registry[Kind] = Registry("benchmark kind", "kind")


def register_kind(name: str, kind: Kind) -> None:
    """Register a benchmark kind (``"math"``, ``"choice"``).

    Raises:
        ValueError: ``name`` already registered.
    """
    KINDS.register(name)(kind)


@dataclass(frozen=True)
class Benchmark:
    """One evaluation set.

    Attributes:
        name: unique name (``"gsm8k"``); also the default folder under a data dir.
        kind: key of :data:`KINDS` (``"math"`` or ``"choice"``).
        normalize: raw row -> ``{"question": str, "answer": str, ...}`` (choice rows also
            ``"choices"``); raises ``ValueError``/``KeyError`` on a malformed row.
        files: candidate paths relative to a data folder, first existing wins; empty means
            ``(f"{name}/test.jsonl", f"{name}.jsonl")``.
        hub: the hub default, or None.
        system: system prompt; None = the kind's default.
        template: user message, ``str.format`` over the normalized row (``{question}``; choice
            rows also ``{options}``); None = the kind's default.
        description: one line for ``--help`` and docs.
    """

    name: str
    kind: str
    normalize: Callable[[dict[str, Any]], dict[str, Any]]
    files: tuple[str, ...] = ()
    hub: HubSource | None = None
    system: str | None = None
    template: str | None = None
    description: str = ""

    def candidates(self, data_dir: str | Path) -> list[Path]:
        """The paths under ``data_dir`` where this benchmark's file may be."""
        names = self.files or (f"{self.name}/test.jsonl", f"{self.name}.jsonl")
        return [Path(data_dir) / f for f in names]


#: suite name -> its benchmarks (a :class:`~echotrain.registry.Registry`: benchmark name ->
#: :class:`Benchmark`); fill it with :func:`register_benchmark`.
SUITES: Registry[Registry[Benchmark]] = Registry("benchmark suite", "suite")


def register_benchmark(suite: str, benchmark: Benchmark) -> Benchmark:
    """Add ``benchmark`` to ``suite`` (creating the suite). The same benchmark may be in several
    suites; two different benchmarks may not share a name.

    Raises:
        ValueError: unknown kind, or another benchmark already has this name.
    """
    if benchmark.kind not in KINDS:
        raise ValueError(f"benchmark {benchmark.name!r}: unknown kind {benchmark.kind!r}; kinds: {sorted(KINDS)}")
    for members in SUITES.values():
        other = members.get(benchmark.name)
        if other is not None and other is not benchmark:
            raise ValueError(f"a different benchmark named {benchmark.name!r} is already registered")
    if suite not in SUITES:
        SUITES.register(suite)(Registry("benchmark", suite))
    if benchmark.name not in SUITES[suite]:
        SUITES[suite].register(benchmark.name)(benchmark)
    return benchmark


def benchmark_names() -> list[str]:
    """Every registered benchmark name, sorted."""
    return sorted({name for members in SUITES.values() for name in members})


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark ``name``, or one made for a file of a kind: ``"KIND:NAME"``
    (e.g. ``"choice:mysci"``, ``"math:myset"``) uses the kind's normaliser.

    Raises:
        SuiteInputError: unknown name or kind (the message lists the valid ones).
    """
    if ":" in name:
        kind, _, bare = name.partition(":")
        if kind not in KINDS or not bare:
            raise SuiteInputError(f"benchmark {name!r}: a file of a kind is KIND:NAME with KIND one of "
                                  f"{sorted(KINDS)}")
        if bare in benchmark_names():
            raise SuiteInputError(f"benchmark {name!r}: {bare!r} is a registered benchmark; give its file as "
                                  f"{bare}=PATH, or choose another name")
        return Benchmark(name=bare, kind=kind, normalize=KINDS[kind].normalize, description=f"{kind} file")
    for members in SUITES.values():
        if name in members:
            return members[name]
    raise SuiteInputError(f"unknown benchmark {name!r}; registered: {', '.join(benchmark_names())}; "
                          f"or KIND:NAME=PATH with KIND one of {sorted(KINDS)}")


def parse_source(text: str | Path) -> Path | HubSource:
    """``hf:DATASET[:CONFIG][@SPLIT]`` -> :class:`HubSource` (split default ``test``); else a Path."""
    if isinstance(text, str) and text.startswith("hf:"):
        spec = text[3:]
        spec, _, split = spec.partition("@")
        path, _, config = spec.partition(":")
        if not path:
            raise SuiteInputError(f"hub source {text!r} must be hf:DATASET[:CONFIG][@SPLIT]")
        return HubSource(path, config or None, split or "test")
    return Path(text).expanduser()


def resolve_source(benchmark: Benchmark, source: str | Path | None, data_dir: str | Path | None
                   ) -> Path | HubSource:
    """Where ``benchmark``'s rows come from (module docstring for the order).

    Raises:
        SuiteInputError: an explicit path that does not exist (or a folder without
            ``test.jsonl``), a benchmark absent from ``data_dir``, or no source at all.
    """
    if source is not None:
        src = parse_source(source)
        if isinstance(src, HubSource):
            return src
        if src.is_dir():
            for cand in (src / "test.jsonl", src / benchmark.name / "test.jsonl"):
                if cand.is_file():
                    return cand
            raise SuiteInputError(f"benchmark {benchmark.name!r}: folder {str(src)!r} holds no test.jsonl "
                                  f"(give the file itself: {benchmark.name}=FILE.jsonl)")
        if not src.is_file():
            raise SuiteInputError(f"benchmark {benchmark.name!r}: file {str(src)!r} not found")
        return src
    if data_dir is not None:
        for cand in benchmark.candidates(data_dir):
            if cand.is_file():
                return cand
        looked = ", ".join(str(c) for c in benchmark.candidates(data_dir))
        raise SuiteInputError(f"benchmark {benchmark.name!r}: no file under data_dir (--data-dir) {str(data_dir)!r}; "
                              f"looked for {looked}; give its path as {benchmark.name}=PATH")
    if benchmark.hub is not None:
        return benchmark.hub
    raise SuiteInputError(f"benchmark {benchmark.name!r} has no hub default: give data_dir (--data-dir DIR) or "
                          f"its path ({benchmark.name}=PATH)")


def _read_hub(benchmark: Benchmark, src: HubSource) -> list[tuple[int, Any]]:
    try:
        from datasets import load_dataset

        ds = load_dataset(src.path, src.config, split=src.split)
    except Exception as exc:  # offline, gated, renamed: say which benchmark and what to do instead
        raise SuiteInputError(f"benchmark {benchmark.name!r}: could not load {src} ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); offline? give a local file with --data-dir DIR or "
                              f"{benchmark.name}=PATH") from exc
    return [(i + 1, dict(r)) for i, r in enumerate(ds)]


def load_benchmark_rows(benchmark: Benchmark, src: Path | HubSource, *, limit: int | None = None
                        ) -> list[dict[str, Any]]:
    """Read and normalise ``benchmark``'s rows from ``src``; every row is checked, then the
    first ``limit`` are kept (dataset order). Each row gains ``"line"``: its 1-based line in
    the file (row number for hub data).

    Raises:
        SuiteInputError: unreadable file, invalid JSON or a malformed row (``file:line: ...``),
            no rows, or ``limit`` < 1.
    """
    from echotrain.tasks.math_sets import load_jsonl

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SuiteInputError(f"limit (--limit) must be a positive integer or None, got {limit!r}")
    if isinstance(src, HubSource):
        numbered = _read_hub(benchmark, src)
    else:
        try:
            numbered = load_jsonl(src, line_numbers=True)
        except (OSError, ValueError) as exc:
            raise SuiteInputError(f"benchmark {benchmark.name!r}: {exc}") from exc
    rows = []
    for lineno, raw in numbered:
        try:
            if not isinstance(raw, dict):
                raise ValueError(f"a row must be a JSON object, got {type(raw).__name__}")
            row = benchmark.normalize(raw)
        except KeyError as exc:
            raise SuiteInputError(f"{src}:{lineno}: benchmark {benchmark.name!r}: row lacks field {exc.args[0]!r}; "
                                  f"it has {sorted(raw)}") from exc
        except (ValueError, TypeError) as exc:
            raise SuiteInputError(f"{src}:{lineno}: benchmark {benchmark.name!r}: {exc}") from exc
        rows.append({**row, "line": lineno})
    if not rows:
        raise SuiteInputError(f"benchmark {benchmark.name!r}: {src} holds no rows")
    return rows[:limit] if limit is not None else rows
