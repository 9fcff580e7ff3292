"""What every check of ``echotrain device-check`` shares: the run's :class:`Context` (device,
dry run, output folder, the settings of the small jobs), the :class:`CheckFailed` error, the
launcher of ``echotrain`` subprocesses and device-synchronised timing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


class CheckFailed(AssertionError):
    """A device check's assertion did not hold; the message names the figure and the bound.

    Attributes:
        figures: what the check measured before the assertion failed (the summary's row keeps
            them beside the error, so a failed check still reports its numbers).
    """

    def __init__(self, message: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.figures = dict(figures or {})


def require(ok: bool, message: str, figures: dict[str, Any] | None = None) -> None:
    """Raise :class:`CheckFailed` with ``message`` (and the ``figures`` measured so far) unless ``ok``."""
    if not ok:
        raise CheckFailed(message, figures)


#: tolerances of tests/optim/test_adamw4bit.py (4-bit steps against their reference) and
#: tests/optim/test_adamw4bit_compiled.py (m codes): parameters, fraction of m codes differing
PARAM_RTOL, PARAM_ATOL, MAX_CODE_MISMATCH = 1e-5, 1e-6, 1e-3


def params_agree(a: list[torch.Tensor], b: list[torch.Tensor], bound: float) -> tuple[bool, float, float]:
    """Whether two lists of parameters (same shapes, any devices) agree as a 4-bit optimizer's
    runs can: at most :data:`MAX_CODE_MISMATCH` of the elements beyond rtol :data:`PARAM_RTOL` /
    atol :data:`PARAM_ATOL`, none further apart than ``bound`` (the steps' largest possible
    movement, e.g. steps x lr) and no NaN or Inf in either. A 4-bit code that flips at a near-tie,
    because one run rounds a product differently (another device, or the compiled kernel against
    eager), moves its element by one quantisation step: rare and small, not a bug.

    Returns:
        ``(ok, max |a - b|, fraction of elements beyond the tolerance)``; a non-finite element
        makes the maximum ``inf`` (and ``ok`` False).

    Raises:
        ValueError: the lists differ in length, or two paired tensors in shape.
    """
    if len(a) != len(b):
        raise ValueError(f"params_agree: {len(a)} tensors against {len(b)}")
    beyond, total, worst = 0, 0, 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise ValueError(f"params_agree: shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
        x, y = x.detach().cpu().double(), y.detach().cpu().double()
        beyond += int((~torch.isclose(x, y, rtol=PARAM_RTOL, atol=PARAM_ATOL)).sum())  # NaN is never close
        total += x.numel()
        if x.numel():
            worst = max(worst, float((x - y).abs().nan_to_num(nan=float("inf")).max()))
    frac = beyond / max(total, 1)
    return frac <= MAX_CODE_MISMATCH and worst <= bound, worst, frac


def first_moment_mismatch(opt_a: torch.optim.Optimizer, params_a: list[torch.Tensor],
                          opt_b: torch.optim.Optimizer, params_b: list[torch.Tensor]) -> tuple[float, float]:
    """How far two AdamW4bit runs' first moments are apart, over the paired parameters whose
    state holds 4-bit codes: ``(largest fraction of codes differing, largest relative difference
    of the per-block scales)``, a NaN scale difference counted as ``inf``; ``(0.0, 0.0)`` when no
    parameter has codes (e.g. the 1-D ones kept in float32)."""
    codes, scales = 0.0, 0.0
    for a, b in zip(params_a, params_b):
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        if "exp_avg_codes" in sa:
            codes = max(codes, float((sa["exp_avg_codes"].cpu() != sb["exp_avg_codes"].cpu()).float().mean()))
            ea, eb = sa["exp_avg_scale"].detach().cpu(), sb["exp_avg_scale"].detach().cpu()
            rel = ((eb - ea).abs() / ea.abs().clamp(min=1e-30)).nan_to_num(nan=float("inf"))
            scales = max(scales, float(rel.max()) if rel.numel() else 0.0)
    return codes, scales


def random_params(shapes: list[tuple[int, ...]], device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` (float32, N(0, 0.02^2)) drawn on the host from ``seed``, then moved
    to ``device``: the same values on every device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]


def random_grads(shapes: list[tuple[int, ...]], device: torch.device, step: int) -> list[torch.Tensor]:
    """Gradients of ``shapes`` for optimizer step ``step`` (float32, N(0, (1e-2 (1 + step mod 3))^2)),
    drawn on the host from seed ``1000 + step``: the same on every device."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * 1e-2 * (1 + step % 3)).to(device) for s in shapes]


