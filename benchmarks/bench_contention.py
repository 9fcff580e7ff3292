"""Contention benchmark: step time with and without a competing busy process.

One transformer forward + backward (the byte-level GPT of ``bench_optim.py``, d=512, 2 layers,
batch 8x128 tokens) timed in a fresh subprocess per setting, so that the OpenMP environment is
read when torch loads, for:

- ``2 threads``            torch's default OpenMP wait policy (libgomp spins before sleeping)
- ``2 threads, PASSIVE``   ``OMP_WAIT_POLICY=PASSIVE`` (what ``echotrain`` sets unless the user set one)
- ``1 thread``

- ``2 threads, GOMP_SPINCOUNT=N``  (``--spincounts``) libgomp's bounded spin: N spins, then sleep

each on a quiet machine and next to ``--competitors`` busy Python processes (``while True``).
``--workload rl`` times the RL step's kind of work instead: SmolLM2-135M-Instruct (the embedded
default) under bfloat16 autocast, one forward + backward of 8 x 105 tokens and one ``generate``
of 16 rows x 8 new tokens per step (many small ops, where the wait policy matters most).
Settings are interleaved over ``--rounds`` rounds; the table reports the median wall time per
step and each as a ratio to ``1 thread`` in the same condition, the ratio issue 14 asks about.

    python benchmarks/bench_contention.py                  # ~3 minutes
    python benchmarks/bench_contention.py --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, os, sys, time, statistics
import torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
d, seq = 512, 128
layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
model = torch.nn.Sequential(torch.nn.Embedding(256, d), torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                            torch.nn.Linear(d, 256))
x = torch.randint(0, 256, (8, seq))
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=True)
    if i:  # the first step allocates
        times.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(times)}))
"""

WORKER_RL = r"""
import json, sys, time, statistics
import torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
from echotrain.models import load_policy
model, tok = load_policy(None)
torch.manual_seed(0)
ids = torch.randint(0, 40000, (8, 105))
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits[:, -20:].float()
    logits.log_softmax(-1)[..., 0].sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(input_ids=ids[:2, :87].repeat(8, 1), max_new_tokens=8, min_new_tokens=8, do_sample=True,
                       pad_token_id=0)
    if i:
        times.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(times)}))
"""

SETTINGS = {
    "2 threads": (2, None),
    "2 threads, PASSIVE": (2, "PASSIVE"),
    "1 thread": (1, None),
}


def run_worker(threads: int, policy: str | None, steps: int, worker: str = WORKER) -> float:
    """Median seconds per step of ``worker`` in a fresh process; ``policy`` is an
    ``OMP_WAIT_POLICY`` value or ``"SPIN=N"`` (``GOMP_SPINCOUNT=N``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    if policy and policy.startswith("SPIN="):
        env["GOMP_SPINCOUNT"] = policy[5:]
    elif policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", worker, str(threads), str(steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--competitors", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workload", choices=("gpt", "rl"), default="gpt")
    ap.add_argument("--spincounts", type=int, nargs="*", default=[], help="extra settings: 2 threads, GOMP_SPINCOUNT=N")
    args = ap.parse_args(argv)
    worker = WORKER_RL if args.workload == "rl" else WORKER
    settings = dict(SETTINGS)
    for n in args.spincounts:
        settings[f"2 threads, GOMP_SPINCOUNT={n}"] = (2, f"SPIN={n}")
    results: dict[str, dict[str, list[float]]] = {"quiet": {k: [] for k in settings}, "busy": {k: [] for k in settings}}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for r in range(args.rounds):
        for cond in ("quiet", "busy"):
            procs = []
            if cond == "busy":
                procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.competitors)]
                time.sleep(0.5)
            try:
                for name, (threads, policy) in settings.items():
                    results[cond][name].append(run_worker(threads, policy, args.steps, worker))
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        print(f"round {r + 1}: " + json.dumps({c: {k: round(v[-1], 4) for k, v in d.items()} for c, d in results.items()}),
              flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print("\n| setting | quiet: s/step | ratio to 1 thread | busy: s/step | ratio to 1 thread (busy) |")
    print("|---|---|---|---|---|")
    med = {c: {k: statistics.median(v) for k, v in d.items()} for c, d in results.items()}
    for name in settings:
        q, b = med["quiet"][name], med["busy"][name]
        print(f"| {name} | {q:.3f} | {q / med['quiet']['1 thread']:.2f}x | {b:.3f} | {b / med['busy']['1 thread']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": results, "median": med}, f, indent=2)


if __name__ == "__main__":
    main()
