"""Run outputs: metrics.jsonl, samples.jsonl, tracker sinks (``report_to``), the summary table.

``samples.jsonl`` has ``log_samples`` rows per step taken round-robin over the step's prompt
groups (``group``: the prompt's index in the step), each with ``question``, ``answer``,
``completion``, ``reward`` and ``correct``.

``metrics.jsonl`` has one JSON object per step. Keys (all floats unless noted):

- ``step`` (int), ``reward/mean``, ``reward/std``, ``accuracy`` (mean correctness), ``format_rate``
- ``response_length/mean``, ``response_length/max`` (valid tokens), ``truncated_frac`` (no EOS)
- ``entropy`` (mean token entropy of the rollout policy over valid tokens)
- ``pg_loss``, ``ppo_kl`` (mean old_log_prob - log_prob), ``kl/ref`` (when kl_coef > 0)
- ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low`` (token-weighted over the step)
- ``echo/R_batch``, ``echo/R_batch_min``, ``echo/R_batch_max``, ``echo/kappa``, ``echo/batch_clipped``
  (ECHO only; mean/min/max over the step's optimizer steps)
- ``grad_norm`` (before clipping, mean over optimizer steps), ``lr``
- ``groups/kept``, ``groups/zero_variance_frac``, ``sampling_rounds`` (int)
- ``reward/timeouts``, ``reward/exceptions`` (int): completions whose reward call timed out or
  raised this step (scored 0; see ``echotrain.rewards.RewardFunction``)
- ``eval/accuracy``, ``eval/format_rate`` on the steps that ran the greedy evaluation (also in
  ``eval.jsonl``, with the step-0 evaluation before training)
- ``time/generation``, ``time/scoring``, ``time/update``, ``time/step`` (wall seconds),
  ``time/step_cpu`` (CPU seconds of this process, all threads; tells load from other processes),
  ``throughput/tokens_per_s`` (valid response tokens / step time), ``memory/peak_mb``
- ``throughput/update_mfu``, ``throughput/decode_bw_util``: achieved / peak (0-1) of the update
  (model FLOPs over ``time/update`` against the measured GEMM rate) and of generation (its
  roofline time over ``time/generation``); definitions in
  :data:`echotrain.train.utilisation.METRICS`; absent when the model's shape is unknown (run_info.json's
  ``roofline`` says why, or holds the peaks used and where they came from)

At the end of a run ``stability.json`` holds the stability flags
(:mod:`echotrain.train.stability`: NaN, length collapse, entropy collapse, grad-norm explosion).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from echotrain.train.step import StepData

#: keys that depend on wall time or the machine, not on the computation (excluded when comparing runs)
NONDETERMINISTIC_PREFIXES = ("time/", "throughput/", "memory/")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated on GPU, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def step_record(step: int, data: StepData, updates: list[dict[str, float]], *, last_lr: float, t_start: float,
                cpu_start: float, t_update: float, device: torch.device) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of step ``step`` (keys in the module docstring).

    Args:
        data: the step's data after the update (rewards shaped, advantages and entropy set).
        updates: the metrics of each optimizer step (:func:`echotrain.train.update.update_mini_batch`);
            a key's value in the record is its mean over the updates that have it.
        last_lr: the scheduler's lr now (used when there was no update).
        t_start, cpu_start: ``time.perf_counter()`` / ``time.process_time()`` at the step's start.
        t_update: wall seconds of steps 3-5 (advantages, log-probs, update).
        device: the policy's device (for ``memory/peak_mb``).
    """
    batch, rewards = data.batch, data.rewards
    lengths = batch.response_length
    valid = batch.response_mask.bool()
    n_tokens = float(batch.response_mask.sum())
    step_time = time.perf_counter() - t_start
    record: dict[str, Any] = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "accuracy": float(data.correct.mean()),
        "format_rate": float(data.format_ok.float().mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "truncated_frac": float(batch.truncated.float().mean()),
        "entropy": float(data.entropy[valid].mean()) if valid.any() else 0.0,
        "advantages/abs_mean": float(data.seq_advantages.abs().mean()),
        "groups/kept": data.n_groups,
        "groups/zero_variance_frac": data.zero_variance_frac,
        "sampling_rounds": data.rounds,
        "optimizer_steps": len(updates),
        "reward/timeouts": data.reward_timeouts,
        "reward/exceptions": data.reward_exceptions,
    }
    keys = sorted({k for u in updates for k in u})
    for k in keys:
        vals = [u[k] for u in updates if k in u]
        record[k] = sum(vals) / len(vals)
    if updates and "echo/R_batch" in keys:
        rs = [u["echo/R_batch"] for u in updates if "echo/R_batch" in u]
        record["echo/R_batch_min"], record["echo/R_batch_max"] = min(rs), max(rs)
    record["lr"] = updates[-1]["lr"] if updates else last_lr
    record.update({
        "time/generation": data.time_generation,
        "time/scoring": data.time_scoring,
        "time/update": t_update,
        "time/step": step_time,
        "time/step_cpu": time.process_time() - cpu_start,
        "throughput/tokens_per_s": n_tokens / max(step_time, 1e-9),
        "memory/peak_mb": peak_memory_mb(device),
    })
    return record


