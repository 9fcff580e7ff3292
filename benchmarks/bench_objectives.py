"""Time loss + backward of every registered policy loss / aggregation against vanilla token-mean.

Ratios against a baseline measured in the same run (interleaved rounds in shuffled order,
process CPU time, min and median over rounds), on
(B, T) = (256, 1024) float32 tensors with ragged response lengths, one CPU thread:

    python benchmarks/bench_objectives.py [--B 256 --T 1024 --rounds 15 --threads 1]

Also times verl's ``compute_policy_loss_vanilla`` when verl's core_algos can be imported.
Prints a markdown table (for docs/benchmarks.md, objectives section).

``--echo-band-look`` instead prints the synthetic look behind ECHO's provisional batch band:
softmax policies over V tokens (logits N(0, sigma^2)), a drifted policy (logits + N(0, tau^2)),
tokens sampled from the old policy; it reports KL(old || new), 1 - R_geo, R_arith - 1 and the
share of tokens a +-0.2 token band would clip.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import random
import statistics
import time
from typing import Callable

import torch

from echotrain.rl import POLICY_LOSSES, compute_advantages, compute_policy_loss, compute_step_stats
from echotrain.rl.objectives import loss_step_stats


def make_inputs(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 8, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    old = -3 * torch.rand(B, T, generator=g)
    log_prob = old - 0.05 + 0.2 * torch.randn(B, T, generator=g)  # off-policy: clips fire
    gid = torch.arange(B) // 8
    adv = compute_advantages(torch.randint(0, 2, (B,), generator=g).float(), gid)
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": adv[:, None] * mask, "response_mask": mask, "group_index": gid}


def case(loss_mode: str, agg: str, cfg: dict, x: dict, step=None) -> Callable[[], None]:
    def run() -> None:
        lp = x["log_prob"].clone().requires_grad_(True)
        loss, _ = compute_policy_loss(loss_mode, x["old_log_prob"], lp, x["advantages"], x["response_mask"], agg, cfg,
                                      group_index=x["group_index"], step=step)
        loss.backward()

    return run


def stats_case(loss_mode: str, agg: str, cfg: dict, mbs: list) -> Callable[[], None]:
    def run() -> None:
        compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)

    return run


def verl_case(x: dict) -> Callable[[], None] | None:
    try:
        import verl.trainer.ppo.core_algos as core_algos
        from verl.workers.config import ActorConfig
    except Exception as exc:  # optional dependency
        print(f"# verl not importable ({type(exc).__name__}: {exc}); skipping the verl baseline")
        return None
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.28)
    mask = x["response_mask"].float()

    def run() -> None:
        lp = x["log_prob"].clone().requires_grad_(True)
        loss, _ = core_algos.compute_policy_loss_vanilla(x["old_log_prob"], lp, x["advantages"], mask, "token-mean", cfg)
        loss.backward()

    return run


def echo_band_look(N: int = 20000, V: int = 256, seed: int = 0) -> None:
    """Print how ECHO's batch ratios move with policy drift (synthetic, see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    print("| sigma | entropy (nats) | tau | KL(old, new) | 1 - R_geo | R_arith - 1 | tokens with abs(rho - 1) > 0.2 |")
    print("|---|---|---|---|---|---|---|")
    for sigma in (2.0, 4.0):
        z = sigma * torch.randn(N, V, generator=g)
        logp_old = torch.log_softmax(z, -1)
        tok = torch.multinomial(logp_old.exp(), 1, generator=g)
        entropy = float(-(logp_old.exp() * logp_old).sum(-1).mean())
        for tau in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5):
            logp_new = torch.log_softmax(z + tau * torch.randn(N, V, generator=g), -1)
            log_ratio = (logp_new - logp_old).gather(1, tok).squeeze(-1)
            rho = log_ratio.exp()
            kl = float((logp_old.exp() * (logp_old - logp_new)).sum(-1).mean())
            frac = float(((rho - 1).abs() > 0.2).float().mean())
            print(f"| {sigma} | {entropy:.2f} | {tau} | {kl:.1e} | {1 - float(log_ratio.mean().exp()):.1e} | "
                  f"{float(rho.mean()) - 1:+.1e} | {frac:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-verl", action="store_true")
    ap.add_argument("--echo-band-look", action="store_true", help="print the synthetic look at ECHO's R instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.echo_band_look:
        echo_band_look()
        return
    x = make_inputs(args.B, args.T)
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_constant=float(args.T))
    echo_cfg = {**base, "batch_clip_low": 0.01, "batch_clip_high": 0.01}  # R_geo ~ 0.95 here: clipped
    mbs = [{k: v for k, v in x.items()}]
    # the losses' own settings at their defaults; clip_cov/kl_cov at verl's 2e-4 share
    loss_cfg = {**base, "clip_ratio_c": None}
    cases: dict[str, Callable[[], None]] = {
        "vanilla token-mean (baseline)": case("vanilla", "token-mean", base, x),
        "vanilla token-mean (same as baseline: noise control)": case("vanilla", "token-mean", base, x),
        "vanilla seq-mean-token-mean": case("vanilla", "seq-mean-token-mean", base, x),
        "vanilla seq-mean-token-sum-norm": case("vanilla", "seq-mean-token-sum-norm", base, x),
        "vanilla balanced (BA)": case("vanilla", "balanced", base, x),
        "gspo seq-mean-token-mean": case("gspo", "seq-mean-token-mean", base, x),
        "gspo_token seq-mean-token-mean": case("gspo_token", "seq-mean-token-mean", base, x),
        "echo token-mean (geo, R in band)": case("echo", "token-mean", {**echo_cfg, "batch_clip_low": 0.2}, x),
        "echo token-mean (geo, R clipped)": case("echo", "token-mean", echo_cfg, x),
        "echo token-mean (arith, R in band)": case("echo", "token-mean", {**echo_cfg, "batch_ratio": "arith", "batch_clip_low": 0.2}, x),
        "echo token-mean (arith, R clipped)": case("echo", "token-mean", {**echo_cfg, "batch_ratio": "arith"}, x),
        "echo + step stats (micro-batch path, R clipped)": case(
            "echo", "token-mean", echo_cfg, x, compute_step_stats(mbs, loss_mode="echo", loss_agg_mode="token-mean", config=echo_cfg)
        ),
        "echo balanced (geo, R clipped)": case("echo", "balanced", echo_cfg, x),
        "vanilla token-sum": case("vanilla", "token-sum", base, x),
    }
    # every other registered loss, in its own default aggregation (the registry's list: a new loss is timed too)
    for name in POLICY_LOSSES:
        if name in ("vanilla", "gspo", "gspo_token", "echo"):
            continue
        agg = inspect.signature(POLICY_LOSSES[name]).parameters["loss_agg_mode"].default
        cases[f"{name} {agg}"] = case(name, agg, loss_cfg, x)
        if loss_step_stats(name) is not None:  # the trainer's path: step stats once, then the loss
            step = compute_step_stats(mbs, loss_mode=name, loss_agg_mode=agg, config=loss_cfg)
            cases[f"{name} {agg} + step stats (micro-batch path)"] = case(name, agg, loss_cfg, x, step)
            cases[f"{name}: compute_step_stats alone (once per optimizer step)"] = stats_case(name, agg, loss_cfg, mbs)
    if not args.no_verl:
        v = verl_case(x)
        if v is not None:
            cases["verl compute_policy_loss_vanilla token-mean"] = v
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm-up
        fn()
    order = list(cases)
    rng = random.Random(0)
    for _ in range(args.rounds):  # interleaved rounds in shuffled order: noise hits every case alike
        rng.shuffle(order)
        for name in order:
            t0 = time.process_time()  # CPU time of this process: robust to being descheduled
            cases[name]()
            times[name].append(time.process_time() - t0)
    # min over rounds: the least-disturbed run (the machine is shared); median also shown
    med = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    b = med["vanilla token-mean (baseline)"]
    print(f"# (B, T) = ({args.B}, {args.T}) float32, {args.threads} thread(s), {args.rounds} rounds, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    bm = median["vanilla token-mean (baseline)"]
    print("| case | min CPU ms | ratio (min) | ratio (median) |")
    print("|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.1f} | {v / b:.3f} | {median[k] / bm:.3f} |")


if __name__ == "__main__":
    main()
