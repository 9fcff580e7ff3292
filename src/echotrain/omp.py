"""How OpenMP worker threads wait, chosen from the machine's load at start (before torch loads).

The ``echotrain`` command calls :func:`set_omp_wait_policy` first thing (libgomp reads the
setting once, when torch loads); the startup line and ``run_info.json`` report
:func:`omp_wait_in_force`. Linux ``/proc/stat`` gives the load (:func:`cpu_ticks`,
:func:`other_cpu_load`). This module imports neither torch nor anything of echotrain, so every
layer may use it.
"""

from __future__ import annotations

import os


#: other processes using at least this many cores' worth of CPU at start -> passive OpenMP waits
BUSY_CORES = 0.5
#: libgomp spin count of a waiting worker thread on a quiet machine (its default: 300000)
SPINCOUNT = 3000


def cpu_ticks(stat: str, cpus: set[int] | None = None) -> tuple[int, int, int]:
    """``(busy, total, n)``: clock ticks since boot from the text of Linux ``/proc/stat``, summed
    over the CPUs ``cpus`` (their ``cpuN`` lines; None, or none of them listed: the aggregate
    ``cpu`` line over all ``n`` CPUs that have a line).

    A line's fields are user nice system idle iowait irq softirq steal guest guest_nice (the last
    two are already counted in user / nice, so they are left out): total = the first eight,
    busy = total - idle - iowait.

    Raises:
        ValueError: no ``cpu`` line, or one with fewer than 4 numbers.
    """
    lines = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu"):
            lines[name] = [int(x) for x in rest.split()]
    per_cpu = {int(k[3:]): v for k, v in lines.items() if k[3:].isdigit()}
    chosen = [per_cpu[c] for c in sorted(cpus) if c in per_cpu] if cpus else []
    if chosen:
        n = len(chosen)
    elif "cpu" in lines:
        chosen, n = [lines["cpu"]], max(len(per_cpu), 1)
    else:
        raise ValueError("/proc/stat: no cpu line")
    busy = total = 0
    for fields in chosen:
        if len(fields) < 4:
            raise ValueError(f"/proc/stat: a cpu line has {len(fields)} numbers, expected at least 4")
        t = sum(fields[:8])
        busy, total = busy + t - fields[3] - (fields[4] if len(fields) > 4 else 0), total + t
    return busy, total, n


def other_cpu_load(sample_s: float = 0.2) -> float | None:
    """Cores' worth of CPU time spent busy over ``sample_s`` seconds on the CPUs this process may
    run on (``os.sched_getaffinity``; all processes, this one sleeps meanwhile), from Linux
    ``/proc/stat`` (:func:`cpu_ticks`); None where that cannot be read."""
    import time

    try:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        with open("/proc/stat") as f:
            busy0, total0, n = cpu_ticks(f.read(), cpus)
        time.sleep(sample_s)
        with open("/proc/stat") as f:
            busy1, total1, _ = cpu_ticks(f.read(), cpus)
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return (busy1 - busy0) / (total1 - total0) * n


def set_omp_wait_policy(environ: dict[str, str] | None = None, load: float | None = None) -> str:
    """Choose how OpenMP worker threads wait, from the machine's load at start (unless the user chose).

    libgomp's default lets an idle worker spin ~300k times before it sleeps: fast on a quiet
    machine, but next to another busy process the spinning threads and the descheduled partner
    make a 2-thread step ~2x slower than a 1-thread one. ``OMP_WAIT_POLICY=PASSIVE`` (sleep at
    once) is the most robust under contention (1.05x) but costs 1.2x on a quiet machine for the
    RL step's small ops; a bounded spin of :data:`SPINCOUNT` (``GOMP_SPINCOUNT``) is as fast as
    the default when quiet and 1.34x under one competitor (docs/benchmarks.md, "Contention").
    So: when other processes use at least :data:`BUSY_CORES` cores over a short sample at start
    (:func:`other_cpu_load`), or the load cannot be read, set ``OMP_WAIT_POLICY=PASSIVE`` in
    ``environ`` (default ``os.environ``); otherwise ``GOMP_SPINCOUNT=3000``, which also bounds
    the cost of a competitor that starts later. A user's ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is left alone. It must run before torch is imported (libgomp reads it once).

    Args:
        environ: the environment to update (default ``os.environ``).
        load: the measured load in cores (default: measure it with :func:`other_cpu_load`).
    Returns:
        "PASSIVE", "GOMP_SPINCOUNT=3000", or the user's setting.
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        load = other_cpu_load() if load is None else load
        if load is None or load >= BUSY_CORES:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            env["GOMP_SPINCOUNT"] = str(SPINCOUNT)
    return omp_wait_in_force(env)


def omp_wait_in_force(environ: dict[str, str] | None = None) -> str:
    """The OpenMP wait setting of ``environ`` (default ``os.environ``), for logs and run_info:
    its ``OMP_WAIT_POLICY``, else ``GOMP_SPINCOUNT=<n>``, else ``"default"`` (libgomp's own)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:
        return env["OMP_WAIT_POLICY"]
    if "GOMP_SPINCOUNT" in env:
        return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}"
    return "default"
