"""PNG plots of a run from its metrics records (matplotlib, Agg backend).

- ``plots/summary.png``: one multi-panel figure to read a run at a glance: the panels of
  :func:`echotrain.metrics.panels`, each drawing the metrics declared on it (sampled accuracy
  with the evaluation points (greedy or sampled, as eval_temperature), reward, entropy, response length, truncated responses, policy
  drift, clip fractions, ECHO's batch ratio, gradient norm, step time, and any panel a plugin's
  metric names). Every series is drawn as its raw per-step points plus a trailing moving mean
  (window :func:`smoothing_window`); every y axis names its unit (the panel's first metric's).
- ``plots/<panel>.png``: one figure per panel (file name :func:`panel_file`), the same curves.

Metrics declared ``file="eval"`` are read from ``eval.jsonl`` (step 0 included) and drawn as
black diamonds, never joined by a line (separate measurements, not a trend). Each figure says
once, under it, how its curves are drawn (:func:`smoothing_note`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

from echotrain.metrics import Metric, panels


def panel_file(title: str) -> str:
    """The PNG file name of a panel: ``"ECHO batch ratio"`` -> ``"echo_batch_ratio.png"``."""
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_") + ".png"


def smoothing_window(n: int) -> int:
    """Moving-mean window for ``n`` points: about n/8, at least 1 (no smoothing for short runs)."""
    return max(1, round(n / 8))


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving mean: ``out[i] = mean(values[max(0, i-window+1) : i+1])``."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def smoothing_note(window: int, with_evals: bool = False, decoding: str = "greedy") -> str:
    """The figure's one line on how its curves are drawn: dots, lines (trailing mean over
    ``window`` steps) and, ``with_evals``, the evaluation markers (``decoding``:
    :func:`echotrain.train.metrics.eval_decoding`)."""
    lines = f"lines: trailing mean of the last {window} steps" if window > 1 else "lines join them (no smoothing)"
    evals = f"; diamonds: evaluations on fixed prompts ({decoding}), not joined" if with_evals else ""
    return f"dots: each step's value; {lines}{evals}"


def _decoding(evals: Sequence[dict[str, Any]] | None) -> str:
    """:func:`echotrain.train.metrics.eval_decoding`, once per figure."""
    from echotrain.train.metrics import eval_decoding  # (lazy: train.metrics imports torch)

    return eval_decoding(evals)


def _draw(ax, xs: list[float], ys: list[float], label: str, color: str, window: int) -> None:
    """Raw points plus their trailing moving mean over ``window`` steps as a line (labelled)."""
    ax.plot(xs, ys, linestyle="none", marker="o", markersize=2.5, alpha=0.45, color=color)
    ax.plot(xs, moving_mean(ys, window), color=color, linewidth=1.6, label=label)


def plain_tick_labels(fig) -> None:
    """Turn off matplotlib's offset notation on every linear axis of ``fig``: a y axis over
    0.999999-1.000001 reads ``0.999999 ... 1.000001``, not ``1e-6+9.9999e-1`` over ticks 0 ... 2
    (every figure of the project goes through this before it is saved; log axes are left alone)."""
    from matplotlib.ticker import ScalarFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            fmt = axis.get_major_formatter()
            if isinstance(fmt, ScalarFormatter):
                fmt.set_useOffset(False)


def _save(fig, out: Path, fname: str) -> Path:
    from echotrain.atomic import atomic_path

    plain_tick_labels(fig)
    with atomic_path(out / fname) as tmp:
        fig.savefig(tmp, dpi=110)
    return out / fname


def _present(records: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]] | None) -> list[tuple[str, list[Metric]]]:
    """The declared panels with at least one metric in ``records`` (or, for eval metrics, ``evals``)."""
    from echotrain.train.metrics import builtin_metrics

    builtin_metrics()

    def has(m: Metric) -> bool:
        src = (evals or []) if m.file == "eval" else records
        return bool(_series(src, m.name)[0])

    return [(title, ms) for title, ms in panels() if any(has(m) for m in ms if m.file == "metrics")]


def _draw_panel(ax, title: str, metrics: list[Metric], records, evals, colors, legend_size: int,
                window: int, decoding: str = "greedy") -> bool:
    """Draw one panel; True when it drew evaluation markers (labelled with ``decoding``, :func:`_decoding`)."""
    i, drew_evals = 0, False
    for m in metrics:
        if m.file == "eval":
            xs, ys = _series(evals or [], m.name)
            if xs:
                # separate evaluations: markers only, never joined into a trend line
                ax.plot(xs, ys, linestyle="none", marker="D", markersize=6, color="black",
                        label=f"{m.short} ({decoding}, fixed prompts)")
                drew_evals = True
            continue
        xs, ys = _series(records, m.name)
        if xs:
            _draw(ax, xs, ys, m.short, colors[i % len(colors)], window)
            i += 1
    if title == "Policy drift":
        ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(metrics[0].unit)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    return drew_evals


def plot_summary(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 evals: Sequence[dict[str, Any]] | None = None, title: str | None = None) -> Path | None:
    """Write ``summary.png``: the declared panels whose metrics appear in ``records``.

    Args:
        records: metrics.jsonl lines. evals: eval.jsonl lines (accuracy points, step 0 included).
        out_dir: folder (created). title: figure title (e.g. the run directory).

    Returns:
        The path, or None when ``records`` is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return None
    shown = _present(records, evals)
    cols = 3
    rows = max(1, (len(shown) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.3 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window, decoding = smoothing_window(len(records)), _decoding(evals)
    for ax, (ptitle, metrics) in zip(axes.flat, shown):
        _draw_panel(ax, ptitle, metrics, records, evals, colors, 7, window, decoding)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    with_evals = bool(evals and _series(evals, "eval/accuracy")[0])
    fig.text(0.5, 0.005, smoothing_note(window, with_evals, decoding), ha="center", va="bottom", fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = _save(fig, out, "summary.png")
    plt.close(fig)
    return path


def plot_metrics(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 evals: Sequence[dict[str, Any]] | None = None, title: str | None = None) -> list[Path]:
    """Write ``summary.png`` and one PNG per declared panel (:func:`panel_file`) whose metrics
    appear in ``records``.

    Args:
        records: metrics.jsonl lines (dicts with ``step`` and metric keys).
        out_dir: folder for the PNGs (created).
        evals: eval.jsonl lines; their accuracy is marked on the accuracy plots (with how they decoded).
        title: title of the summary figure.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    summary = plot_summary(records, out, evals=evals, title=title)
    if summary is not None:
        written.append(summary)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window, decoding = smoothing_window(len(records)), _decoding(evals)
    for ptitle, metrics in _present(records, evals):
        fig, ax = plt.subplots(figsize=(7, 4.3))
        with_evals = _draw_panel(ax, ptitle, metrics, records, evals, colors, 8, window, decoding)
        fig.text(0.5, 0.01, smoothing_note(window, with_evals, decoding), ha="center", va="bottom", fontsize=7.5, color="dimgray")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        written.append(_save(fig, out, panel_file(ptitle)))
        plt.close(fig)
    return written
