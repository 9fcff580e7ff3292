"""The metric schema: every metric echotrain writes is declared once, where it is produced.

A declaration (:func:`declare_metric`) gives a metric's name, how it is reduced, its unit, a
one-line meaning, the plot panel it is drawn on and whether the terminal summary shows it. The
trainer reduces each key of a loss's (or the update's) metrics by its declaration; the
``metrics.jsonl`` documentation (``docs/metrics.md``, :func:`markdown_table`), the terminal
summary, ``plots/summary.png`` and the compare report's curves are read from :data:`METRICS`, so
a new metric is one call in its own module::

    from echotrain.metrics import declare_metric

    MY_FRAC = declare_metric("pg_my_frac", reduce="token_mean", unit="fraction of tokens",
                             help="share of tokens my loss rescaled", panel="Clip fractions")

and a policy loss lists the metrics it returns in its registration
(``register_policy_loss(name, metrics=[MY_FRAC])``). A key the trainer receives without a
declaration is an error (:class:`StepMetrics` and :func:`reduce_updates` name it), never a silent default.

Reductions (:data:`REDUCTIONS`), over the micro-batches and data-parallel ranks of one optimizer
step and then over the optimizer steps of one training step:

- ``token_mean``: weighted by each micro-batch's valid tokens (the step's token mean), then the
  mean over optimizer steps;
- ``mean``: one value per optimizer step (the same in every micro-batch, e.g. ECHO's R), then
  the mean over optimizer steps;
- ``min`` / ``max`` / ``sum``: over micro-batches, ranks and optimizer steps;
- ``last``: the last optimizer step's value (the learning rate);
- ``step``: one value per training step, computed from the whole step's batch (no reduction).

``of=`` makes a metric a reduction of another one's per-optimizer-step values
(``echo/R_batch_min`` is ``reduce="min", of="echo/R_batch"``). This module imports nothing
from echotrain but the registry, so every layer can declare its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from echotrain.registry import Registry

#: reduction name -> what it does (see the module docstring)
REDUCTIONS: dict[str, str] = {
    "token_mean": "token-weighted mean over micro-batches and ranks; mean over optimizer steps",
    "mean": "one value per optimizer step; mean over optimizer steps",
    "min": "minimum over micro-batches, ranks and optimizer steps",
    "max": "maximum over micro-batches, ranks and optimizer steps",
    "sum": "sum over micro-batches, ranks and optimizer steps",
    "last": "value of the last optimizer step",
    "step": "one value per training step (from the whole batch)",
}

#: the files a metric is written to: ``metrics`` (metrics.jsonl, every step) or ``eval``
#: (eval.jsonl, on evaluation steps; also in metrics.jsonl on those steps)
FILES = ("metrics", "eval")


@dataclass(frozen=True)
class Metric:
    """One declared metric (see :func:`declare_metric` for the fields)."""

    name: str
    reduce: str
    unit: str
    help: str
    panel: str | None = None
    label: str | None = None
    summary: bool = False
    of: str | None = None
    when: str = ""
    file: str = "metrics"
    volatile: bool = False

    @property
    def short(self) -> str:
        """The legend label: ``label`` or the name."""
        return self.label or self.name


#: metric name -> :class:`Metric`, in declaration order (the order of the docs' list)
METRICS: Registry[Metric] = Registry("metric", "metric")
#: ``plots/summary.png`` panel titles in drawing order (a panel first named by a declaration is
#: appended); the terminal summary lists its metrics in this order too
PANELS: Registry[None] = Registry("plot panel", "panel")


def declare_panel(title: str) -> str:
    """Add panel ``title`` to :data:`PANELS` (after those declared so far) and return it; a no-op
    when it exists."""
    if title not in PANELS:
        PANELS.register(title)(None)
    return title


for _title in ("Accuracy", "Reward", "Entropy", "Response length", "Truncated responses", "Policy drift",
               "Clip fractions", "ECHO batch ratio", "ECHO batch clip", "Gradient norm", "Step time"):
    declare_panel(_title)


def declare_metric(name: str, *, reduce: str, unit: str, help: str, panel: str | None = None,
                   label: str | None = None, summary: bool = False, of: str | None = None, when: str = "",
                   file: str = "metrics", volatile: bool = False) -> Metric:
    """Declare metric ``name`` (once, in the module that produces it) and return its :class:`Metric`.

    Args:
        name: the key in ``metrics.jsonl`` (``"pg_clipfrac"``, ``"echo/R_batch"``).
        reduce: one of :data:`REDUCTIONS`.
        unit: the y-axis unit (``"fraction of tokens"``, ``"nats per token"``, ``"seconds"``).
        help: one line saying what it measures (the docs' metric list, the compare report title).
        panel: the ``plots/summary.png`` panel it is drawn on (metrics sharing a panel share its
            y axis; the panel's unit is its first metric's), or None (not plotted). The compare
            report draws every metric that has a panel.
        label: the legend label (default: the name).
        summary: shown in the terminal summary table at the end of a run.
        of: with ``min`` / ``max`` / ``sum`` / ``mean``: reduce this other metric's per-optimizer-step
            values instead of values returned under ``name``.
        when: when it is written, for the docs (``"loss_mode=echo"``, ``"kl_coef > 0"``); empty
            for every step of every run.
        file: ``"metrics"`` or ``"eval"`` (eval.jsonl, see :data:`FILES`).
        volatile: depends on wall time or the machine, not on the computation (excluded when
            comparing runs for determinism).

    Raises:
        ValueError: unknown ``reduce`` or ``file``, ``of`` naming an undeclared metric, or
            ``name`` already declared differently (an identical re-declaration returns the
            existing one, so a module may be imported twice, e.g. a plugin file).
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric {name!r}: reduce={reduce!r} is unknown; valid: {list(REDUCTIONS)}")
    if file not in FILES:
        raise ValueError(f"metric {name!r}: file={file!r} is unknown; valid: {list(FILES)}")
    if of is not None and of not in METRICS:
        raise ValueError(f"metric {name!r}: of={of!r} is not a declared metric")
    metric = Metric(name, reduce, unit, help, panel, label, summary, of, when, file, volatile)
    if name in METRICS:
        if METRICS[name] == metric:
            return METRICS[name]
        raise ValueError(f"metric {name!r} is already declared differently: {METRICS[name]}")
    if panel is not None:
        declare_panel(panel)
    return METRICS.register(name)(metric)


def metric(name: str) -> Metric:
    """The declaration of ``name``.

    Raises:
        ValueError: ``name`` is not declared (lists the declared names).
    """
    return METRICS.lookup(name)


def derived(source: str) -> list[Metric]:
    """The metrics declared as a reduction ``of=source``."""
    return [m for m in METRICS.values() if m.of == source]


class StepMetrics:
    """Accumulates one optimizer step's metrics over its micro-batches (and ranks), each key by
    its declaration: ``token_mean`` keys as sums of value x valid tokens, ``mean`` / ``last``
    keys as the latest value (the same in every micro-batch), ``min`` / ``max`` / ``sum`` over
    the micro-batches. Picklable, so ranks gather theirs and :meth:`merge` them in rank order.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.values: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: Mapping[str, float], n_tokens: float) -> None:
        """Add one micro-batch's ``metrics`` computed over ``n_tokens`` valid tokens.

        Raises:
            ValueError: a key without a declaration (names it and :func:`declare_metric`).
        """
        for k, v in metrics.items():
            red = _reduction(k)
            if red == "token_mean":
                self.sums[k] = self.sums.get(k, 0.0) + float(v) * n_tokens
            else:
                self._put(k, red, float(v), keep_first=False)
        self.weight += n_tokens

    def _put(self, k: str, red: str, v: float, keep_first: bool) -> None:
        if k in self.values and red in ("min", "max", "sum"):
            old = self.values[k]
            self.values[k] = min(old, v) if red == "min" else max(old, v) if red == "max" else old + v
        elif k not in self.values or not keep_first:
            self.values[k] = v

    def merge(self, other: "StepMetrics") -> None:
        """Add another rank's accumulated micro-batches (``mean`` keys keep this one's value)."""
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in other.values.items():
            self._put(k, _reduction(k), v, keep_first=True)
        self.weight += other.weight

    def result(self) -> dict[str, float]:
        """The optimizer step's metrics (``token_mean`` keys are 0 when no token was seen)."""
        token = {k: v / self.weight for k, v in self.sums.items()} if self.weight > 0 else {k: 0.0 for k in self.sums}
        return {**token, **self.values}