def sample_rows(step: int, data: StepData, log_samples: int) -> list[dict[str, Any]]:
    """The ``samples.jsonl`` rows of a step: ``log_samples`` completions spread over its groups."""
    from echotrain.train.features import spread_sample_rows

    rows = spread_sample_rows(data.batch.group_index, log_samples)
    return [
        {"step": step, "question": getattr(data.examples[i], "question", None),
         "answer": getattr(data.examples[i], "answer", None), "group": int(data.batch.group_index[i]),
         "completion": data.texts[i], "reward": float(data.rewards[i]), "correct": float(data.correct[i])}
        for i in rows
    ]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and ``os.replace``."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, p)


def run_info(*, run_dir: str | os.PathLike, device: torch.device, model_name: str, model: Any, task_name: str,
             task: Any, world_size: int, dist_backend: str, lora: bool, autocast: str = "off",
             roofline: dict[str, Any] | None = None) -> dict[str, Any]:
    """``run_info.json``'s content: what ``auto`` / ``0`` / empty config values resolved to in a
    run (device, threads, model, task, autocast: 'bfloat16' or 'off') and the library versions,
    for reproducing it; ``roofline``: the machine peaks the utilisation figures use and where they
    came from, or why there are none (:func:`echotrain.train.utilisation.build_meter`)."""
    import platform

    from echotrain.cli import omp_wait_in_force

    import transformers

    import echotrain

    return {
        "run_dir": str(run_dir),
        "device": str(device),
        "torch_num_threads": torch.get_num_threads(),
        "omp_wait": omp_wait_in_force(),
        "model": model_name or "smollm2-135m-instruct (embedded default)",
        "model_class": type(model).__name__,
        "task": task_name,
        "task_class": type(task).__name__,
        "world_size": world_size,
        "dist_backend": dist_backend,
        "lora": lora,
        "autocast": autocast,
        "roofline": roofline if roofline is not None else {"disabled": "not measured"},
        "versions": {"echotrain": echotrain.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL file ([] if missing)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> None:
    """Drop the records whose ``step`` is > ``max_step`` (used when resuming), atomically."""
    p = Path(path)
    if not p.is_file():
        return
    keep = [r for r in read_jsonl(p) if r.get("step", 0) <= max_step]
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, p)


class MetricsLogger:
    """Appends step records to ``metrics.jsonl`` (flushed each step) and mirrors them to the
    tracker sinks named in ``report_to`` (:mod:`echotrain.train.sinks`: tensorboard, wandb,
    trackio; comma-separated).

    Raises:
        ValueError: unknown sink name. ImportError: a sink's library is missing (names the extra).
    """

    def __init__(self, run_dir: str | os.PathLike, *, report_to: str | list[str] = "", project: str = "echotrain",
                 config: dict[str, Any] | None = None):
        from echotrain.train.sinks import build_sinks, parse_report_to

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        names = parse_report_to(",".join(report_to) if isinstance(report_to, list) else report_to)
        self.sinks = build_sinks(names, self.run_dir, config, project)

    def log(self, record: dict[str, Any]) -> None:
        """Append one step record (and send it to every sink)."""
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        step = int(record["step"])
        for sink in self.sinks:
            sink.log(record, step)

    def log_eval(self, record: dict[str, Any]) -> None:
        """Append one evaluation record to eval.jsonl."""
        with open(self.run_dir / "eval.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def log_samples(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append sample completions (one JSON object each)."""
        with open(self.samples_path, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()


class NullLogger:
    """The logger of data-parallel ranks other than 0: writes nothing."""

    def log(self, record: dict[str, Any]) -> None:
        """Discard."""

    def log_eval(self, record: dict[str, Any]) -> None:
        """Discard."""

    def log_samples(self, rows: Iterable[dict[str, Any]]) -> None:
        """Discard."""

    def close(self) -> None:
        """Nothing to close."""


SUMMARY_KEYS = ("reward/mean", "accuracy", "format_rate", "response_length/mean", "entropy", "ppo_kl",
                "pg_clipfrac_high", "pg_clipfrac_low", "echo/R_batch", "echo/kappa", "grad_norm",
                "throughput/tokens_per_s", "throughput/update_mfu", "throughput/decode_bw_util", "time/step")


def summary_rows(records: list[dict[str, Any]], head: int = 3) -> list[tuple[str, str, str, str, str]]:
    """(metric, first, last, min, max) rows; first/last are means over the first/last ``head`` steps."""
    rows = []
    for key in SUMMARY_KEYS:
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if not vals:
            continue
        k = min(head, len(vals))
        first, last = sum(vals[:k]) / k, sum(vals[-k:]) / k
        rows.append((key, f"{first:.4g}", f"{last:.4g}", f"{min(vals):.4g}", f"{max(vals):.4g}"))
    return rows


def print_summary(records: list[dict[str, Any]], run_dir: str | os.PathLike, wall_s: float,
                  evals: list[dict[str, Any]] | None = None, steps_run: tuple[int, int] | None = None,
                  stability: dict[str, Any] | None = None) -> None:
    """The closing table in the terminal (rich); ``evals`` (eval.jsonl) adds start/end rows.

    ``wall_s`` is the training time of this invocation (model loading excluded) and
    ``steps_run`` = (first, last) the steps it ran (a resumed run ran fewer than ``records`` hold);
    ``stability`` (:func:`echotrain.train.stability.stability_flags`) adds the flags line.
    """
    from rich.console import Console
    from rich.table import Table

    if not records:
        return
    head = 3
    first, last = steps_run if steps_run is not None else (records[0]["step"], records[-1]["step"])
    ran = (f"steps {first}-{last} ran" if last > first else f"step {first} ran" if last == first else "no step ran")
    title = (f"echotrain run summary - {run_dir}\n{len(records)} steps in metrics.jsonl; {ran} in {wall_s:.0f} s "
             f"(training, model loading excluded)")
    if evals:
        title += f"\neval rows: greedy on fixed prompts at step {evals[0]['step']} (first) and {evals[-1]['step']} (last)"
    table = Table(title=title)
    width = max([len(r[0]) for r in summary_rows(records, head)] + [len("eval/format_rate (greedy)")])
    table.add_column("metric", no_wrap=True, min_width=width)  # never cut a metric name
    for col in (f"first {head} steps", f"last {head} steps", "min", "max"):
        table.add_column(col, justify="right")
    for row in summary_rows(records, head):
        table.add_row(*row)
    if evals and len(evals) >= 1:
        for key in ("eval/accuracy", "eval/format_rate"):
            vals = [e[key] for e in evals if key in e]
            # first/last columns: the evaluations at the first and last evaluated steps
            table.add_row(f"{key} (greedy)", f"{vals[0]:.4g}", f"{vals[-1]:.4g}", f"{min(vals):.4g}",
                          f"{max(vals):.4g}")
    if stability is not None:
        from echotrain.train.stability import format_flags

        table.caption = f"stability flags: {format_flags(stability)} (rules in stability.json)"
    Console(stderr=True).print(table)
