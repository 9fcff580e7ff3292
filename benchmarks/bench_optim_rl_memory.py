"""Memory of one RL policy-gradient step on SmolLM2-135M: torch AdamW vs echotrain AdamW4bit.

The step is what the RL trainer does per update: forward of the policy on a (8, 128)-token
batch, token log-probs, a policy-gradient loss ``-(A * log_prob)`` averaged over response tokens
(``response_mask``), backward, ``optimizer.step()``, ``zero_grad``. Each optimizer runs in its own
subprocess (1 thread); a sampler thread reads the process RSS every millisecond during the
steps, so the model-loading peak does not count. Reported: RSS after loading, peak RSS during
the steps (minus RSS after loading), and the exact bytes of the optimizer state.

    python benchmarks/bench_optim_rl_memory.py            # ~4 minutes (two subprocesses)
    python benchmarks/bench_optim_rl_memory.py --steps 2 --optimizers adamw
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def child(name: str, steps: int, batch: int, seq: int, compile_: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from echotrain.models import load_policy

    model, _tok = load_policy(None)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    if name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    else:
        from echotrain.optim.adamw4bit import AdamW4bit

        opt = AdamW4bit(params, lr=1e-6, compile=compile_)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    response_mask = torch.zeros(batch, seq - 1)
    response_mask[:, seq // 2 :] = 1.0  # second half of each sequence is the response
    advantages = torch.randn(batch, 1, generator=gen)

    base = rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(input_ids=input_ids).logits[:, :-1].float()
        log_prob = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        loss = -(advantages * log_prob * response_mask).sum() / response_mask.sum()
        loss.backward()
        del logits, log_prob
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    stop.set()
    sampler.join()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return {
        "optimizer": name,
        "params": n_params,
        "rss_after_load_MiB": base / 2**20,
        "step_peak_over_load_MiB": (peak[0] - base) / 2**20,
        "state_MiB": state / 2**20,
        "state_bytes_per_param": state / n_params,
        "step_wall_s": times,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", nargs="*", default=["adamw", "adamw4bit"], choices=["adamw", "adamw4bit"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="compiled AdamW4bit update (default: eager, no compile time)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch, args.seq, args.compile)))
        return
    from echotrain.models import load_policy

    load_policy(None)  # convert/cache the embedded GGUF once, outside the measured children
    rows = []
    for name in args.optimizers:
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
        if args.compile:
            cmd.append("--compile")
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            rows.append({"optimizer": name, "error": out.stderr[-500:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    ok = {r["optimizer"]: r for r in rows if "error" not in r}
    print("\n| optimizer | state (MiB) | bytes/param | RSS after load (MiB) | step peak over load (MiB) |")
    print("|---|---|---|---|---|")
    for r in ok.values():
        print(f"| {r['optimizer']} | {r['state_MiB']:.0f} | {r['state_bytes_per_param']:.3f} | {r['rss_after_load_MiB']:.0f} | {r['step_peak_over_load_MiB']:.0f} |")
    if len(ok) == 2:
        a, b = ok["adamw"], ok["adamw4bit"]
        total_a = a["rss_after_load_MiB"] + a["step_peak_over_load_MiB"]
        total_b = b["rss_after_load_MiB"] + b["step_peak_over_load_MiB"]
        print(f"\npeak RSS of the RL step: AdamW4bit / AdamW = {total_b:.0f} / {total_a:.0f} MiB = {total_b / total_a:.2f}")


if __name__ == "__main__":
    main()
