"""The roofline of one RL step of the default job, phase by phase.

What is run: the default ``echotrain train`` job (embedded SmolLM2-135M-Instruct, default task,
every default setting: B = 8 prompts x G = 8 completions, max_new_tokens = 32, micro-batches of
32, two mini-batches, AdamW, ``autocast=auto``) for one synthetic step built from the trainer's
own pieces (``Trainer._log_probs``, its collector's prompts and reward, its optimizer), each
phase timed on its own:

- prefill: the distinct prompts through the model once (``rollout._prefill``, as ``generate``'s
  shared-prefix path does), timed separately;
- decode: ``generate_rollouts`` of all B x G rows minus the prefill time above;
- old log-probs: the no-grad pass over the second mini-batch (the first one's come from its
  with-grad forward: ``reuse_on_policy_log_probs``, the default); none when the trainer takes the
  sampler's own log-probs for them (``reuse_sampler_log_probs``: synchronous float32);
- pre-pass: ECHO's no-grad forward over the second (off-policy) mini-batch for its batch ratio,
  as the trainer runs it; none with ``log_prob_prepass=retain`` (the with-grad forwards serve),
  or for losses without a pre-pass;
- with-grad forward and backward: every micro-batch of both mini-batches, the forward
  (log-probs) and ``backward`` of a masked sum of them (the same graph as the policy loss up to
  elementwise terms) timed apart;
- optimizer: ``optimizer.step()`` of each mini-batch.

Before timing, one short ``generate``, one with-grad micro-batch and one AdamW step on zero
gradients (allocating its state; no weight changes) warm the process up; a run's first step
pays those costs once, the table shows the steady state.

Work per phase is counted by :mod:`echotrain.roofline.counts` (model FLOPs for the passes; bytes
and FLOPs for decode, each step bound by the larger of bytes / bandwidth and FLOPs / GEMM rate
(:func:`echotrain.roofline.counts.decode_roofline_seconds`); bytes for
AdamW: 28 bytes a parameter, read weight, grad, m, v and write weight, m, v in float32). The peaks are measured in the same run (:func:`echotrain.roofline.machine_peaks` with
``refresh``): GEMM FLOP/s for the compute dtype and memory bytes/s. ``util`` = roofline time
(work / peak) / measured wall time; ``CPU s`` is the process's CPU time in the phase (all
threads: about threads x wall when the process had the cores to itself). The last line gives
the run's two figures as the trainer computes them (``throughput/update_mfu``, ``throughput/decode_bw_util``).

Usage::

    python benchmarks/bench_roofline.py --threads 2 [--prompts 8 --generations 8 --max-new-tokens 32]
                                        [--decode-loop generate]   # transformers' generate
                                        [--set pack_responses=false]   # any setting
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None, help="B (default: the trainer's default)")
    ap.add_argument("--generations", type=int, default=None, help="G (default: the trainer's default)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--decode-loop", default=None, choices=("echotrain", "generate"),
                    help="the decode_loop setting (default: the trainer's default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting, as on the command line (e.g. pack_responses=false)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    from echotrain.cli import set_omp_wait_policy

    wait = set_omp_wait_policy()  # as `echotrain train` does, before torch is imported
    import torch

    torch.set_num_threads(args.threads)
    from echotrain.roofline import (batch_forward_flops, decode_bytes, decode_flops, decode_roofline_seconds,
                                    machine_peaks, prefill_flops, shape_of)
    from echotrain.train.config import resolve_config
    from echotrain.train.config.parse import parse_overrides
    from echotrain.runtime.precision import autocast
    from echotrain.runtime.packing import common_prefix_of
    from echotrain.runtime.rollout import _prefill, encode_prompts, generate_rollouts, render_prompts
    from echotrain.train.trainer import Trainer
    from echotrain.train.utilisation import decode_element_bytes
    from echotrain.rl import needs_log_prob_prepass
    from echotrain.train.update import mini_batch_splits, retains_prepass_graph

    over = {k: v for k, v in (("prompts_per_step", args.prompts), ("num_generations", args.generations),
                              ("max_new_tokens", args.max_new_tokens), ("decode_loop", args.decode_loop))
            if v is not None}
    tmp = tempfile.mkdtemp(prefix="bench_roofline-")
    cfg = resolve_config(overrides={**parse_overrides(args.set), **over, "output_dir": tmp, "eval_prompts": 0,
                                    "progress": False, "plots": False})
    trainer = Trainer(cfg)
    model, tok, ac = trainer.model, trainer.tokenizer, trainer.autocast_dtype
    param = next(model.parameters())
    dtype = ac or param.dtype
    peaks = machine_peaks(dtype, trainer.device, threads=args.threads, refresh=True)
    shape = shape_of(model)
    kv_bytes = param_bytes = decode_element_bytes(dtype)  # as the runs' meter counts them
    G = cfg.num_generations
    torch.manual_seed(0)

    # ---- generation: prefill timed on its own, decode = generate - prefill
    examples = trainer.prompts.next(cfg.prompts_per_step)
    messages = [ex.messages for ex in examples]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    texts = [t for t in render_prompts(tok, messages) for _ in range(G)]
    ids, attn = encode_prompts(tok, texts, pad_id)
    with torch.no_grad(), autocast(model, ac):  # no_grad as generation: inference mode re-casts the weights each forward
        model.eval()
        # warm-up (first-call allocations and kernel selection), not timed
        generate_rollouts(model, tok, messages, G, max_new_tokens=2, temperature=cfg.temperature,
                          decode_loop=cfg.decode_loop, sampler=cfg.sampler)
        t0, c0 = time.perf_counter(), time.process_time()
        _prefill(model, ids[::G], attn[::G], G)
        t_prefill, c_prefill = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        batch = generate_rollouts(model, tok, messages, G, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  decode_loop=cfg.decode_loop, sampler=cfg.sampler)
        t_generate, c_generate = time.perf_counter() - t0, time.process_time() - c0
        model.train()
    p = batch.prompt_mask.sum(-1).tolist()
    r = batch.response_mask.sum(-1).long().tolist()
    first = {}
    for i, g in enumerate(batch.group_index.tolist()):
        first.setdefault(g, i)
    f_prefill = prefill_flops(shape, [p[i] for i in first.values()],
                              common_prefix=common_prefix_of(batch.prompt_ids, batch.prompt_mask))
    b_decode = decode_bytes(shape, p, r, param_bytes=param_bytes, kv_bytes=kv_bytes)
    f_decode = decode_flops(shape, p, r)
    t_decode = max(t_generate - t_prefill, 1e-9)
    cpu = {"prefill": c_prefill, "decode": max(c_generate - c_prefill, 0.0)}

    def fwd_flops(b):
        return batch_forward_flops(shape, b.prompt_mask.sum(-1).tolist(), b.response_mask.sum(-1).long().tolist(),
                                   b.group_index.tolist(), common_prefix=common_prefix_of(b.prompt_ids, b.prompt_mask))

    # ---- update: old log-probs of mini-batch 2, with-grad forward / backward / optimizer of both
    splits = mini_batch_splits(batch.group_index, cfg.num_mini_batches, cfg.ppo_epochs, trainer.dist)
    # warm-up, not timed: one with-grad micro-batch, and one AdamW step on zero gradients (allocates
    # its state, changes no weight: m = v = 0 gives a zero update)
    warm = batch.select(splits[0][:cfg.micro_batch_size])
    trainer._log_probs(model, warm, grad=True)[0].sum().backward()
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    trainer.optimizer.step()
    t_old = f_old = 0.0
    t_fwd = t_bwd = t_opt = 0.0
    f_fwd = 0
    # as the trainer: the later mini-batches' old log-probs are the sampler's when it ran these weights in
    # float32 (reuse_sampler_log_probs), and ECHO's pre-pass of an off-policy mini-batch is a no-grad forward
    # unless its with-grad forwards are kept for it (log_prob_prepass)
    sampler_old = trainer.sampler_is_learner and trainer.reuses_first_forward()
    prepass = needs_log_prob_prepass(cfg.loss_mode, trainer.loss_config) and not retains_prepass_graph(
        cfg.log_prob_prepass)
    t_pre = f_pre = 0.0
    for k, rows in enumerate(splits):
        micro = [batch.select(rows[i:i + cfg.micro_batch_size]) for i in range(0, len(rows), cfg.micro_batch_size)]
        if k > 0 and prepass:
            for mb in micro:
                t0, c0 = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    trainer._log_probs(model, mb)
                t_pre += time.perf_counter() - t0
                cpu["pre-pass"] = cpu.get("pre-pass", 0.0) + time.process_time() - c0
                f_pre += fwd_flops(mb)
        if k > 0 and not sampler_old:
            for mb in micro:
                t0, c0 = time.perf_counter(), time.process_time()
                trainer._log_probs(model, mb, with_entropy=True)
                t_old += time.perf_counter() - t0
                cpu["old log-probs"] = cpu.get("old log-probs", 0.0) + time.process_time() - c0
                f_old += fwd_flops(mb)
        trainer.optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            t0, c0 = time.perf_counter(), time.process_time()
            log_prob, ent = trainer._log_probs(model, mb, with_entropy=k == 0, grad=True)
            loss = (log_prob * mb.response_mask).sum() / mb.response_mask.sum()
            t1, c1 = time.perf_counter(), time.process_time()
            loss.backward()
            t2, c2 = time.perf_counter(), time.process_time()
            t_fwd, t_bwd = t_fwd + t1 - t0, t_bwd + t2 - t1
            cpu["with-grad forward"] = cpu.get("with-grad forward", 0.0) + c1 - c0
            cpu["backward"] = cpu.get("backward", 0.0) + c2 - c1
            f_fwd += fwd_flops(mb)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.optimizer.step()
        t_opt += time.perf_counter() - t0
        cpu["optimizer"] = cpu.get("optimizer", 0.0) + time.process_time() - c0
    n_params = sum(q.numel() for q in model.parameters() if q.requires_grad)
    b_opt = 28 * n_params * len(splits)

    F, B = peaks.gemm_flops_per_s, peaks.mem_bytes_per_s

    def gf(x):
        return f"{x / 1e9:.1f} GFLOP"

    def gb(x):
        return f"{x / 1e9:.2f} GB"

    # (phase, wall s, work, bound by, roofline s)
    d_bw, d_fl = b_decode / B, f_decode / F
    d_roof = decode_roofline_seconds(shape, p, r, param_bytes=param_bytes, kv_bytes=kv_bytes,
                                     gemm_flops_per_s=F, mem_bytes_per_s=B)  # per step max
    rows = [("prefill", t_prefill, gf(f_prefill), "GEMM", f_prefill / F),
            ("decode", t_decode, f"{gb(b_decode)}, {gf(f_decode)}", "per step", d_roof),
            ("old log-probs", t_old, gf(f_old), "GEMM", f_old / F),
            ("pre-pass", t_pre, gf(f_pre), "GEMM", f_pre / F),
            ("with-grad forward", t_fwd, gf(f_fwd), "GEMM", f_fwd / F),
            ("backward", t_bwd, gf(2 * f_fwd), "GEMM", 2 * f_fwd / F),
            ("optimizer", t_opt, gb(b_opt), "bandwidth", b_opt / B)]
    total = sum(x[1] for x in rows)
    print(f"# peaks ({peaks.dtype}, {peaks.threads} threads, {peaks.source}): GEMM {F / 1e9:.1f} GFLOP/s, "
          f"memory {B / 1e9:.1f} GB/s; compute dtype {dtype}, OpenMP wait {wait}, load avg {os.getloadavg()[0]:.1f}")
    print(f"# decode_loop={cfg.decode_loop}; batch: {cfg.prompts_per_step} prompts x {G}, prompt tokens mean {sum(p) / len(p):.0f}, "
          f"response tokens mean {sum(r) / len(r):.1f} (max {max(r)}), {len(splits)} mini-batches of micro-batch "
          f"{cfg.micro_batch_size}; decode: all bytes / bandwidth {d_bw:.2f} s, all FLOPs / GEMM {d_fl:.2f} s, "
          f"per-step larger of the two {d_roof:.2f} s")
    print("| phase | wall s | CPU s | share | work | bound by | roofline s | util |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for name, t, work, by, bound in rows:
        print(f"| {name} | {t:.2f} | {cpu.get(name, 0.0):.2f} | {t / total:.0%} | {work} | {by} | {bound:.2f} | "
              f"{bound / max(t, 1e-9):.2f} |")
    t_update = t_old + t_pre + t_fwd + t_bwd + t_opt
    mfu = (f_old + f_pre + 3 * f_fwd) / (t_update * F)
    bw = (f_prefill / F + d_roof) / t_generate
    print(f"# throughput/update_mfu = {mfu:.3f} (over old log-probs + pre-pass + forward + backward + optimizer, "
          f"{t_update:.1f} s); throughput/decode_bw_util = {bw:.3f} (over generation, {t_generate:.1f} s)")
    result = {"peaks": peaks.as_dict(), "rows": rows, "update_mfu": mfu, "decode_bw_util": bw,
              "decode_bytes": b_decode, "param_bytes": param_bytes}
    if args.json:
        from echotrain.atomic import atomic_write_json

        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
