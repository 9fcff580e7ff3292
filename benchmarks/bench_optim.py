"""Optimizer benchmark: state bytes per parameter, step time and final loss of a short LM run.

Same model, same init, same batches, one process, for: torch.optim.AdamW (foreach),
bitsandbytes AdamW8bit, torchao AdamW4bit (torch.compile), echotrain AdamW4bit and echotrain
AdamW4bit with ``factor_second_moment=True``, both again with ``m_rounding="stochastic"`` (and the eager echotrain update for reference;
``echotrain_4bit_uint8codes`` / ``_int32codes`` force ``widen_codes`` off / on, which ``echotrain_4bit`` decides by the CPU's vector ISA).
Step time is the thread CPU time of ``optimizer.step()`` alone (median over the steps after
the first ``--warmup``, so compilation is excluded and reported separately); ratios are against
torch AdamW measured in the same run. The machine is shared, so CPU time is steadier than wall
time.

Model: a byte-level GPT (pre-norm transformer, default d=512, 2 layers, 6.6M parameters) on
GSM8K question+answer text (``../shared/data/gsm8k/train.jsonl`` when present, else a synthetic
bigram-chain byte stream).

    python benchmarks/bench_optim.py                      # all optimizers, ~15 minutes on a busy 2-core machine
    python benchmarks/bench_optim.py --steps 40 --only torch_adamw echotrain_4bit
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class GPT(torch.nn.Module):
    """Byte-level pre-norm causal transformer LM (untied head)."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.emb(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def load_bytes(limit: int = 2_000_000) -> tuple[torch.Tensor, str]:
    path = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if path.is_file():
        text = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            text.append(row["question"] + "\n" + row["answer"] + "\n\n")
        data = "".join(text).encode()[:limit]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), str(path)
    gen = torch.Generator().manual_seed(0)
    chain = torch.softmax(torch.randn(256, 256, generator=gen) * 3, dim=-1)
    x = torch.zeros(limit // 10, dtype=torch.long)
    for t in range(1, x.numel()):
        x[t] = torch.multinomial(chain[x[t - 1]], 1, generator=gen)
    return x, "synthetic bigram chain"


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (steps, batch), generator=gen)
    return [torch.stack([data[s : s + seq + 1] for s in row.tolist()]) for row in starts]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of all tensors in the optimizer state (tensor subclasses: their inner tensors)."""

    def nbytes(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    return sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def make_optimizer(name: str, params, lr: float, wd: float):
    if name == "torch_adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True)
    if name == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=wd)
    if name == "torchao_adamw4bit":
        from torchao.optim import AdamW4bit

        return AdamW4bit(params, lr=lr, weight_decay=wd)
    from echotrain.optim.adamw4bit import AdamW4bit

    kw = {
        "echotrain_4bit": {},
        "echotrain_4bit_factor": {"factor_second_moment": True},
        "echotrain_4bit_sr": {"m_rounding": "stochastic"},
        "echotrain_4bit_factor_sr": {"factor_second_moment": True, "m_rounding": "stochastic"},
        "echotrain_4bit_eager": {"compile": False},
        "echotrain_4bit_uint8codes": {"widen_codes": False},
        "echotrain_4bit_int32codes": {"widen_codes": True},
    }[name]
    kw.setdefault("compile", True)
    return AdamW4bit(params, lr=lr, weight_decay=wd, **kw)


NAMES = ["torch_adamw", "bnb_adamw8bit", "torchao_adamw4bit", "echotrain_4bit", "echotrain_4bit_factor", "echotrain_4bit_sr",
         "echotrain_4bit_factor_sr", "echotrain_4bit_eager", "echotrain_4bit_uint8codes", "echotrain_4bit_int32codes"]


def run_one(name: str, args, train: list[torch.Tensor], evals: list[torch.Tensor]) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(d=args.d_model, layers=args.layers, seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(name, model.parameters(), args.lr, args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    steps = args.steps if name != "echotrain_4bit_eager" else min(args.steps, args.eager_steps)
    losses, step_cpu, first_wall = [], [], None
    for i, x in enumerate(train[:steps]):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        w0, c0 = time.perf_counter(), time.thread_time()
        opt.step()
        c1, w1 = time.thread_time(), time.perf_counter()
        if i == 0:
            first_wall = w1 - w0
        elif i >= args.warmup:
            step_cpu.append(c1 - c0)
        sched.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = statistics.fmean(
            torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).item() for x in evals
        )
    return {
        "optimizer": name,
        "params": n_params,
        "state_bytes_per_param": state_bytes(opt) / n_params,
        "step_ms": 1e3 * statistics.median(step_cpu) if step_cpu else float("nan"),
        "first_step_s": first_wall,
        "steps": steps,
        "final_train_loss": statistics.fmean(losses[-20:]),
        "eval_loss": eval_loss if steps == args.steps else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eager-steps", type=int, default=12, help="steps for the slow eager echotrain run (time only)")
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from the step time (compilation)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32-seeds", type=int, default=2, help="extra torch AdamW runs with other init seeds: the noise")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", choices=NAMES, default=[n for n in NAMES if not n.endswith("codes")])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # torchao compiles one kernel per parameter shape too; without this it silently falls back
    # to eager after 8 shapes (echotrain raises the limit itself, scoped to its own calls).
    torch._dynamo.config.recompile_limit = max(256, torch._dynamo.config.recompile_limit)

    data, source = load_bytes()
    split = int(0.95 * data.numel())
    train = batches(data[:split], args.steps, args.batch, args.seq, seed=1)
    evals = batches(data[split:], 8, args.batch, args.seq, seed=2)
    print(f"data: {source}; torch {torch.__version__}; threads {args.threads}", flush=True)

    rows = []
    for name in args.only:
        try:
            row = run_one(name, args, train, evals)
        except Exception as err:  # report and keep going (e.g. a library without CPU support)
            row = {"optimizer": name, "error": f"{type(err).__name__}: {err}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    noise = []
    if "torch_adamw" in args.only:
        for k in range(1, args.fp32_seeds + 1):
            sub = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
            noise.append(run_one("torch_adamw", sub, train, evals)["eval_loss"])
        print(json.dumps({"torch_adamw_eval_loss_other_seeds": noise}), flush=True)

    base = next((r for r in rows if r["optimizer"] == "torch_adamw" and "error" not in r), None)
    print("\n| optimizer | state bytes/param | step time vs torch AdamW | first step (s) | train loss (last 20) | eval loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['optimizer']} | failed: {r['error']} |||||")
            continue
        ratio = r["step_ms"] / base["step_ms"] if base else float("nan")
        print(
            f"| {r['optimizer']} | {r['state_bytes_per_param']:.3f} | {ratio:.2f}x ({r['step_ms']:.2f} ms) | "
            f"{r['first_step_s']:.1f} | {r['final_train_loss']:.4f} | {r['eval_loss']:.4f} |"
        )
    if noise and base:
        all_fp32 = [base["eval_loss"], *noise]
        print(f"\ntorch AdamW eval loss over {len(all_fp32)} init seeds: {min(all_fp32):.4f} .. {max(all_fp32):.4f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "fp32_seed_eval_losses": noise}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
