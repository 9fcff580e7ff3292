"""Rooflines: how close a run's phases come to what the machine allows.

- :mod:`echotrain.roofline.counts`  pure: matmul FLOPs of transformer passes, bytes of decode steps
- :mod:`echotrain.roofline.shapes`  a loaded model's :class:`TransformerShape` (Llama-style HF, looped)
- :mod:`echotrain.roofline.peaks`   the machine's GEMM rate and memory bandwidth, measured once, cached

The trainer's use of them (``throughput/update_mfu``, ``throughput/decode_bw_util``) is in
:mod:`echotrain.train.utilisation`; ``benchmarks/bench_roofline.py`` prints them per phase.
"""

from echotrain.roofline.counts import (TransformerShape, batch_forward_flops, causal_pairs, decode_bytes, decode_flops,
                                       decode_roofline_seconds,
                                       forward_flops,
                                       group_forward_flops, prefill_flops, shared_prefix_saving, train_flops)
from echotrain.roofline.peaks import PEAKS_ENV, Peaks, PeaksOff, machine_peaks, measure_bandwidth, measure_gemm
from echotrain.roofline.shapes import LLAMA_STYLE, UnsupportedModel, shape_of

__all__ = ["TransformerShape", "batch_forward_flops", "causal_pairs", "decode_bytes", "decode_flops", "decode_roofline_seconds", "forward_flops",
           "group_forward_flops", "prefill_flops", "shared_prefix_saving", "train_flops", "PEAKS_ENV", "Peaks", "PeaksOff", "machine_peaks",
           "measure_bandwidth", "measure_gemm", "LLAMA_STYLE", "UnsupportedModel", "shape_of"]
