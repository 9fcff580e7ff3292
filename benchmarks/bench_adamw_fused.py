"""torch's AdamW step one operation at a time (``foreach=False``, torch's default on the CPU),
multi-tensor (``foreach=True``) and fused (``fused=True``, the trainer's default: ``adam_fused``),
in one process, alternating, as ratios.

What is timed: ``optimizer.step()`` over the trainable parameters of the default job's model
(embedded SmolLM2-135M-Instruct, float32) with random gradients, the trainer's settings (lr 1e-5,
weight decay 0, betas (0.9, 0.99), eps 1e-8), ``--steps`` steps per arm and round after one
untimed step, ``--reps`` rounds with the order alternating. Printed: the median seconds a step,
the ratio to ``foreach=False`` and the largest difference of the parameters from that arm's
after the same steps from the same state (float rounding).

    python benchmarks/bench_adamw_fused.py --threads 2 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = {"for-loop (foreach=False)": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default=None, help="model= (default: the default job's)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from echotrain.models import load_policy

    model, _ = load_policy(args.model)
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]

    def run(kw: dict) -> tuple[float, list]:
        with torch.no_grad():
            for p, s, gr in zip(params, start, grads):
                p.copy_(s)
                p.grad = gr.clone()
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, **kw)
        opt.step()  # untimed: state allocation
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        t = (time.perf_counter() - t0) / args.steps
        return t, [p.detach().clone() for p in params]

    names = list(ARMS)
    times: dict[str, list[float]] = {n: [] for n in names}
    after = {}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t, after[name] = run(ARMS[name])
            times[name].append(t)
    base = statistics.median(times[names[0]])
    n = sum(p.numel() for p in params)
    print(f"# {args.model or 'the default model (SmolLM2-135M-Instruct)'}: {n / 1e6:.1f}M trainable parameters, "
          f"float32, {args.threads} threads, load avg {os.getloadavg()[0]:.1f}, {args.reps} reps of {args.steps} steps")
    print("| AdamW | median s a step | ratio | largest parameter difference | per-rep s |")
    print("|---|---:|---:|---:|---|")
    out = {}
    for name in names:
        med = statistics.median(times[name])
        diff = max(float((a - b).abs().max()) for a, b in zip(after[name], after[names[0]]))
        print(f"| {name} | {med:.3f} | {med / base:.2f} | {diff:.1e} | {', '.join(f'{t:.3f}' for t in times[name])} |")
        out[name] = {"median_s": med, "ratio": med / base, "max_param_diff": diff}
    return out


if __name__ == "__main__":
    main()
