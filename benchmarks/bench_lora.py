"""LoRA (peft) against full fine-tuning: peak memory and time per training step, same run.

Each configuration runs ``echotrain train``'s Trainer for a few steps in its own process (so
peak RSS is its own), 1 thread, under ``nice``:

    135m-full     SmolLM2-135M-Instruct (embedded), full fine-tuning, AdamW
    135m-lora     the same with LoRA r=16, alpha=32 on every linear layer
    360m-lora     a randomly initialised Llama with SmolLM2-360M's shape (hidden 960, MLP 2560,
                  32 layers, 15 heads / 5 KV heads, vocab 49152, tied embeddings): the weights
                  of SmolLM2-360M cannot be downloaded here; memory and time depend on the shape only
    360m-full     the same, full fine-tuning

``kl_coef`` is 0.04 (GRPO's), so full fine-tuning also holds a reference copy of the model and
LoRA does not (its reference is the model with adapters disabled). Prints peak RSS, time per
step (mean after the first step), trainable parameters and the checkpoint size.

    python benchmarks/bench_lora.py [--configs 135m-full,135m-lora,360m-lora,360m-full] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIG = dict(prompts_per_step=2, num_generations=4, max_new_tokens=16, micro_batch_size=8, num_mini_batches=1,
              eval_prompts=0, plots=False, save_every=0, save_final_model=False, progress=False, device="cpu",
              seed=0, kl_coef=0.04, num_threads=1)
LORA = dict(lora_r=16, lora_alpha=32, lora_target_modules="all-linear")


def smollm2_360m_shape(vocab_size: int, tok) -> object:
    """Randomly initialised LlamaForCausalLM with SmolLM2-360M's configuration."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                      num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def worker(args: argparse.Namespace) -> None:
    import torch

    from echotrain.models import load_policy
    from echotrain.runtime.checkpoints import latest_checkpoint
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import Trainer

    torch.set_num_threads(1)
    size, mode = args.worker.split("-")
    model, tok = load_policy(None)
    if size == "360m":
        model = smollm2_360m_shape(model.config.vocab_size, tok)
    over = {**CONFIG, "steps": args.steps, "output_dir": str(Path(args.out) / args.worker), "save_every": args.steps,
            **(LORA if mode == "lora" else {})}
    trainer = Trainer(resolve_config(overrides=over), model=model, tokenizer=tok)
    records = trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    ckpt = latest_checkpoint(trainer.run_dir)
    json.dump({"records": records, "trainable": trainable, "total": total, "ckpt_bytes": ckpt.stat().st_size,
               "ref_copy": trainer.ref_model is not None}, sys.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="135m-full,135m-lora,360m-lora,360m-full")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_lora")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{'config':10s} {'peak RSS MiB':>12s} {'step s':>7s} {'trainable':>11s} {'of total':>9s} "
          f"{'ckpt MiB':>9s} ref copy")
    rows = {}
    for name in args.configs.split(","):
        cmd = ["nice", "-n", "10", sys.executable, __file__, "--worker", name, "--steps", str(args.steps),
               "--out", args.out]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        res = json.loads(out.stdout.strip().splitlines()[-1])
        rec = res["records"]
        steps = rec[1:] or rec
        t = sum(r["time/step"] for r in steps) / len(steps)
        mem = max(r["memory/peak_mb"] for r in rec)
        rows[name] = (mem, t)
        print(f"{name:10s} {mem:12.0f} {t:7.2f} {res['trainable'] / 1e6:10.2f}M {res['trainable'] / res['total']:9.2%} "
              f"{res['ckpt_bytes'] / 2**20:9.1f} {res['ref_copy']}", flush=True)
    for size in ("135m", "360m"):
        if f"{size}-full" in rows and f"{size}-lora" in rows:
            (mf, tf), (ml, tl) = rows[f"{size}-full"], rows[f"{size}-lora"]
            print(f"{size}: LoRA / full  peak RSS {ml / mf:.2f}x, step time {tl / tf:.2f}x")


if __name__ == "__main__":
    main()