@dataclasses.dataclass
class Context:
    """One device check run.

    Attributes:
        device: the device under test (``cuda`` / ``cuda:N`` on a GPU machine, ``cpu`` for the
            dry run).
        dry_run: tiny settings (the testbed policy, few steps): the code path on the CPU in
            about a minute, the figures meaningless.
        out: folder of the run directories, logs and the summary.
    """

    device: torch.device
    dry_run: bool
    out: Path

    @property
    def is_cuda(self) -> bool:
        """Whether the device under test is a CUDA GPU (False on the dry run)."""
        return self.device.type == "cuda"

    def job_keys(self) -> list[str]:
        """``key=value`` tokens of the small jobs (resume, torchrun): the default model with a
        short batch on a GPU, the testbed on the dry run; no plots, fixed threads."""
        keys = [f"device={self.device}", "plots=false", "eval_prompts=0"]
        if self.dry_run:
            return keys + ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=4",
                           "max_new_tokens=8", "num_threads=1"]
        return keys + ["prompts_per_step=4", "num_generations=4", "max_new_tokens=16"]

    def gpu_name(self) -> str:
        """The GPU's name as CUDA reports it (``"cpu (dry run)"`` off CUDA), for the summary."""
        return torch.cuda.get_device_name(self.device) if self.is_cuda else "cpu (dry run)"


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), seconds)``, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def time_optimizer_steps(makers: dict[str, Callable[[list[torch.nn.Parameter]], Any]], shapes: list[tuple[int, ...]],
                         device: torch.device, reps: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Seconds of each optimizer's ``step()`` on the same parameters and gradients, interleaved.

    Each maker gets its own :func:`random_params` of ``shapes`` on ``device`` (seed 0) with the
    gradients of :func:`random_grads` step 0; 3 untimed steps (warm-up, compilation), then ``reps``
    rounds of one timed step per optimizer in turn (so that a change of load hits all alike), each
    :func:`timed` (device synchronised). An optimizer whose construction or warm-up raises is left out.

    Returns:
        ``(times, errors)``: seconds per step for each optimizer that ran (``reps`` each), and
        ``"ExcType: message"`` (at most 200 characters) for each that did not.
    """
    opts: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, make in makers.items():
        params = random_params(shapes, device, seed=0)
        for p, g in zip(params, random_grads(shapes, device, 0)):
            p.grad = g
        try:
            opt = make(params)
            for _ in range(3):
                opt.step()
            sync(device)
        except Exception as err:  # e.g. no fused AdamW for this device
            errors[name] = f"{type(err).__name__}: {err}"[:200]
            continue
        opts[name] = opt
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(reps):
        for name, opt in opts.items():
            times[name].append(timed(opt.step, device)[1])
    return times, errors


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an ``echotrain`` subprocess: the same ``PYTHONPATH`` (so a
    source checkout runs its own code) plus ``extra``."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


#: Python prelude of a training subprocess in the resume check: every op that has no
#: deterministic CUDA implementation warns (instead of silently differing), and the warnings go
#: to stderr where the check collects them.
DETERMINISTIC_PRELUDE = ("import sys, torch, warnings; warnings.simplefilter('always'); "
                         "torch.use_deterministic_algorithms(True, warn_only=True); "
                         "from echotrain.cli import main; sys.exit(main(sys.argv[1:]))")


def echotrain_cmd(*args: str, deterministic: bool = False) -> list[str]:
    """The command line of ``echotrain *args`` in this interpreter."""
    if deterministic:
        return [sys.executable, "-c", DETERMINISTIC_PRELUDE, *args]
    return [sys.executable, "-m", "echotrain.cli", *args]


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with stdout+stderr into ``log``; raise :class:`CheckFailed` with the log's
    tail when it exits non-zero or runs past ``timeout`` seconds."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env or child_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{' '.join(cmd[:6])} ... ran past {timeout:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        tail = log.read_text()[-1500:]
        raise CheckFailed(f"exit {proc.returncode}: {' '.join(cmd[-8:])}\n{tail}")
    return proc


def run_echotrain(ctx: Context, args: list[str], log: Path, timeout: float, deterministic: bool = False,
                  env: dict[str, str] | None = None) -> None:
    """``echotrain *args`` (``train ...`` only) with its output in ``log``: a subprocess on a GPU
    (a clean CUDA context each, ``deterministic`` as in :data:`DETERMINISTIC_PRELUDE`), in this
    process on the dry run (the same command function, :func:`echotrain.train.commands.run_train`,
    without ~10 s of interpreter start and imports per run on 2 loaded cores; the CPU needs no
    determinism switch).

    Raises:
        CheckFailed: a non-zero exit (the log's tail in the message).
        ValueError: ``args`` is not a ``train`` command.
    """
    if not ctx.dry_run:
        run_logged(echotrain_cmd(*args, deterministic=deterministic), log, timeout, env=env)
        return
    if args[:1] != ["train"]:
        raise ValueError(f"run_echotrain runs 'echotrain train ...' only, got {args[:1]}")
    import argparse
    import contextlib

    from echotrain.train.commands import register_train

    parser = argparse.ArgumentParser(prog="echotrain train")
    register_train(parser)
    parsed, extra = parser.parse_known_args(list(args[1:]))
    parsed.extra, parsed.debug = extra, False
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        threads = torch.get_num_threads()
        try:
            rc = parsed.func(parsed)
        finally:
            torch.set_num_threads(threads)
    if rc:
        raise CheckFailed(f"exit {rc}: echotrain {' '.join(args[-8:])}\n{log.read_text()[-1500:]}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (empty when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []
