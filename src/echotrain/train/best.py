"""Validation during training: the best evaluation so far, early stopping on it, and where the
best checkpoint lives (``best_metric``, ``early_stop_patience``, ``keep_best``; docs/metrics.md).

:class:`BestTracker` is the whole rule: an evaluation improves on the best if its value is
strictly larger (every ``best_metric`` choice is "higher is better"); ``early_stop_patience``
evaluations in a row without an improvement stop the run. Its state travels in checkpoints, so a
resumed run judges its evaluations against the same best.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from echotrain.atomic import atomic_write_text

#: The evaluation metrics ``best_metric`` may name (all: higher is better).
BEST_METRICS = ("eval/accuracy", "eval/pass@n", "eval/format_rate")
#: The best checkpoint's folder inside a run directory (``keep_best``): ``best/checkpoints/step_N.pt``
#: and ``best/best.json`` (step, metric, value).
BEST_DIR = "best"


class BestTracker:
    """The best value of ``metric`` over a run's evaluations, and the evaluations since it.

    Args:
        metric: one of :data:`BEST_METRICS`.
        patience: evaluations in a row without an improvement that stop the run; 0 = never.

    Raises:
        ValueError: unknown ``metric`` or ``patience`` < 0.
    """

    def __init__(self, metric: str, patience: int = 0):
        if metric not in BEST_METRICS:
            raise ValueError(f"best_metric={metric!r} is unknown; valid: {list(BEST_METRICS)}")
        if patience < 0:
            raise ValueError(f"early_stop_patience must be >= 0, got {patience}")
        self.metric, self.patience = metric, patience
        self.best, self.best_step, self.since = -math.inf, None, 0

    def update(self, step: int, values: dict[str, float]) -> bool:
        """Record the evaluation of ``step`` (``values`` holds ``metric``); True if it is a new best.

        Raises:
            KeyError: ``values`` lacks ``metric`` (e.g. ``eval/pass@n`` without ``eval_n`` > 1).
        """
        value = float(values[self.metric])
        if value > self.best:
            self.best, self.best_step, self.since = value, step, 0
            return True
        self.since += 1
        return False

    @property
    def should_stop(self) -> bool:
        """``patience`` evaluations in a row without an improvement."""
        return self.patience > 0 and self.since >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since": self.since}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.best, self.best_step, self.since = float(state["best"]), state["best_step"], int(state["since"])

    def write_json(self, run_dir: Path) -> None:
        """``<run_dir>/best/best.json``: the best evaluation's step, metric and value (atomic)."""
        path = Path(run_dir) / BEST_DIR / "best.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"step": self.best_step, "metric": self.metric, "value": self.best}) + "\n")
