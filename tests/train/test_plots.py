"""The run's plots: one summary figure from the declared panels, labelled axes, eval points, smoothing."""

from __future__ import annotations

import os

from pathlib import Path

from echotrain.metrics import panels
from echotrain.train.metrics import builtin_metrics
from echotrain.train.plots import moving_mean, panel_file, plot_metrics, smoothing_window


def test_eval_decoding_is_read_from_the_records():
    """eval.jsonl's eval/temperature says how the evaluations decoded (records without it: greedy)."""
    from echotrain.train.metrics import eval_decoding
    from echotrain.train.plots import smoothing_note

    assert eval_decoding([{"step": 0}, {"step": 4, "eval/temperature": 0.0}]) == "greedy"
    assert eval_decoding(None) == "greedy"
    assert eval_decoding([{"step": 0, "eval/temperature": 1.0}]) == "sampled at T=1"
    assert eval_decoding([{"eval/temperature": 0.6}, {"eval/temperature": 1.0}]) == "sampled at T=0.6/1"
    assert eval_decoding([{"step": 0}, {"eval/temperature": 0.7}]) == "greedy and sampled at T=0.7"  # resumed otherwise
    assert smoothing_note(1, True, "sampled at T=1").endswith("diamonds: evaluations on fixed prompts (sampled at T=1), "
                                                              "not joined")


def test_moving_mean_hand_values():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_mean([2.0, 4.0], 1) == [2.0, 4.0]
    assert smoothing_window(5) == 1 and smoothing_window(16) == 2 and smoothing_window(80) == 10


def test_every_panel_has_a_unit_and_ppo_kl_is_not_called_kl():
    builtin_metrics()
    for title, metrics in panels():
        assert metrics[0].unit, title
    labels = [m.short for _, ms in panels() for m in ms if m.name == "ppo_kl"]
    assert labels and all("not a KL" in lbl and "log" in lbl for lbl in labels)
    assert panel_file("ECHO batch ratio") == "echo_batch_ratio.png"


def test_summary_figure_written(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"step": s, "accuracy": 0.1 * s, "reward/mean": 0.1 * s, "format_rate": 0.5, "entropy": 1.0 / s,
                "ppo_kl": -0.01 * (s % 2), "grad_norm": 1.0, "response_length/mean": 10.0,
                "response_length/max": 20.0, "truncated_frac": 0.25, "time/step": 1.0} for s in range(1, 9)]
    evals = [{"step": 0, "eval/accuracy": 0.2}, {"step": 8, "eval/accuracy": 0.6}]
    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kw):
        seen[str(path)] = [(ax.get_title(), ax.get_ylabel(), [t.get_text() for t in ax.get_legend().get_texts()])
                           for ax in fig.axes if ax.get_visible()]
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    paths = plot_metrics(records, tmp_path, evals=evals, title="run")
    names = {p.name for p in paths}
    assert {"summary.png", "entropy.png", "policy_drift.png", "truncated_responses.png"} <= names
    assert "echo_batch_ratio.png" not in names  # no ECHO metric in the records
    assert (tmp_path / "summary.png").stat().st_size > 10_000
    (summary,) = [v for k, v in seen.items() if Path(k).name.startswith(".summary.png.tmp")]
    titles = [t for t, _, _ in summary]
    assert titles == ["Accuracy", "Reward", "Entropy", "Response length", "Truncated responses", "Policy drift",
                      "Gradient norm", "Step time"]
    assert dict((t, y) for t, y, _ in summary)["Truncated responses"] == "fraction of completions"
    assert all(ylabel for _, ylabel, _ in summary)
    acc = [legend for t, _, legend in summary if t == "Accuracy"][0]
    assert "eval (greedy, fixed prompts)" in acc
    plt.close("all")


def _spy_figures(monkeypatch):
    """Figure objects by saved path (plot functions close their figures after saving)."""
    import matplotlib
    import matplotlib.figure

    matplotlib.use("Agg")
    seen = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kw):
        seen[str(path)] = fig
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


def test_greedy_evals_are_markers_not_a_trend_line_and_smoothing_is_said_once(tmp_path, monkeypatch):
    seen = _spy_figures(monkeypatch)
    records = [{"step": s, "accuracy": 0.05 * s, "reward/mean": 0.05 * s, "response_length/mean": 10.0 + s,
                "response_length/max": 20.0 + s} for s in range(1, 17)]
    evals = [{"step": 0, "eval/accuracy": 0.2}, {"step": 8, "eval/accuracy": 0.6}, {"step": 16, "eval/accuracy": 0.4}]
    plot_metrics(records, tmp_path, evals=evals, title="run")
    for name, panel in (("summary.png", "Accuracy"), ("accuracy.png", "Accuracy")):
        (fig,) = [f for k, f in seen.items() if os.path.basename(k).startswith(f".{name}.tmp")]
        (ax,) = [a for a in fig.axes if a.get_title() == panel]
        (ev,) = [ln for ln in ax.get_lines() if "(greedy, fixed prompts)" in ln.get_label()]
        assert ev.get_linestyle() == "None" and ev.get_marker() == "D", name  # markers only
        assert list(ev.get_xdata()) == [0, 8, 16]
        notes = [t.get_text() for t in fig.texts]
        assert any("trailing mean of the last 2 steps" in t and "evaluations on fixed prompts (greedy), not joined" in t
                   for t in notes), notes
    (fig,) = [f for k, f in seen.items() if os.path.basename(k).startswith(".summary.png.tmp")]
    (length,) = [a for a in fig.axes if a.get_title() == "Response length"]
    labels = [t.get_text() for t in length.get_legend().get_texts()]
    assert labels == ["mean", "max"]  # not "max (mean of 2)": the smoothing is the figure's note
    (fig,) = [f for k, f in seen.items() if os.path.basename(k).startswith(".response_length.png.tmp")]
    assert not any("diamonds" in t.get_text() for t in fig.texts)  # no evals drawn there
