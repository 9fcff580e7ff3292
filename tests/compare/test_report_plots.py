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
