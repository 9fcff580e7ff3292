"""The kernel checks of ``echotrain device-check``: the optimizers (fused AdamW, 4-bit AdamW) and
the decode loop on the device under test, against references on the same inputs.

Each ``check_*(ctx)`` returns a dict of figures and raises
:class:`~echotrain.devicecheck.common.CheckFailed` when an assertion does not hold.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from echotrain.devicecheck.common import (MAX_CODE_MISMATCH, PARAM_ATOL, PARAM_RTOL, Context, first_moment_mismatch,
                                          params_agree, random_grads, random_params, require, time_optimizer_steps,
                                          timed)

#: (matrix shapes, 1-D shapes) of the optimizer check: a small transformer's worth (~9.4M
#: parameters) on a GPU (benchmarks' former device_check_adamw4bit.py), 0.6M on the dry run
OPT_SHAPES = {
    "cuda": ([(2048, 1024), (1024, 1024), (1024, 1024), (256, 1024)], [(1 << 20,)]),
    "cpu": ([(512, 512), (512, 512)], [(70000,)]),
}


def _run(make: Callable[[list], torch.optim.Optimizer], shapes: list, device: torch.device,
         steps: int = 3) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, int]:
    """``steps`` steps of ``make(params)`` on ``device``; also the bytes its state allocated on
    the device (CUDA: ``memory_allocated`` after the first step minus before; CPU: the state's
    tensors)."""
    params = random_params(shapes, device)
    opt = make(params)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    grown = 0
    for k in range(steps):
        for p, g in zip(params, random_grads(shapes, device, k)):
            p.grad = g
        opt.step()
        if k == 0 and device.type == "cuda":
            torch.cuda.synchronize(device)
            grown = torch.cuda.memory_allocated(device) - before
    return params, opt, grown


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state's tensors (the ``step`` counts included)."""
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def check_optimizers(ctx: Context) -> dict[str, Any]:
    """Fused AdamW and 4-bit AdamW on the device under test against the CPU on the same
    parameters and gradients (3 steps): torch's fused AdamW vs torch's for-loop AdamW on the CPU
    and echotrain's AdamW4bit vs itself on the CPU (which tests/optim pins to AdamW with the
    pure quantizers): fused AdamW within rtol 1e-5 / atol 1e-6 everywhere; AdamW4bit with at
    most 0.1% of the parameters beyond that (a near-tie code flip,
    :func:`~echotrain.devicecheck.common.params_agree`) and < 0.1% of the first moment's 4-bit
    codes differing; the 4-bit update's distance from torch AdamW's is
    reported. Memory: state bytes per parameter (fused AdamW 8, AdamW4bit <= 1.07) and on CUDA
    the bytes the first step allocated. Time: median ``step()`` of each against torch AdamW
    (foreach) in the same run; on CUDA also the compiled 4-bit update (Triton) == eager
    (:mod:`echotrain.devicecheck.adamw4bit_compiled`), its rows under ``compiled``.

    Every figure is measured before the first assertion, so a failed check
    (:class:`~echotrain.devicecheck.common.CheckFailed`) carries them all in its ``figures``."""
    from echotrain.optim.adamw4bit import AdamW4bit

    matrices, vectors = OPT_SHAPES["cuda" if ctx.is_cuda else "cpu"]
    shapes = matrices + vectors
    n = sum(torch.Size(s).numel() for s in shapes)
    cpu = torch.device("cpu")
    ref, _, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False), shapes, cpu)
    fused, fused_opt, fused_grown = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), shapes, ctx.device)
    fused_ok, fused_diff, fused_frac = params_agree(fused, ref, bound=3 * 1e-2)
    fused_on_device = all(t.device.type == ctx.device.type for s in fused_opt.state.values() for t in s.values())
    q_ref, q_ref_opt, _ = _run(lambda ps: AdamW4bit(ps, lr=1e-2, compile=False), shapes, cpu)
    q, q_opt, q_grown = _run(lambda ps: AdamW4bit(ps, lr=1e-2, compile=False), shapes, ctx.device)
    q_ok, q_diff, q_frac = params_agree(q, q_ref, bound=3 * 1e-2)
    mismatch, _ = first_moment_mismatch(q_ref_opt, q_ref, q_opt, q)
    update_gap = max(float(((w.detach().cpu() - r.detach()).norm() / (r.detach() - p0.detach()).norm()))
                     for w, r, p0 in zip(q, ref, random_params(shapes, cpu)))
    per_param = {"adamw_fused": state_bytes(fused_opt) / n, "adamw4bit": state_bytes(q_opt) / n}
    out: dict[str, Any] = {
        "params": n, "fused_vs_cpu_max_abs": fused_diff, "adamw4bit_vs_cpu_max_abs": q_diff,
        "adamw4bit_vs_cpu_frac_beyond_tol": q_frac,
        "adamw4bit_m_code_mismatch": mismatch, "adamw4bit_vs_adamw_relative_update_gap": update_gap,
        "state_bytes_per_param": per_param,
    }
    if ctx.is_cuda:
        out["allocated_bytes_per_param_first_step"] = {"adamw_fused": fused_grown / n, "adamw4bit": q_grown / n}
    out["step_time_vs_adamw_foreach"], timing_errors = _time_steps(ctx, shapes, compile_4bit=ctx.is_cuda)
    if timing_errors:
        out["step_time_errors"] = timing_errors
    if ctx.is_cuda:
        from echotrain.devicecheck import adamw4bit_compiled as comp

        try:
            out["compiled"] = [comp.check_quantizers(ctx.device),
                               comp.check_compiled_equals_eager(shapes, ctx.device, factor=False),
                               comp.check_compiled_equals_eager(matrices, ctx.device, factor=True)]
        except Exception as exc:  # noqa: BLE001  (a compiler error fails the check, the figures above stay)
            out["compiled"] = [{"check": "compiled", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}]
    # every figure is measured before the first assertion: a failed check still reports them all
    tol = f"rtol {PARAM_RTOL:g}, atol {PARAM_ATOL:g}"
    require(fused_ok and fused_frac == 0.0, f"fused AdamW on {ctx.device} differs from the CPU's AdamW by "
                                            f"{fused_diff:.3g} ({fused_frac:.2%} beyond {tol})", out)
    require(fused_on_device, "fused AdamW keeps state off the device", out)
    require(q_ok and mismatch < MAX_CODE_MISMATCH,
            f"AdamW4bit on {ctx.device} vs CPU: parameters {q_diff:.3g} ({q_frac:.3%} beyond {tol}), "
            f"m codes differing {mismatch:.3%}", out)
    require(per_param["adamw4bit"] <= 1.07, f"AdamW4bit holds {per_param['adamw4bit']:.3f} bytes/parameter (> 1.07)",
            out)
    require(not timing_errors, f"an optimizer could not be timed: {timing_errors}", out)
    require(all(row["ok"] for row in out.get("compiled", [])),
            "the compiled 4-bit update differs from the eager one (figures: compiled)", out)
    return out


