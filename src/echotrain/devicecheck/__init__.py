"""``echotrain device-check``: the CUDA path of echotrain, run and asserted on one GPU in one command.

    echotrain device-check                       # on a GPU machine: every check (sized for 8 min; 448 s of checks on an H200)
    echotrain device-check --dry-run             # the same code on the CPU with tiny settings (~2 min)
    echotrain device-check --only optimizers,decode --out device_check

The checks (:data:`CHECKS`, in order; each asserts, not just runs):

- ``default_job``: the default job on the GPU through the real CLI (``steps=16``): device and
  autocast resolved and why (bf16 autocast on a GPU with native bf16), held-out greedy accuracy
  at the end above the start, step time, peak memory.
- ``placement``: one training step in-process under a dispatch audit: every matrix product,
  attention, softmax, embedding and optimizer kernel takes device tensors, the parameters,
  gradients and optimizer state live on the device (no hidden CPU fallback).
- ``optimizers``: fused AdamW and AdamW4bit on the device against the CPU on the same
  parameters (rtol 1e-5 / atol 1e-6, < 0.1% of 4-bit codes), bytes per parameter, step time
  against torch AdamW foreach, compiled (Triton) 4-bit update == eager.
- ``decode``: echotrain's decode loop against ``generate``: greedy tokens equal (>= 90% of rows
  on CUDA, where other batch shapes round differently), sampled tokens
  from one seed (equal rows reported), the speed ratio.
- ``resume``: SIGKILL after step 3 of 6, ``--resume``, the step-6 weights and optimizer state
  against an uninterrupted run: bit-equal with deterministic kernels; the ops without a
  deterministic CUDA kernel are listed (``torch.use_deterministic_algorithms(warn_only=True)``).
- ``torchrun``: ``torchrun --nproc_per_node 1`` on NCCL (and 2 where two GPUs exist).
- ``trl_vllm``: the TRL adapter generating with vLLM, vLLM's log-probs as ``rollout_log_prob``
  and the mismatch metrics logged (skipped with the reason when vLLM is not installed).
- ``overlap``: generation beside the update on two CUDA streams (or two GPUs):
  the overlap bound and what was reached (:mod:`echotrain.devicecheck.overlap`).

It writes ``<out>/summary.json`` and ``<out>/summary.md`` (figures as ratios against a baseline
of the same run, memory in bytes per parameter, the GPU's name) for docs/benchmarks.md, after
every check (a run stopped midway keeps what finished; a failed check keeps the figures it
measured), and exits 1 when a check failed. ``--dry-run`` (or a machine without CUDA) runs every check on the
CPU with the testbed policy: the test suite runs it (tests/test_device_check.py), so the GPU
script's code is exercised between GPU loans. :data:`CUDA_BRANCHES` names the check that
executes each CUDA-only branch of the package (tests/test_device_guards.py keeps it complete).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from echotrain.devicecheck.common import CheckFailed, Context

#: check name -> "module:function" (imported when the check runs), in the order they run
CHECKS: dict[str, str] = {
    "default_job": "echotrain.devicecheck.train_checks:check_default_job",
    "placement": "echotrain.devicecheck.train_checks:check_placement",
    "optimizers": "echotrain.devicecheck.kernel_checks:check_optimizers",
    "decode": "echotrain.devicecheck.kernel_checks:check_decode",
    "resume": "echotrain.devicecheck.train_checks:check_resume",
    "torchrun": "echotrain.devicecheck.train_checks:check_torchrun",
    "trl_vllm": "echotrain.devicecheck.trl_check:check_trl_vllm",
    "overlap": "echotrain.devicecheck:check_overlap",
}

#: each function of the package with a CUDA-only branch (echotrain.devicecheck.scan.cuda_branches,
#: ``module:qualname``) -> the check that executes that branch on a GPU
CUDA_BRANCHES: dict[str, str] = {
    "models/hf.py:global_rng_kept": "default_job",  # load_policy on cuda forks the CUDA RNG
    "optim/adamw4bit.py:_compile_available": "optimizers",  # the compiled (Triton) update
    "roofline/peaks.py:_sync": "default_job",  # the machine peaks measured on the GPU
    "roofline/peaks.py:machine_name": "default_job",
    "roofline/peaks.py:measure_gemm": "default_job",
    "runtime/precision.py:_hardware": "default_job",  # autocast_reason on a GPU
    "runtime/precision.py:_probe_native_bf16": "default_job",
    "runtime/preflight.py:check_device": "default_job",  # device=cuda checked before the model loads
    "runtime/device.py:resolve_device_why": "placement",  # device=cuda... / auto on a GPU
    "runtime/device.py:rng_devices": "default_job",  # the evaluations' and rollout_rng=group's CUDA RNG fork
    "train/checkpoint.py:rng_state": "resume",  # CUDA RNG states saved
    "train/checkpoint.py:set_rng_state": "resume",  # ... and restored
    "train/config/validate.py:validate": "default_job",
    "train/dist.py:resolve_backend": "torchrun",  # nccl
    "train/metrics.py:peak_memory_mb": "default_job",  # memory/peak_mb from the CUDA allocator
    "train/trainer.py:Trainer._init": "torchrun",  # cuda -> cuda:LOCAL_RANK under torchrun
}


def check_overlap(ctx: Context) -> dict[str, Any]:
    """Generation and the update at once (:mod:`echotrain.devicecheck.overlap`): on one GPU two
    CUDA streams (on two GPUs, generation on the first, the update on the second); the overlap
    bound ``(g + u) / max(g, u)`` and the reached ``(g + u) / both``, ratios of one run. Asserts
    only that both phases ran (the gain is a measurement, not a property)."""
    from echotrain.devicecheck.common import require
    from echotrain.devicecheck.overlap import main as overlap

    import torch

    if not ctx.is_cuda:
        res = overlap(["--devices", "cpu", "--model", "testbed", "--reps", "1", "--new-tokens", "4", "--prompts", "2",
                       "--generations", "2"])
        return {"cpu_smoke": res}
    out = {"one_gpu_two_streams": overlap(["--devices", str(ctx.device), "--reps", "3"])}
    if torch.cuda.device_count() >= 2:
        out["two_gpus"] = overlap(["--devices", "cuda:0,cuda:1", "--reps", "3"])
    require(all(r["g_s"] > 0 and r["u_s"] > 0 for r in out.values()), "a phase took no time", out)
    return out


def _load(target: str) -> Callable[[Context], dict[str, Any]]:
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def run_checks(ctx: Context, names: list[str]) -> dict[str, Any]:
    """Run the checks ``names`` (keys of :data:`CHECKS`, in :data:`CHECKS` order) and write
    ``summary.json`` / ``summary.md`` under ``ctx.out``.

    Returns:
        the summary: ``machine`` (GPU name, torch, CUDA), ``checks`` (name -> ``status``:
        passed / failed / skipped, ``seconds``, the figures or ``error`` / ``reason``),
        ``passed`` (no check failed) and ``total_s``.
    """
    import torch

    from echotrain.devicecheck.trl_check import Skipped

    ctx.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "machine": {"device": str(ctx.device), "name": ctx.gpu_name(), "gpus": torch.cuda.device_count(),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine(),
                    "dry_run": ctx.dry_run},
        "checks": {},
    }
    t_all = time.perf_counter()
    for name in [n for n in CHECKS if n in names]:
        t0 = time.perf_counter()
        print(f"device-check: {name} ...", flush=True)
        try:
            row: dict[str, Any] = {"status": "passed", **_load(CHECKS[name])(ctx)}
        except Skipped as exc:
            row = {"status": "skipped", "reason": str(exc)}
        except CheckFailed as exc:  # the figures measured before the assertion are kept
            row = {**exc.figures, "status": "failed", "error": str(exc)}
        except Exception as exc:  # noqa: BLE001  (a crash is a failed check; the others still run)
            row = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        if ctx.is_cuda:  # the next check (vLLM's share of the GPU) starts from free memory
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        summary["checks"][name] = row
        print(f"device-check: {name} {row['status']} ({row['seconds']} s)"
              + (f": {row.get('error') or row.get('reason')}" if row["status"] != "passed" else ""), flush=True)
        summary["total_s"] = round(time.perf_counter() - t_all, 1)
        write_summary(ctx.out, summary)  # after every check: a run killed later keeps what finished
    summary["total_s"] = round(time.perf_counter() - t_all, 1)
    return write_summary(ctx.out, summary)


def write_summary(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Set ``summary["passed"]`` (no check failed) and write ``summary.json`` and ``summary.md``
    (:func:`markdown`) under ``out``, each atomically.

    Args:
        summary: ``machine`` (as :func:`run_checks` records it), ``checks`` (name -> row with
            ``status`` and ``seconds``), ``total_s``.

    Returns:
        ``summary``, with ``passed`` set."""
    from echotrain.atomic import atomic_write_text

    summary["passed"] = all(r["status"] != "failed" for r in summary["checks"].values())
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str))
    atomic_write_text(out / "summary.md", markdown(summary))
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (one row per check, its figures flattened), headed by
    the machine, for docs/benchmarks.md."""
    m = summary["machine"]
    lines = [f"### echotrain device-check on {m['name']} ({m['gpus']} GPU(s), torch {m['torch']}, CUDA {m['cuda']}"
             f"{', dry run' if m['dry_run'] else ''}): {'passed' if summary['passed'] else 'FAILED'} in "
             f"{summary['total_s']} s", "", "| check | status | s | figures |", "|---|---|---|---|"]
    for name, row in summary["checks"].items():
        figures = {k: v for k, v in row.items() if k not in ("status", "seconds", "traceback")}
        text = json.dumps(figures, default=str).replace("|", "/")
        lines.append(f"| {name} | {row['status']} | {row['seconds']} | {text[:900]} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``echotrain device-check``; 0 when every check passed or was skipped."""
    import torch

    from echotrain.errors import ConfigError

    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        print("device-check: no CUDA GPU here (torch.cuda.is_available() is False): the CPU dry run", flush=True)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ConfigError(f"--only: unknown check(s) {', '.join(unknown)}; valid: {', '.join(CHECKS)}")
    if not dry and not args.device.startswith("cuda"):
        raise ConfigError(f"--device {args.device!r}: the device check tests a CUDA GPU (cuda or cuda:N); "
                          "--dry-run runs it on the CPU")
    if not dry:
        from echotrain.runtime.preflight import check_device

        check_device(args.device, key="--device")
    device = torch.device("cpu" if dry else args.device)
    summary = run_checks(Context(device=device, dry_run=dry, out=Path(args.out)), names)
    print(f"device-check: {'passed' if summary['passed'] else 'FAILED'} in {summary['total_s']} s; "
          f"{Path(args.out) / 'summary.md'}", flush=True)
    return 0 if summary["passed"] else 1


def register(parser: argparse.ArgumentParser) -> None:
    """Options of ``echotrain device-check``."""
    parser.add_argument("--dry-run", action="store_true",
                        help="run every check on the CPU with tiny settings (the testbed policy): the code path, "
                             "not the figures (also chosen when no CUDA GPU is visible)")
    parser.add_argument("--device", default="cuda", help="the GPU under test (default cuda = cuda:0)")
    parser.add_argument("--only", default="", help=f"comma-separated checks to run (default all): {', '.join(CHECKS)}")
    parser.add_argument("--out", default="device_check", help="folder of the runs, logs and summary.json / summary.md")
    parser.set_defaults(func=run)
