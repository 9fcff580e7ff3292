"""PNG plots of a run's main curves from its metrics records (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

# (file name, title, [(metric key, label)], y label)
PLOTS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("reward.png", "Reward and accuracy", [("reward/mean", "reward mean"), ("accuracy", "accuracy"),
                                           ("format_rate", "format rate")], ""),
    ("response_length.png", "Response length", [("response_length/mean", "mean"), ("response_length/max", "max")],
     "tokens"),
    ("clip_fraction.png", "Clip fractions", [("pg_clipfrac_high", "high (rho > 1+eps_high, A>0)"),
                                             ("pg_clipfrac_low", "low (rho < 1-eps_low, A<0)"),
                                             ("pg_clipfrac", "total")], "fraction of tokens"),
    ("echo_batch_ratio.png", "ECHO batch ratio", [("echo/R_batch", "R_batch"), ("echo/R_batch_min", "R_batch min"),
                                                  ("echo/R_batch_max", "R_batch max"), ("echo/kappa", "kappa")], ""),
    ("kl.png", "KL", [("ppo_kl", "ppo_kl (old vs current)"), ("kl/ref", "KL to reference")], ""),
    ("grad_norm.png", "Gradient norm (before clipping)", [("grad_norm", "grad norm")], ""),
]


def plot_metrics(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Write one PNG per entry of :data:`PLOTS` whose metrics appear in ``records``.

    Args:
        records: metrics.jsonl lines (dicts with ``step`` and metric keys).
        out_dir: folder for the PNGs (created).

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, title, series, ylabel in PLOTS:
        present = [(k, lbl) for k, lbl in series if any(r.get(k) is not None for r in records)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in present:
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=2.5, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        tmp = out / f".{fname}.tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written
