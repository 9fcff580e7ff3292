"""The trainer's checks of ``echotrain device-check``: the default job, where its tensors and
kernels run, resume after a kill, and torchrun.

Each ``check_*(ctx)`` returns a dict of figures and raises
:class:`~echotrain.devicecheck.common.CheckFailed` when an assertion does not hold.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from echotrain.devicecheck.common import (CheckFailed, Context, child_env, echotrain_cmd, read_jsonl, require,
                                          run_echotrain, run_logged, tensors_of)


def check_default_job(ctx: Context) -> dict[str, Any]:
    """The default job (``echotrain train`` with its defaults, ``steps`` short) on the device
    under test through the real CLI: the device and autocast it resolved and why (startup line
    and run_info.json), greedy held-out accuracy at the end above the start; reported: the median
    step, generation and update times, the update's model FLOP utilisation and generation's
    bandwidth utilisation (``throughput/*``, fractions of the peaks measured at startup) and the
    peak memory. A GPU with native bf16 must resolve ``autocast=auto`` to bfloat16 (mixed
    precision: bf16 matrix products, float32 weights / optimizer / losses; runtime/precision.py).
    Dry run: the testbed policy, 8 steps (its greedy accuracy rises 0.25 -> 0.28 on 2 CPU cores)."""
    run = ctx.out / "default_job"
    keys = [f"device={ctx.device}", f"output_dir={run}", "plots=false"]
    keys += ["model=testbed", "task=testbed", "steps=8", "num_threads=1"] if ctx.dry_run else ["steps=16"]
    log = ctx.out / "logs" / "default_job.log"
    t0 = time.perf_counter()
    run_echotrain(ctx, ["train", *keys], log, timeout=300)
    wall = time.perf_counter() - t0
    text = log.read_text()
    info = json.loads((run / "run_info.json").read_text())
    evals = read_jsonl(run / "eval.jsonl")
    metrics = read_jsonl(run / "metrics.jsonl")
    out = {"device": info["device"], "device_reason": info["device_reason"], "autocast": info["autocast"],
           "autocast_reason": info["autocast_reason"], "steps": len(metrics),
           "eval_accuracy_start": evals[0]["eval/accuracy"] if evals else None,
           "eval_accuracy_end": evals[-1]["eval/accuracy"] if evals else None,
           "median_step_s": _median(metrics, "time/step"), "median_generation_s": _median(metrics, "time/generation"),
           "median_update_s": _median(metrics, "time/update"),
           "median_update_mfu": _median(metrics, "throughput/update_mfu"),
           "median_decode_bw_util": _median(metrics, "throughput/decode_bw_util"),
           "peak_memory_mb": max((m.get("memory/peak_mb", 0.0) for m in metrics), default=None),
           "wall_s": round(wall, 1)}
    # the figures are gathered first: a failed assertion still reports them
    require(torch.device(info["device"]).type == ctx.device.type,
            f"run_info.json device {info['device']!r}, expected {ctx.device.type}", out)
    require(f"device {info['device']} (because {info['device_reason']})" in text,
            "the startup line does not say the device and why", out)
    from echotrain.runtime.precision import native_bf16

    if ctx.is_cuda:
        want = "bfloat16" if native_bf16("cuda") else "off"
        require(info["autocast"] == want, f"autocast resolved to {info['autocast']!r} on this GPU, expected {want!r} "
                                          f"({info['autocast_reason']})", out)
    require(len(evals) >= 2, f"eval.jsonl has {len(evals)} lines, expected the start and the end evaluation", out)
    start, end = out["eval_accuracy_start"], out["eval_accuracy_end"]
    require(end > start, f"greedy held-out accuracy did not rise: start {start}, end {end}", out)
    return out


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the records that have it (the mean of the middle two for an
    even count), rounded to 4 significant digits; None when none has it. Step times in seconds,
    utilisations as fractions of the measured peak."""
    values = [r[key] for r in records if r.get(key) is not None]
    return float(f"{statistics.median(values):.4g}") if values else None


#: aten ops whose inputs must all be on the device under test in a CUDA step (the matrix
#: products, attention, softmax, norms, embedding lookups, the optimizer's and the finite
#: check's multi-tensor kernels, token sampling); index bookkeeping on the host (the packed
#: layout's cumsum over block lengths, Python-side counts) is not a fallback and not listed
HEAVY_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "scaled_dot_product", "_softmax", "_log_softmax",
             "embedding", "layer_norm", "rms_norm", "_fused_adam", "_foreach_", "multinomial")


class DeviceAudit(TorchDispatchMode):
    """Counts, per aten op in :data:`HEAVY_OPS`, the device types of its tensor arguments: a
    heavy op with a non-scalar CPU input on a CUDA run is a hidden CPU fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(h) or h in name for h in HEAVY_OPS):
            devs = {t.device.type for t in tensors_of(list(args) + list((kwargs or {}).values())) if t.dim() > 0}
            for d in devs:
                self.seen[(name, d)] += 1
        return func(*args, **(kwargs or {}))


def check_placement(ctx: Context) -> dict[str, Any]:
    """One training step in this process under :class:`DeviceAudit`, then the devices of the
    model's parameters and gradients and of the optimizer's state: all on the device under test
    (the optimizer's ``step`` counts excepted, which torch keeps on the host unless ``fused`` or
    ``capturable``). No heavy op may take a non-scalar CPU tensor on a CUDA run."""
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import Trainer

    keys = dict(k.split("=", 1) for k in ctx.job_keys())
    keys.update(steps="1", output_dir=str(ctx.out / "placement"), save_every="0")
    cfg = resolve_config(None, keys)
    found: dict[str, Any] = {}

    def after_step(step: int, record: dict) -> None:
        off = [n for n, p in trainer.model.named_parameters() if p.device.type != ctx.device.type]
        off += [f"{n}.grad" for n, p in trainer.model.named_parameters()
                if p.grad is not None and p.grad.device.type != ctx.device.type]
        opt = trainer.optimizer
        for group in getattr(opt, "base_optimizer", opt).param_groups:
            host_step = not (group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                for key, value in getattr(opt, "base_optimizer", opt).state.get(p, {}).items():
                    if torch.is_tensor(value) and value.device.type != ctx.device.type and not (key == "step" and host_step):
                        off.append(f"optimizer state {key} of a {tuple(p.shape)} parameter")
        found["off_device"] = off
        found["optimizer_state_tensors"] = sum(len(s) for s in getattr(opt, "base_optimizer", opt).state.values())

    trainer = Trainer(cfg, callbacks=[after_step])
    audit = DeviceAudit()
    with audit:
        trainer.train()
    by_device = Counter()
    for (_, dev), n in audit.seen.items():
        by_device[dev] += n
    cpu_ops = sorted({op for (op, dev) in audit.seen if dev == "cpu"})
    out = {"heavy_ops_by_device": dict(by_device), "heavy_ops_with_cpu_inputs": cpu_ops,
           "optimizer_state_tensors": found.get("optimizer_state_tensors"), "off_device": found.get("off_device", [])[:8]}
    require(not found.get("off_device"), f"tensors off {ctx.device.type}: {found.get('off_device', [])[:8]}", out)
    if ctx.is_cuda:
        require(not cpu_ops, f"heavy ops ran with CPU inputs on a CUDA run: {cpu_ops}", out)
    require(by_device.get(ctx.device.type, 0) > 0, f"no heavy op ran on {ctx.device.type}", out)
    return out


def _checkpoint(run: Path, step: int) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / f"step_{step:08d}.pt", map_location="cpu", weights_only=False)


def _state_diff(a: Any, b: Any) -> tuple[bool, float]:
    """(bit-equal, max |a - b|) over the tensors of two state dicts."""
    ta, tb = tensors_of(a), tensors_of(b)
    if len(ta) != len(tb):
        return False, float("inf")
    equal, worst = True, 0.0
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf")
        if not torch.equal(x, y):
            equal = False
            if x.is_floating_point():
                worst = max(worst, float((x.double() - y.double()).abs().max()))
    return equal, worst


_NONDET = re.compile(r"(\S+) does not have a deterministic implementation")


def _nondeterministic_ops(*logs: Path) -> list[str]:
    return sorted({m.group(1) for log in logs if log.exists() for m in _NONDET.finditer(log.read_text())})


#: steps of the resume check's runs
STEPS = 6


def check_resume(ctx: Context) -> dict[str, Any]:
    """Resume exactness after a kill: a run of 6 steps with a checkpoint every 2 is killed with
    SIGKILL once its third step's metrics are written (it may have reached step 5 by the time the
    signal lands; the latest checkpoint is then step 2 or 4), ``--resume`` completes it, and its
    step-6 checkpoint (weights and optimizer state) is compared with an uninterrupted run's. Every run
    has ``torch.use_deterministic_algorithms(True, warn_only=True)``, so each op without a
    deterministic CUDA kernel warns; their names are the figure ``nondeterministic_ops``. Bit
    equality is asserted when that list is empty (always on the CPU); otherwise the resumed run
    must differ from the uninterrupted one by no more than a second uninterrupted run does."""
    keys = ctx.job_keys() + [f"steps={STEPS}", "save_every=2", "async_save=false"]
    env = child_env({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})  # deterministic cuBLAS workspaces
    logs = ctx.out / "logs"
    full = ctx.out / "resume_full"
    run_echotrain(ctx, ["train", *keys, f"output_dir={full}"], logs / "resume_full.log", 300, True, env)
    killed = ctx.out / "resume_killed"
    log = logs / "resume_killed.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(echotrain_cmd("train", *keys, f"output_dir={killed}", deterministic=True),
                                stdout=fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while len(read_jsonl(killed / "metrics.jsonl")) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reached = len(read_jsonl(killed / "metrics.jsonl"))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    require(3 <= reached < STEPS, f"the run to be killed wrote {reached} metrics lines before the kill, "
                                  f"expected 3 to {STEPS - 1} (log: {log})", {"killed_after_step": reached})
    run_echotrain(ctx, ["train", "--resume", str(killed)], logs / "resume_resumed.log", 300, True, env)
    a, b = _checkpoint(full, STEPS), _checkpoint(killed, STEPS)
    model_equal, model_diff = _state_diff(a["model"], b["model"])
    opt_equal, opt_diff = _state_diff(a["optimizer"], b["optimizer"])
    nondet = _nondeterministic_ops(logs / "resume_full.log", log, logs / "resume_resumed.log")
    out = {"killed_after_step": reached, "weights_bit_equal": model_equal, "optimizer_bit_equal": opt_equal, "max_weight_diff": model_diff,
           "max_optimizer_diff": opt_diff, "nondeterministic_ops": nondet}
    if not nondet:
        require(model_equal and opt_equal, f"resumed run differs from the uninterrupted one with only deterministic "
                                           f"ops: weights {model_diff:.3g}, optimizer {opt_diff:.3g}", out)
        return out
    again = ctx.out / "resume_full_again"
    run_echotrain(ctx, ["train", *keys, f"output_dir={again}"], logs / "resume_full_again.log", 300, True, env)
    _, noise = _state_diff(a["model"], _checkpoint(again, STEPS)["model"])
    out["run_to_run_weight_diff"] = noise
    require(model_diff <= max(noise, 0.0) * 10 or model_equal,
            f"resumed run differs by {model_diff:.3g}, 10x more than two uninterrupted runs ({noise:.3g})", out)
    return out


def check_torchrun(ctx: Context) -> dict[str, Any]:
    """``torchrun --nproc_per_node N echotrain train`` (2 steps) with N = 1, and N = 2 where two
    GPUs exist: NCCL on CUDA (gloo on the dry run); run_info.json must record the world size
    and backend, and every rank must have finished."""
    backend = "nccl" if ctx.is_cuda else "gloo"
    counts = [1] + ([2] if ctx.is_cuda and torch.cuda.device_count() >= 2 else [])
    out: dict[str, Any] = {"backend": backend, "world_sizes": counts}
    device = "cuda" if ctx.is_cuda else "cpu"
    keys = [k for k in ctx.job_keys() if not k.startswith("device=")]
    for n in counts:
        run = ctx.out / f"torchrun_{n}"
        cmd = [*echotrain_cmd()[:1], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
               "-m", "echotrain.cli", "train", *keys, f"device={device}", f"dist_backend={backend}", "steps=2",
               f"output_dir={run}"]
        t0 = time.perf_counter()
        run_logged(cmd, ctx.out / "logs" / f"torchrun_{n}.log", timeout=300)
        info = json.loads((run / "run_info.json").read_text())
        require((info["world_size"], info["dist_backend"]) == (n, backend),
                f"torchrun {n}: run_info has world_size {info['world_size']}, backend {info['dist_backend']!r}", out)
        require(len(read_jsonl(run / "metrics.jsonl")) == 2, f"torchrun {n}: metrics.jsonl does not hold 2 steps", out)
        out[f"wall_s_{n}"] = round(time.perf_counter() - t0, 1)
    if not ctx.is_cuda:
        out["note"] = "dry run: gloo on the CPU; NCCL needs a GPU"
    return out


__all__ = ["CheckFailed", "check_default_job", "check_placement", "check_resume", "check_torchrun", "DeviceAudit"]
