"""The machine's two roofline peaks, measured once and cached: GEMM rate and memory bandwidth.

- GEMM rate (FLOP/s): the best of ``torch.mm`` calls over half a second, two ``n x n`` matrices
  (``2 n^3`` FLOPs each; n = 1024 on CPU, 4096 on CUDA) in the dtype the run computes in, on the
  thread count in use.
- memory bandwidth (bytes/s): the best rate of four streaming kernels over 256 MiB float32
  tensors, each counted by the bytes it reads and writes: ``dst.copy_(src)`` (2 x 256 MiB, the
  "copy" figure of STREAM, McCalpin 1995), in place ``a.add_(b)`` (3 x) and ``a.mul_(1)`` (2 x),
  and ``a.sum()`` (256 MiB read). A copy writes lines it never read, which a CPU first fetches
  (write-allocate), so copy alone understates what a kernel that updates in place or only reads
  moves: on a 2-core AMD EPYC (AVX-512) copy gave 34-67 GB/s, the in-place kernels 43-116 GB/s
  and torch's fused AdamW step (7 streams in place) 38-98 GB/s, in the same processes
  (``benchmarks/bench_bandwidth.py``); against copy alone the optimizer's utilisation read 1.6
  (docs/benchmarks.md).

Both are what torch reaches on this machine for these shapes, not vendor peak figures. A loaded
machine measures lower, so a figure measured under load can make a utilisation exceed 1 later,
when the machine is quieter (``benchmarks/bench_roofline.py`` re-measures and keeps the best).
:func:`machine_peaks` caches them in
``<$ECHOTRAIN_CACHE or ~/.cache/echotrain>/roofline/<machine>-<dtype>-t<threads>.json``
(two or three seconds the first time). ``ECHOTRAIN_ROOFLINE_PEAKS=GEMM_FLOPS,MEM_BYTES`` (e.g.
``1e12,1e11``) uses those figures and measures nothing (tests set it, so they are fast and
deterministic); ``ECHOTRAIN_ROOFLINE_PEAKS=off`` turns the utilisation figures off.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from echotrain.atomic import atomic_write_json

#: environment variable: ``GEMM_FLOPS,MEM_BYTES`` to use instead of measuring, or ``off``
PEAKS_ENV = "ECHOTRAIN_ROOFLINE_PEAKS"


@dataclass(frozen=True)
class Peaks:
    """Measured peaks. ``gemm_flops_per_s``: FLOP/s; ``mem_bytes_per_s``: bytes/s (read + written);
    ``source``: where they came from (a cache file, a fresh measurement, or the env variable);
    ``machine``, ``dtype``, ``threads``: what they were measured for."""

    gemm_flops_per_s: float
    mem_bytes_per_s: float
    source: str
    machine: str
    dtype: str
    threads: int

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (run_info.json's ``roofline.peaks``)."""
        return asdict(self)


class PeaksOff(RuntimeError):
    """``ECHOTRAIN_ROOFLINE_PEAKS=off``: the run reports no utilisation."""


