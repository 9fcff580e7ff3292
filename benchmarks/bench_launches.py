"""What a GPU would launch: aten ops and host syncs per phase of one training step, counted on the CPU.

On a GPU a small model's step is bound by the host, not the device: every aten op is a kernel
launch (plus Python, dispatcher and autograd work, ~10-50 us each), and every op whose result
the host reads (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask indexing) waits for the
queue to drain. ``echotrain device-check`` on an H200 (docs/benchmarks.md, "GPU") measured the
default job at a median 4.9 s a step with the update at 0.08% of the GEMM peak, which these counts
put down to launches. The model's ops a step dispatches hardly depend on where they run (CUDA's
autocast and attention kernels differ in a few ops a layer), so this script counts on the CPU
what a GPU step pays for, setting by setting::

    python benchmarks/bench_launches.py                        # the default job, one step
    python benchmarks/bench_launches.py --arm packed_attention=mask --arm decode_loop=generate

Each ``--arm`` is a space-separated list of ``key=value`` job settings applied on top of the job
(the first row is the job itself). Ops are counted with a dispatch mode inside ``train_step``,
attributed to the phase running (collect = generation and rewards; old_log_prob; update = the
mini-batches' forward, backward and optimizer steps; advantages; metrics; other). Syncs are a
lower bound: ``.tolist()`` and ``.cpu()`` of a CPU tensor dispatch nothing here but copy on CUDA.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _job import JOB_OPTIONS, add_job_arguments  # noqa: E402

from echotrain.atomic import atomic_write_json  # noqa: E402

#: aten ops (name before the overload) whose result the host reads on CUDA: each waits for the queue
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                      "equal", "is_nonzero", "repeat_interleave"})

#: the phases, as (where the function lives, its name): the trainer module's names and the trainer's methods
PHASES = (("module", "old_log_probs", "old_log_prob"), ("module", "step_record", "metrics"),
          ("module", "compute_token_advantages", "advantages"), ("trainer", "update_mini_batch", "update"))


def _is_sync(name: str, args: tuple) -> bool:
    """Whether aten op ``name`` (``base.overload``) with ``args`` makes a CUDA host wait: an op of
    :data:`SYNC_OPS`, or indexing (read or write) with a boolean mask (a ``nonzero`` inside)."""
    import torch

    base = name.split(".")[0]
    if base in SYNC_OPS:
        return True
    if base in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


def count_step(overrides: dict[str, str], out_dir: str) -> dict[str, Any]:
    """Build the job with ``overrides`` (``key=value`` settings as on the command line; the run
    writes into ``out_dir``) and run its first training step under a counting dispatch mode. The
    trainer module's functions it labels are put back afterwards.

    Returns:
        ``{"ops": {phase: n}, "syncs": {phase: n}, "top_ops": [(aten op, n), ...]}`` (the 12 most
        dispatched ops of the step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import echotrain.train.trainer as trainer_module
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import Trainer

    phase = ["other"]

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.syncs: collections.Counter = collections.Counter()
            self.names: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[phase[0]] += 1
            self.names[func.__name__] += 1
            if _is_sync(func.__name__, args):
                self.syncs[phase[0]] += 1
            return func(*args, **(kwargs or {}))

    keys = {"steps": "1", "eval_prompts": "0", "plots": "false", "save_every": "0", "output_dir": out_dir,
            **overrides}
    trainer = Trainer(resolve_config(None, keys))
    trainer.rollouts.rollouts_for = labelled(trainer.rollouts.rollouts_for, phase, "collect")
    counter = Count()
    trainer.train_step = functools.partial(_under, counter, trainer.train_step)  # count inside the step only
    saved = {}
    try:
        for where, name, label in PHASES:
            if where == "module":
                saved[name] = getattr(trainer_module, name)
                setattr(trainer_module, name, labelled(saved[name], phase, label))
            else:
                setattr(trainer, name, labelled(getattr(trainer, name), phase, label))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the run's summary table
            trainer.train()
    finally:
        for name, fn in saved.items():
            setattr(trainer_module, name, fn)
    return {"ops": dict(counter.ops), "syncs": dict(counter.syncs), "top_ops": counter.names.most_common(12)}


def labelled(fn: Any, phase: list[str], label: str) -> Any:
    """``fn`` that sets ``phase[0]`` to ``label`` while it runs (the counting mode reads it) and
    puts the previous phase back afterwards, also when ``fn`` raises."""
    def run(*args: Any, **kwargs: Any) -> Any:
        before, phase[0] = phase[0], label
        try:
            return fn(*args, **kwargs)
        finally:
            phase[0] = before
    return run


def _under(mode: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` inside the dispatch mode ``mode``."""
    with mode:
        return fn(*args)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Count one step of the job and of each ``--arm``; print the table (ops and syncs per phase,
    total, ratio to the job) and each arm's most dispatched ops.

    Returns:
        arm name (``"job"`` first, then each ``--arm`` as written) -> :func:`count_step`'s dict
        plus ``total_ops`` and ``ratio`` (total ops / the job's, 3 decimals).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(ap, threads=2, reps=None)
    ap.add_argument("--arm", action="append", default=[], help="space-separated key=value settings of one more row")
    ap.add_argument("--json", default=None, help="also write the counts here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    base = {key: str(getattr(args, opt)) for opt, key in JOB_OPTIONS.items() if getattr(args, opt) is not None}
    arms = {"job": {}}
    for arm in args.arm:
        arms[arm] = dict(kv.split("=", 1) for kv in arm.split())
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, over) in enumerate(arms.items()):
            results[name] = count_step({**base, "num_threads": str(args.threads), **over}, os.path.join(tmp, str(i)))
    phases = sorted({p for r in results.values() for p in r["ops"]}, key=lambda p: -results["job"]["ops"].get(p, 0))
    first = sum(results["job"]["ops"].values())
    print("| arm | " + " | ".join(f"{p} ops (syncs)" for p in phases) + " | total ops | / job |")
    print("|---|" + "---|" * (len(phases) + 2))
    for name, r in results.items():
        total = sum(r["ops"].values())
        r["total_ops"], r["ratio"] = total, round(total / first, 3)
        cells = [f"{r['ops'].get(p, 0)} ({r['syncs'].get(p, 0)})" for p in phases]
        print(f"| {name} | " + " | ".join(cells) + f" | {total} | {r['ratio']:.2f} |")
    for name, r in results.items():
        print(f"{name}: most dispatched {r['top_ops'][:8]}")
    if args.json:
        atomic_write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