def reduce_updates(updates: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A training step's metrics from its optimizer steps' (each from :meth:`StepMetrics.result`,
    plus the update's own keys, ``grad_norm``, ``lr`` ...): every key reduced by its declaration, then the metrics declared
    ``of=`` one of them. Keys in sorted order.

    Raises:
        ValueError: a key without a declaration.
    """
    out: dict[str, float] = {}
    for k in sorted({k for u in updates for k in u}):
        vals = [u[k] for u in updates if k in u]
        out[k] = _reduce(_reduction(k), vals)
        for m in derived(k):
            out[m.name] = _reduce(m.reduce, vals)
    return out


def _reduce(red: str, vals: list[float]) -> float:
    if red in ("token_mean", "mean", "step"):
        return sum(vals) / len(vals)
    if red == "min":
        return min(vals)
    if red == "max":
        return max(vals)
    if red == "sum":
        return sum(vals)
    return vals[-1]  # last


def _reduction(key: str) -> str:
    if key not in METRICS:
        raise ValueError(f"metric {key!r} has no declaration: call echotrain.metrics.declare_metric({key!r}, "
                         "reduce=..., unit=..., help=...) in the module that produces it (declared: "
                         f"{', '.join(METRICS)})")
    return METRICS[key].reduce


def undeclared(keys: Iterable[str]) -> list[str]:
    """The keys of ``keys`` (e.g. of a metrics.jsonl record, ``step`` excepted) with no declaration."""
    return sorted(k for k in keys if k != "step" and k not in METRICS)


def summary_keys() -> list[str]:
    """The metrics of the terminal summary table: by panel (:data:`PANELS` order), then the
    unplotted ones, each group in declaration order."""
    shown = [m for m in METRICS.values() if m.summary and m.file == "metrics"]
    order = {p: i for i, p in enumerate(PANELS)}
    return [m.name for m in sorted(shown, key=lambda m: order.get(m.panel, len(order)))]


def volatile_keys() -> list[str]:
    """The metrics that depend on wall time or the machine (excluded when comparing runs)."""
    return [m.name for m in METRICS.values() if m.volatile]


def panels() -> list[tuple[str, list[Metric]]]:
    """``plots/summary.png``'s panels: (title, its metrics in declaration order), in :data:`PANELS` order."""
    out: dict[str, list[Metric]] = {p: [] for p in PANELS}
    for m in METRICS.values():
        if m.panel is not None:
            out[m.panel].append(m)
    return [(p, ms) for p, ms in out.items() if ms]


def markdown_table() -> str:
    """The metric list of ``docs/metrics.md``: one row per declared metric (name, reduction, unit,
    meaning, when written, panel)."""
    rows = ["| metric | reduction | unit | meaning | written | panel |", "|---|---|---|---|---|---|"]
    for m in METRICS.values():
        red = m.reduce + (f" of `{m.of}`" if m.of else "")
        where = ("eval steps (eval.jsonl)" if m.file == "eval" else "every step") + (f"; {m.when}" if m.when else "")
        rows.append(f"| `{m.name}` | {red} | {m.unit} | {m.help} | {where} | {m.panel or '-'} |")
    return "\n".join(rows) + "\n"
