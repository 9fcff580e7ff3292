"""PNG plots of a run from its metrics records (matplotlib, Agg backend).

- ``plots/summary.png``: one multi-panel figure to read a run at a glance (:data:`PANELS`):
  sampled accuracy with the greedy-eval points, reward, entropy, response length, policy drift
  (``ppo_kl``, a mean log-ratio, and the KL to the reference when used), clip fractions, ECHO's
  batch ratio, gradient norm and step time. Every series is drawn as its raw per-step points plus
  a trailing moving mean (window :func:`smoothing_window` of the run's step count, one window per
  figure, stated once under it by :func:`smoothing_note`); every y axis names its unit. The
  greedy evaluations are separate measurements: markers, never joined by a line.
- one PNG per entry of :data:`PLOTS` (the same curves, one figure each).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

# (file name, title, [(metric key, label)], y label)
PLOTS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("reward.png", "Reward and sampled accuracy",
     [("reward/mean", "reward mean"), ("accuracy", "accuracy (fraction correct)"), ("format_rate", "format rate")],
     "reward per completion / fraction"),
    ("response_length.png", "Response length", [("response_length/mean", "mean"), ("response_length/max", "max")],
     "tokens"),
    ("clip_fraction.png", "Clip fractions", [("pg_clipfrac_high", "high (rho > 1+eps_high, A>0)"),
                                             ("pg_clipfrac_low", "low (rho < 1-eps_low, A<0)"),
                                             ("pg_clipfrac", "total")], "fraction of tokens"),
    ("echo_batch_ratio.png", "ECHO batch ratio", [("echo/R_batch", "R_batch"), ("echo/R_batch_min", "R_batch min"),
                                                  ("echo/R_batch_max", "R_batch max"), ("echo/kappa", "kappa")],
     "ratio (1 = on-policy)"),
    ("policy_drift.png", "Policy drift",
     [("ppo_kl", "ppo_kl: mean(old_log_prob - log_prob), not a KL (can be < 0)"),
      ("kl/ref", "KL to reference (kl_penalty estimator)")], "nats per token"),
    ("entropy.png", "Token entropy of the rollout policy", [("entropy", "entropy")], "nats per token"),
    ("grad_norm.png", "Gradient norm (before clipping)", [("grad_norm", "grad norm")], "global L2 norm"),
]

# summary panels: (title, [(key, label)], y label, draw eval.jsonl's greedy accuracy on it)
PANELS: list[tuple[str, list[tuple[str, str]], str, bool]] = [
    ("Accuracy", [("accuracy", "sampled (training batch)"), ("format_rate", "answer format rate")],
     "fraction of completions", True),
    ("Reward", [("reward/mean", "reward mean")], "reward per completion", False),
    ("Entropy", [("entropy", "token entropy")], "nats per token", False),
    ("Response length", [("response_length/mean", "mean"), ("response_length/max", "max")], "tokens", False),
    ("Policy drift", [("ppo_kl", "ppo_kl = mean log-ratio old/new (not a KL)"), ("kl/ref", "KL to reference")],
     "nats per token", False),
    ("Clip fractions", [("pg_clipfrac_high", "high (A>0)"), ("pg_clipfrac_low", "low (A<0)")],
     "fraction of tokens", False),
    ("ECHO batch ratio", [("echo/R_batch", "R_batch"), ("echo/kappa", "kappa")], "ratio (1 = on-policy)", False),
    ("Gradient norm", [("grad_norm", "before clipping")], "global L2 norm", False),
    ("Step time", [("time/step", "wall"), ("time/generation", "generation")], "seconds", False),
]


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


def smoothing_note(window: int, with_evals: bool = False) -> str:
    """The figure's one line on how its curves are drawn: dots, lines (trailing mean over
    ``window`` steps) and, ``with_evals``, the greedy-evaluation markers."""
    lines = f"lines: trailing mean of the last {window} steps" if window > 1 else "lines join them (no smoothing)"
    evals = "; diamonds: greedy evaluations on fixed prompts, not joined" if with_evals else ""
    return f"dots: each step's value; {lines}{evals}"


def _draw(ax, xs: list[float], ys: list[float], label: str, color: str, window: int) -> None:
    """Raw points plus their trailing moving mean over ``window`` steps as a line (labelled)."""
    ax.plot(xs, ys, linestyle="none", marker="o", markersize=2.5, alpha=0.45, color=color)
    ax.plot(xs, moving_mean(ys, window), color=color, linewidth=1.6, label=label)


def _draw_evals(ax, evals: Sequence[dict[str, Any]], label: str) -> None:
    """eval.jsonl's greedy accuracy as markers only: separate evaluations, not a trend line."""
    xs, ys = _series(evals, "eval/accuracy")
    if xs:
        ax.plot(xs, ys, linestyle="none", marker="D", markersize=6, color="black", label=label)