def _time_steps(ctx: Context, shapes: list, compile_4bit: bool) -> tuple[dict[str, float], dict[str, str]]:
    """Median ``step()`` time of each optimizer / torch AdamW foreach's (interleaved reps), and the
    error of each optimizer that could not run (:func:`~echotrain.devicecheck.common.time_optimizer_steps`)."""
    from echotrain.optim.adamw4bit import AdamW4bit

    makers = {"adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
              "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
              "adamw4bit": lambda ps: AdamW4bit(ps, lr=1e-3, compile=compile_4bit)}
    times, errors = time_optimizer_steps(makers, shapes, ctx.device, 20 if ctx.is_cuda else 3)
    if "adamw_foreach" not in times:  # no baseline: no ratios (the error fails the check)
        return {}, errors
    base = statistics.median(times["adamw_foreach"])
    return {name: round(statistics.median(ts) / base, 3) for name, ts in times.items()}, errors


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows of two (N, T) token tensors that are equal (the shorter padded with -1)."""
    T = max(a.shape[1], b.shape[1])
    a, b = (torch.nn.functional.pad(x, (0, T - x.shape[1]), value=-1) for x in (a, b))
    return float((a == b).all(-1).float().mean())


def check_decode(ctx: Context) -> dict[str, Any]:
    """echotrain's decode loop against ``generate`` on the device under test, float32 weights, no
    autocast: greedy tokens equal (on CUDA at least 90% of rows: rows leaving the batch change
    the matrix products' shapes, hence their rounding, so an argmax at a near-tie may flip); sampled tokens with ``sampler=multinomial`` from the same
    seed (equal on the CPU, where tests/train/test_decode_loop.py pins it; on CUDA the fraction
    of equal rows is reported: rows leave echotrain's batch at EOS, so its multinomial draws
    run on fewer rows than ``generate``'s and, where CUDA's Philox offsets then advance
    differently, later rows draw other numbers from the same distribution). Speed: the median
    of ``generate`` over the median of echotrain's loop (default sampler), same run."""
    from echotrain.models import load_policy
    from echotrain.runtime.rollout import generate_rollouts
    from echotrain.tasks import get_task

    # the dry run uses the testbed, whose own generate both loops call (the code path only: loading
    # the default model costs ~1 min on 2 loaded cores; tests/train/test_decode_loop.py pins our
    # loop against generate on an HF model on the CPU)
    name = "testbed" if ctx.dry_run else None
    model, tok = load_policy(name, dtype=torch.float32, device=str(ctx.device))
    task = get_task("testbed" if ctx.dry_run else "default")
    prompts = [ex.messages for ex in task.sample(2 if ctx.dry_run else 8, 0)]
    G, new = (2, 8) if ctx.dry_run else (8, 64)

    def gen(loop: str, sampler: str = "multinomial", do_sample: bool = True) -> Any:
        torch.manual_seed(7)
        return generate_rollouts(model, tok, prompts, G, max_new_tokens=new, temperature=1.0, decode_loop=loop,
                                 sampler=sampler, do_sample=do_sample, record_log_prob=do_sample)

    greedy = [gen(loop, do_sample=False).response_ids for loop in ("generate", "echotrain")]
    greedy_equal = _rows_equal(*greedy)
    # CUDA: rows leave echotrain's batch at EOS, so its matrix products have other shapes than
    # generate's and may round differently (other cuBLAS kernels); an argmax at a near-tie can flip
    require(greedy_equal == 1.0 or (ctx.is_cuda and greedy_equal >= 0.9),
            f"greedy tokens of echotrain's loop differ from generate's in {1 - greedy_equal:.0%} of rows",
            {"greedy_rows_equal_frac": greedy_equal})
    sampled = [gen(loop) for loop in ("generate", "echotrain")]
    a, b = sampled[0].response_ids, sampled[1].response_ids
    rows_equal = _rows_equal(a, b)
    if not ctx.is_cuda:
        require(rows_equal == 1.0, f"sampled tokens differ from generate's on {ctx.device} ({rows_equal:.0%} rows equal)",
                {"greedy_rows_equal_frac": greedy_equal, "sampled_rows_equal_frac": rows_equal})
    reps = 2 if ctx.dry_run else 5
    t_gen, t_ours = [], []
    for _ in range(reps):  # interleaved
        t_gen.append(timed(lambda: gen("generate", "inverse_cdf"), ctx.device)[1])
        t_ours.append(timed(lambda: gen("echotrain", "inverse_cdf"), ctx.device)[1])
    return {"rows": len(prompts) * G, "max_new_tokens": new, "greedy_rows_equal_frac": greedy_equal,
            "sampled_rows_equal_frac": rows_equal,
            "generate_over_echotrain_time": round(statistics.median(t_gen) / statistics.median(t_ours), 3),
            "model": name or "default (SmolLM2-135M-Instruct)"}
