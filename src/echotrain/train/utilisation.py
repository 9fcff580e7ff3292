"""Utilisation of every step: counted work over the phase's time, against the machine's peaks.

:class:`UtilisationMeter` adds up, during one training step, the FLOPs of every log-prob pass
the trainer runs (old log-probs, reference, ECHO pre-pass: no-grad forwards; the update's
with-grad forwards, each with its backward: 3x) and the prefill FLOPs and decode bytes of every
``generate`` call (counts: :mod:`echotrain.roofline.counts`, from the model's config:
:mod:`echotrain.roofline.shapes`), and turns them into the two figures of :data:`METRICS` with
the phase times the trainer already measures (``time/update``, ``time/generation``) and the
machine's peaks (:mod:`echotrain.roofline.peaks`, measured once per machine / dtype / threads
and cached; ``ECHOTRAIN_ROOFLINE_PEAKS`` stubs or disables them).

A figure above 1 means the cached peak was measured while the machine was busier than during the
step: the meter then re-measures the peaks once (keeping the best figure seen, in the cache too),
reports the step against them and the trainer prints one line saying so
(``python benchmarks/bench_roofline.py`` re-measures by hand).

With several processes (torchrun) the figures are rank 0's: its share of the passes and rollouts
over its own phase times, against peaks measured by rank 0 alone (the other ranks count nothing).

Fails soft: a model whose shape is unknown or ``ECHOTRAIN_ROOFLINE_PEAKS=off`` leave both metrics
out of metrics.jsonl, and run_info.json's ``roofline`` entry says why.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import torch

from echotrain.metrics import Metric, declare_metric

#: The metrics this module adds to each metrics.jsonl record, declared in the metric schema
#: (volatile: they depend on wall time and the machine, not only on the computation).
METRICS: dict[str, Metric] = {m.name: m for m in (
    declare_metric('throughput/update_mfu', reduce="step", unit="fraction of the measured GEMM peak (0-1)",
                   summary=True, volatile=True,
                   panel="Utilisation", label='update / GEMM peak', when="model shape known, peaks measured",
                   help=("model FLOPs of the step's log-prob passes (old log-probs, reference, pre-pass: forward; "
                        'update: forward + backward = 3x; each prompt once per pass, the prompts\' common prefix '
                        'once per pass) / (time/update x measured GEMM FLOP/s); padding, repeated prompts, the '
                        'optimizer and everything else in time/update count as lost utilisation')),
    declare_metric('throughput/decode_bw_util', reduce="step", unit="fraction of the roofline bound (0-1)",
                   summary=True, volatile=True,
                   panel="Utilisation", label='generation / roofline bound', when="model shape known, peaks measured",
                   help=("generation's roofline time / time/generation: prefill FLOPs at the GEMM peak, plus per "
                        'decode step the larger of its bytes (the weights once, in the compute dtype: under autocast '
                        'the cached bfloat16 copies; the KV cache of the rows still generating) at the memory '
                        'bandwidth and its FLOPs at the GEMM peak; with few rows decode is '
                        'bandwidth-bound and this is achieved / peak bandwidth, with many (the default 64 on a CPU) '
                        'it is compute-bound')),
)}


class UtilisationMeter:
    """Counts one step's work and gives its utilisation figures (:data:`METRICS`).

    A figure above 1 means the run went faster than the peaks say the machine can: the cached
    peaks were measured while other processes ran (a loaded machine measures low). The first time
    that happens, ``remeasure`` (if given) measures them again (``machine_peaks(refresh=True)``
    keeps the best of the new and the cached figures, and caches it), the step's figures are
    computed against the new peaks, and :attr:`note` says so once (the trainer prints it).

    Args:
        shape: the policy's :class:`~echotrain.roofline.counts.TransformerShape`.
        peaks: the machine's :class:`~echotrain.roofline.peaks.Peaks`.
        param_bytes: bytes per stored weight; kv_bytes: bytes per cached K/V number.
        remeasure: a callable returning fresh :class:`~echotrain.roofline.peaks.Peaks`, called at most
            once per run (None: never).
    """

    def __init__(self, shape: Any, peaks: Any, *, param_bytes: int, kv_bytes: int,
                 remeasure: Callable[[], Any] | None = None):
        self.shape, self.peaks = shape, peaks
        self.param_bytes, self.kv_bytes = int(param_bytes), int(kv_bytes)
        self._remeasure = remeasure
        #: a one-time message for the user when the peaks were re-measured (None until then)
        self.note: str | None = None
        self.reset()

    def reset(self) -> None:
        """Zero the step's counters."""
        self.update_flops = 0
        self.prefill_flops = 0
        self.decode_bytes = 0
        self.decode_flops = 0
        #: the (prompt lengths, response lengths) of each generate call, for the decode steps' roofline
        #: seconds (per step max(bytes / bandwidth, FLOPs / GEMM rate)), computed against the peaks in
        #: :meth:`step_metrics`
        self.decode_calls: list[tuple[list[int], list[int]]] = []

    def log_prob_pass(self, batch: Any, grad: bool) -> None:
        """Count one log-prob forward of ``batch`` (a RolloutBatch; rows of one prompt group
        share its prompt, the groups their common prefix), x3 with ``grad`` (its backward follows)."""
        from echotrain.roofline.counts import batch_forward_flops, train_flops
        from echotrain.runtime.packing import common_prefix_of

        flops = batch_forward_flops(self.shape, batch.prompt_mask.sum(-1).tolist(),
                                    batch.response_mask.sum(-1).long().tolist(), batch.group_index.tolist(),
                                    common_prefix=common_prefix_of(batch.prompt_ids, batch.prompt_mask))
        self.update_flops += train_flops(flops) if grad else flops

    def generation(self, batch: Any, calls: Sequence[range]) -> None:
        """Count a rollout round: ``batch`` (RolloutBatch) generated in ``calls`` (the rows of
        each ``generate`` call). Prefill: each distinct prompt once, their common prefix once;
        decode: per call."""
        from echotrain.roofline.counts import decode_bytes, decode_flops, decode_roofline_seconds, prefill_flops
        from echotrain.runtime.packing import common_prefix_of

        p = batch.prompt_mask.sum(-1).tolist()
        r = batch.response_mask.sum(-1).long().tolist()
        first: dict[int, int] = {}
        for i, g in enumerate(batch.group_index.tolist()):
            first.setdefault(int(g), i)
        self.prefill_flops += prefill_flops(self.shape, [p[i] for i in first.values()],
                                            common_prefix=common_prefix_of(batch.prompt_ids, batch.prompt_mask))
        for rows in calls:
            pc, rc = p[rows.start:rows.stop], r[rows.start:rows.stop]
            nbytes = decode_bytes(self.shape, pc, rc, param_bytes=self.param_bytes, kv_bytes=self.kv_bytes)
            flops = decode_flops(self.shape, pc, rc)
            self.decode_bytes += nbytes
            self.decode_flops += flops
            self.decode_calls.append((pc, rc))

    def _figures(self, time_generation: float, time_update: float) -> dict[str, float]:
        from echotrain.roofline.counts import decode_roofline_seconds

        gemm, bw = self.peaks.gemm_flops_per_s, self.peaks.mem_bytes_per_s
        out = {}
        if time_update > 0:
            out["throughput/update_mfu"] = self.update_flops / (time_update * gemm)
        if time_generation > 0:
            decode = sum(decode_roofline_seconds(self.shape, pc, rc, param_bytes=self.param_bytes,
                                                 kv_bytes=self.kv_bytes, gemm_flops_per_s=gemm, mem_bytes_per_s=bw)
                         for pc, rc in self.decode_calls)
            out["throughput/decode_bw_util"] = (self.prefill_flops / gemm + decode) / time_generation
        return out

    def step_metrics(self, time_generation: float, time_update: float) -> dict[str, float]:
        """The figures of :data:`METRICS` for the counted step (then the counters restart);
        a figure whose phase took no time is left out. A figure above 1 re-measures the peaks
        once (class docstring)."""
        out = self._figures(time_generation, time_update)
        if self._remeasure is not None and any(v > 1.0 for v in out.values()):
            old = self.peaks
            self.peaks = self._remeasured_peaks(old)
            self._remeasure = None  # at most once per run
            before = ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in out.items())
            out = self._figures(time_generation, time_update)
            self.note = (f"echotrain: utilisation above 1 ({before}) against the cached peaks "
                         f"({old.gemm_flops_per_s / 1e9:.1f} GFLOP/s, {old.mem_bytes_per_s / 1e9:.1f} GB/s), "
                         "measured while other processes ran; re-measured: "
                         f"{self.peaks.gemm_flops_per_s / 1e9:.1f} GFLOP/s, {self.peaks.mem_bytes_per_s / 1e9:.1f} GB/s "
                         f"({self.peaks.source})")
        self.reset()
        return out

    def _remeasured_peaks(self, old: Any) -> Any:
        """Fresh peaks from the ``remeasure`` callable, never below ``old`` (figure by figure);
        ``old`` when measuring fails."""
        try:
            new = self._remeasure()
        except (RuntimeError, ValueError, OSError):
            return old
        return dataclasses.replace(new, gemm_flops_per_s=max(new.gemm_flops_per_s, old.gemm_flops_per_s),
                                   mem_bytes_per_s=max(new.mem_bytes_per_s, old.mem_bytes_per_s))