def _save(fig, out: Path, fname: str) -> Path:
    path = out / fname
    tmp = out / f".{fname}.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return path


def plot_summary(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 evals: Sequence[dict[str, Any]] | None = None, title: str | None = None) -> Path | None:
    """Write ``summary.png``: the panels of :data:`PANELS` whose metrics appear in ``records``.

    Args:
        records: metrics.jsonl lines. evals: eval.jsonl lines (greedy accuracy points, step 0 included).
        out_dir: folder (created). title: figure title (e.g. the run directory).

    Returns:
        The path, or None when ``records`` is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return None
    panels = [p for p in PANELS if any(_series(records, k)[0] for k, _ in p[1])]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.3 * rows + 0.3), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window = smoothing_window(len(records))
    for ax, (ptitle, series, ylabel, with_eval) in zip(axes.flat, panels):
        for i, (key, label) in enumerate(series):
            xs, ys = _series(records, key)
            if xs:
                _draw(ax, xs, ys, label, colors[i % len(colors)], window)
        if with_eval and evals:
            _draw_evals(ax, evals, "greedy eval (fixed prompts)")
        if ptitle == "Policy drift":
            ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(ptitle)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    with_evals = bool(evals and _series(evals, "eval/accuracy")[0])
    fig.text(0.5, 0.005, smoothing_note(window, with_evals), ha="center", va="bottom", fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = _save(fig, out, "summary.png")
    plt.close(fig)
    return path


def plot_metrics(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 evals: Sequence[dict[str, Any]] | None = None, title: str | None = None) -> list[Path]:
    """Write ``summary.png`` and one PNG per entry of :data:`PLOTS` whose metrics appear in ``records``.

    Args:
        records: metrics.jsonl lines (dicts with ``step`` and metric keys).
        out_dir: folder for the PNGs (created).
        evals: eval.jsonl lines; their greedy accuracy is marked on the accuracy plots.
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
    window = smoothing_window(len(records))
    for fname, title_, series, ylabel in PLOTS:
        present = [(k, lbl) for k, lbl in series if any(r.get(k) is not None for r in records)]
        if fname == "reward.png" and _series(records, "reward/mean") == _series(records, "accuracy"):
            # binary correctness reward: the two curves coincide; draw one, say so
            present = [(k, "accuracy = reward (binary correctness)" if k == "accuracy" else lbl)
                       for k, lbl in present if k != "reward/mean"]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.3))
        for i, (key, label) in enumerate(present):
            xs, ys = _series(records, key)
            _draw(ax, xs, ys, label, colors[i % len(colors)], window)
        if fname == "reward.png" and evals:
            _draw_evals(ax, evals, "greedy eval accuracy")
        ax.set_title(title_)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        with_evals = fname == "reward.png" and bool(evals and _series(evals, "eval/accuracy")[0])
        fig.text(0.5, 0.01, smoothing_note(window, with_evals), ha="center", va="bottom", fontsize=7.5, color="dimgray")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        written.append(_save(fig, out, fname))
        plt.close(fig)
    # kl.png was renamed policy_drift.png (it shows ppo_kl, a mean log-ratio): drop a stale one
    stale = out / "kl.png"
    if stale.exists():
        stale.unlink()
    return written
