"""The comparison report's figures: large enough to read, a legend that hides no curve, and arms
told apart by line style and marker as well as colour."""

from __future__ import annotations

import matplotlib

from echotrain.compare.report import plot_curves
from tests.train.test_plots import _spy_figures


def test_compare_plots_are_readable_and_arms_look_different(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    from PIL import Image

    seen = _spy_figures(monkeypatch)
    steps = list(range(0, 90, 10))
    # nine arms with identical curves: only their styles can tell them apart
    per_arm = {f"arm{i}": {"steps": steps, "n": 5, "mean": [0.4] * 9, "ci_low": [0.38] * 9, "ci_high": [0.42] * 9}
               for i in range(9)}
    (path,) = plot_curves({"eval/accuracy": per_arm}, tmp_path)
    width, height = Image.open(path).size
    assert width >= 900 and height >= 500, (width, height)  # was 460 x 259
    (fig,) = seen.values()
    (ax,) = fig.axes
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("arm")]
    assert len(lines) == 9
    styles = {(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(styles) == 9
    assert len({ln.get_linestyle() for ln in lines}) >= 4 and len({ln.get_marker() for ln in lines}) == 9
    legend = ax.get_legend()
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9
    fig.canvas.draw()
    box, axes_box = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= axes_box.x1  # outside the axes: it covers no curve


def _offset_texts(fig) -> list[str]:
    fig.canvas.draw()
    return [axis.get_offset_text().get_text() for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]


def test_compare_plots_have_no_offset_notation(tmp_path, monkeypatch):
    """Issue 40: an ESS curve at 0.99999-1.0 read "1e-6+9.9999e-1" over ticks 0 ... 10."""
    matplotlib.use("Agg")
    seen = _spy_figures(monkeypatch)
    steps = list(range(1, 11))
    ess = [1.0 - 1e-6 * (s % 3) for s in steps]
    per_arm = {"grpo": {"steps": steps, "n": 2, "mean": ess, "ci_low": ess, "ci_high": ess}}
    plot_curves({"rollout_corr/behaviour_ess": per_arm}, tmp_path)
    (fig,) = seen.values()
    assert _offset_texts(fig) == ["", ""]
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert any(lab.startswith("0.99999") for lab in labels), labels


def test_run_plots_have_no_offset_notation(tmp_path, monkeypatch):
    """The same for a run's own plots (echotrain.train.plots): every saved figure."""
    from echotrain.train.plots import plot_metrics

    seen = _spy_figures(monkeypatch)
    records = [{"step": s, "reward/mean": 1.0 - 1e-6 * (s % 3), "entropy": 2.0 + 1e-7 * s} for s in range(1, 13)]
    plot_metrics(records, tmp_path)
    assert len(seen) >= 2
    for fig in seen.values():
        assert set(_offset_texts(fig)) == {""}


def test_sweep_curves_group_by_arm(tmp_path, monkeypatch):
    """Issue 36: 3 arms x 5 sweep values = 15 curves in 3 colours (one per arm), 5 line styles (one
    per sweep value), not 15 unrelated colours."""
    from echotrain.compare.report import SWEEP_LINESTYLES, sweep_groups

    matplotlib.use("Agg")
    seen = _spy_figures(monkeypatch)
    sweep = {"name": "staleness", "values": [0, 1, 2, 4, 8]}
    labels = [f"{a}[staleness={v}]" for a in ("grpo", "echo", "cispo") for v in sweep["values"]]
    groups = sweep_groups(labels, sweep)
    assert groups["echo[staleness=4]"] == ("echo", 3)
    steps = list(range(0, 50, 10))
    per_arm = {lab: {"steps": steps, "n": 3, "mean": [0.1] * 5, "ci_low": [0.1] * 5, "ci_high": [0.1] * 5}
               for lab in labels}
    plot_curves({"eval/accuracy": per_arm}, tmp_path, groups)
    (fig,) = seen.values()
    lines = {ln.get_label().split(" (n=")[0]: ln for ln in fig.axes[0].get_lines()}
    assert len(lines) == 15
    colour = {a: {lines[f"{a}[staleness={v}]"].get_color() for v in sweep["values"]} for a in ("grpo", "echo", "cispo")}
    assert all(len(c) == 1 for c in colour.values()) and len(set().union(*colour.values())) == 3
    def dashes(ln):  # the drawn dash pattern (get_linestyle() names a custom pattern '--')
        return ln.get_linestyle(), str(ln._unscaled_dash_pattern)

    for v in sweep["values"]:  # each value one line style, the same in every arm
        assert len({dashes(lines[f"{a}[staleness={v}]"]) for a in ("grpo", "echo", "cispo")}) == 1
    assert len({dashes(lines[f"grpo[staleness={v}]"]) for v in sweep["values"]}) == 5
    assert len(SWEEP_LINESTYLES) >= 5