def generate_calls(n_rows: int, num_generations: int, rollout_rng: str, rollout_batch_size: int) -> list[range]:
    """The rows of each ``generate`` call of a round of ``n_rows`` rows: one per prompt group
    with ``rollout_rng=group``, else chunks of ``rollout_batch_size`` rows (0: one call)."""
    size = num_generations if rollout_rng == "group" else (rollout_batch_size or n_rows)
    return [range(s, min(s + size, n_rows)) for s in range(0, n_rows, max(size, 1))]


def decode_element_bytes(compute_dtype: torch.dtype) -> int:
    """Bytes a decode step reads per weight and per cached K/V number: the compute dtype's size.
    Under bf16 autocast the trainable weights are read as their cached bf16 copies (cast once a
    generate call; generation runs under no_grad), so 2 bytes, not the stored float32's 4; frozen
    weights (LoRA's base) are re-cast every forward, work the roofline bound leaves out (it shows
    as lower utilisation). The KV cache holds the compute dtype too."""
    return torch.empty((), dtype=compute_dtype).element_size()


def build_meter(model: Any, autocast_dtype: torch.dtype | None, device: torch.device,
                is_main: bool = True) -> tuple[UtilisationMeter | None, dict[str, Any]]:
    """The run's meter and run_info.json's ``roofline`` entry (the peaks and where they came
    from, the counted shape; or ``disabled`` with the reason and no meter). Ranks other than the
    main one (``is_main`` False) get no meter: only rank 0 writes metrics."""
    from echotrain.roofline import PeaksOff, UnsupportedModel, machine_peaks, shape_of
    from echotrain.roofline.peaks import PEAKS_ENV

    if not is_main:
        return None, {"disabled": "counted on rank 0 only"}
    try:
        shape = shape_of(model)
    except UnsupportedModel as exc:
        return None, {"disabled": str(exc)}
    param = next(model.parameters())
    compute_dtype = autocast_dtype or param.dtype
    try:
        peaks = machine_peaks(compute_dtype, device)
    except (PeaksOff, ValueError, RuntimeError, OSError) as exc:
        return None, {"disabled": f"no machine peaks: {exc}"}
    kv_bytes = param_bytes = decode_element_bytes(compute_dtype)
    threads = peaks.threads
    remeasure = None if os.environ.get(PEAKS_ENV) else (  # peaks the user set are never re-measured
        lambda: machine_peaks(compute_dtype, device, threads, refresh=True))
    meter = UtilisationMeter(shape, peaks, param_bytes=param_bytes, kv_bytes=kv_bytes, remeasure=remeasure)
    return meter, {"peaks": peaks.as_dict(), "shape": dataclasses.asdict(shape),
                   "param_bytes": meter.param_bytes, "kv_bytes": kv_bytes,
                   "metrics": {k: m.help for k, m in METRICS.items()}}