def machine_name(device: torch.device) -> str:
    """A file-name-safe name of the processor: the CUDA device's name, else the CPU model name
    from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        name = name or platform.processor() or platform.machine() or "cpu"
        name = f"{name}-{os.cpu_count()}cpu"
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int, seconds: float) -> float:
    """The shortest of at least ``repeats`` timed calls of ``fn``, going on until ``seconds`` have
    passed (on a shared machine a longer window is likelier to hold a quiet moment)."""
    best, start = float("inf"), time.perf_counter()
    n = 0
    while n < repeats or time.perf_counter() - start < seconds:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def measure_gemm(dtype: torch.dtype, device: torch.device, n: int | None = None, repeats: int = 5,
                 seconds: float = 0.5) -> float:
    """Best FLOP/s of ``torch.mm`` of two ``n x n`` ``dtype`` matrices on ``device`` (after one
    warm-up; at least ``repeats`` calls and ``seconds`` of them); ``2 n^3`` FLOPs each. n defaults
    to 1024 (CPU) / 4096 (CUDA)."""
    n = n or (4096 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)  # its own generator: a run's RNG stream is untouched
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    torch.mm(a, b)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), device, repeats, seconds)


def measure_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5, seconds: float = 0.5) -> float:
    """Best bytes/s on ``device`` of four streaming kernels over ``mib`` MiB float32 tensors, each
    counted by what it reads and writes: ``dst.copy_(src)`` (2 x ``mib`` MiB), in place (no
    write-allocate) ``a.add_(b)`` (3 x) and ``a.mul_(1)`` (2 x), and ``a.sum()`` (1 x, read only);
    after one warm-up each, at least ``repeats`` calls and ``seconds`` per kernel. Why several:
    the module docstring."""
    numel = mib * 2**20 // 4
    a = torch.ones(numel, device=device)
    b = torch.ones_like(a)
    nbytes = a.numel() * a.element_size()
    kernels = ((2, lambda: a.copy_(b)), (3, lambda: a.add_(b)), (2, lambda: a.mul_(1.0)), (1, lambda: a.sum()))
    best = 0.0
    for streams, fn in kernels:
        fn()
        best = max(best, streams * nbytes / _best_seconds(fn, device, repeats, seconds))
    return best


def _from_env(value: str, machine: str, dtype: str, threads: int) -> Peaks:
    if value.strip().lower() == "off":
        raise PeaksOff(f"{PEAKS_ENV}=off")
    try:
        flops, bw = (float(x) for x in value.split(","))
        if not (flops > 0 and bw > 0):
            raise ValueError
    except ValueError:
        raise ValueError(f"{PEAKS_ENV}={value!r}: expected 'GEMM_FLOPS,MEM_BYTES' (two positive numbers, "
                         "e.g. 1e12,1e11) or 'off'") from None
    return Peaks(flops, bw, f"{PEAKS_ENV} (not measured)", machine, dtype, threads)


def machine_peaks(dtype: torch.dtype, device: torch.device, threads: int | None = None,
                  cache_dir: str | os.PathLike | None = None, refresh: bool = False) -> Peaks:
    """The peaks for ``dtype`` on ``device`` with ``threads`` intra-op threads (default: torch's
    current number): from ``$ECHOTRAIN_ROOFLINE_PEAKS``, else the cache file, else measured now
    (and cached). ``refresh`` measures again and keeps, per figure, the larger of the new and the
    cached value (a measurement taken while other processes ran is low; the best one seen is the
    machine's).

    Raises:
        PeaksOff: ``ECHOTRAIN_ROOFLINE_PEAKS=off``.
        ValueError: a malformed ``ECHOTRAIN_ROOFLINE_PEAKS``.
    """
    threads = int(threads or torch.get_num_threads())
    machine, dname = machine_name(device), str(dtype).removeprefix("torch.")
    env = os.environ.get(PEAKS_ENV, "")
    if env:
        return _from_env(env, machine, dname, threads)
    if cache_dir is None:
        from echotrain.cache import default_cache_dir

        cache_dir = default_cache_dir()
    path = Path(cache_dir) / "roofline" / f"{machine}-{dname}-t{threads}.json"
    old = None
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            old = (float(d["gemm_flops_per_s"]), float(d["mem_bytes_per_s"]), d.get("measured_at", "?"),
                   int(d.get("measurements", 1)))
        except (ValueError, KeyError, TypeError):
            old = None  # a damaged cache file: measure again
    if old is not None and not refresh:
        return Peaks(old[0], old[1], f"cached {path} (best of {old[3]} measurement(s), last {old[2]})", machine,
                     dname, threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops, bw = measure_gemm(dtype, device), measure_bandwidth(device)
    finally:
        torch.set_num_threads(previous)
    count = 1
    if old is not None:  # refresh: keep the best the machine has shown (a loaded moment measures low)
        flops, bw, count = max(flops, old[0]), max(bw, old[1]), old[3] + 1
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        atomic_write_json(path, {"gemm_flops_per_s": flops, "mem_bytes_per_s": bw, "measured_at": stamp,
                                 "measurements": count, "machine": machine, "dtype": dname, "threads": threads,
                                 "torch": torch.__version__})
        where = f"measured {stamp}, best of {count} measurement(s), cached in {path}"
    except OSError:
        where = f"measured {stamp} (cache {path} not writable)"
    return Peaks(flops, bw, where, machine, dname, threads)
