"""Overlap of generation with the update on a GPU: what asynchronous rollouts can gain there.

An asynchronous trainer runs generation (the rollout worker) beside the update (the learner). On
2 CPU cores they compete for the same cores (docs/benchmarks.md, "Off-policy rollouts"); on a GPU
they can overlap: on two devices (``--devices cuda:0,cuda:1``: generation on the first, the
update on the second), or on one device with two CUDA streams (``--devices cuda:0``), where the
kernels of the two share the SMs. This script measures, in one process and one run, with the
policy of the default job (or ``--model``):

- ``g``: one ``generate`` of ``--prompts`` x ``--generations`` rollouts of ``--new-tokens`` tokens
- ``u``: one forward + backward of those rollouts (the update's work, without the optimizer step)
- ``overlap``: both at once, from two threads, each on its own device / stream

and prints the bound ``(g + u) / max(g, u)`` (perfect overlap) against the reached
``(g + u) / overlap``; medians over ``--reps`` after one warm-up. On a CPU (``--devices cpu``)
the two threads share the cores: a smoke run of the code path (the test suite runs it on the
testbed), not a measurement of anything a GPU would do.

    python benchmarks/bench_overlap_gpu.py --devices cuda:0            # one GPU, two streams
    python benchmarks/bench_overlap_gpu.py --devices cuda:0,cuda:1     # generation and update on two GPUs
    python benchmarks/bench_overlap_gpu.py --devices cpu --model testbed --reps 1 --new-tokens 4   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import threading
import time
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stream(device: torch.device) -> Any:
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="policy name (default: the default job's)")
    p.add_argument("--devices", default="cuda:0", help="cuda:0 (two streams), cuda:0,cuda:1 (two devices) or cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    from echotrain.models import load_policy
    from echotrain.runtime.rollout import forward_log_probs, generate_rollouts
    from echotrain.tasks import get_task
    from echotrain.train.config import TrainConfig

    cfg = TrainConfig()
    devices = [torch.device(d.strip()) for d in args.devices.split(",")]
    gen_dev, upd_dev = devices[0], devices[-1]
    model, tok = load_policy(args.model or cfg.model, dtype=torch.float32, device=str(gen_dev))
    learner = model if upd_dev == gen_dev else copy.deepcopy(model).to(upd_dev)
    task = get_task("testbed" if args.model == "testbed" else cfg.task, **({} if args.model == "testbed"
                                                                           else cfg.task_options))
    prompts = [ex.messages for ex in task.sample(args.prompts, 0)]

    def generate() -> Any:
        return generate_rollouts(model, tok, prompts, args.generations, max_new_tokens=args.new_tokens,
                                 temperature=1.0)

    batch = generate()  # the update's input, fixed

    def update() -> None:
        b = batch
        lp, _ = forward_log_probs(learner, b.prompt_ids.to(upd_dev), b.prompt_mask.to(upd_dev),
                                  b.response_ids.to(upd_dev), b.response_mask.to(upd_dev))
        (-(lp * b.response_mask.to(upd_dev)).sum()).backward()
        learner.zero_grad(set_to_none=True)

    def timed(fn: Any, device: torch.device) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with _stream(device):
            fn()
        _sync(device)
        return time.perf_counter() - t0

    def overlapped() -> float:
        out: dict[str, float] = {}

        def run(name: str, fn: Any, device: torch.device) -> None:
            out[name] = timed(fn, device)

        threads = [threading.Thread(target=run, args=("g", generate, gen_dev)),
                   threading.Thread(target=run, args=("u", update, upd_dev))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    timed(generate, gen_dev), timed(update, upd_dev), overlapped()  # warm-up
    g, u, both = [], [], []
    for _ in range(args.reps):  # interleaved
        g.append(timed(generate, gen_dev))
        u.append(timed(update, upd_dev))
        both.append(overlapped())
    res = {"g_s": statistics.median(g), "u_s": statistics.median(u), "overlap_s": statistics.median(both)}
    res["bound"] = (res["g_s"] + res["u_s"]) / max(res["g_s"], res["u_s"])
    res["reached"] = (res["g_s"] + res["u_s"]) / res["overlap_s"]
    print(f"devices {args.devices}: generation {res['g_s']:.3f} s, update {res['u_s']:.3f} s, both at once "
          f"{res['overlap_s']:.3f} s; overlap bound {res['bound']:.2f}x, reached {res['reached']:.2f}x "
          f"(medians of {args.reps})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return res


if __name__ == "__main__":
    main()
