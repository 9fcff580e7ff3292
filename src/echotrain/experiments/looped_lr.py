"""Does the best learning rate of a looped transformer stay put as the loop count N grows?

Claim (Wang, Li, Zhang et al., "On the Residual Scaling of Looped Transformers", arXiv
2606.18524): with every residual branch scaled by eps = lambda / (N sqrt(L)) ("1/N") the optimal
learning rate depends on L only, so it transfers from small N to large N; with the untied
depth-scaling rule eps = lambda / sqrt(N L) ("1/sqrt(N)") it drifts (downwards: the N correlated
updates of a tied weight add up to an effective step about sqrt(N) times larger).

What this experiment does, top to bottom:

1. data: the English text of ``pydoc_data.topics`` (the help pages that ship with every CPython,
   about 0.47 MB) as bytes (vocab 256); the last 10% is held out for validation.
2. for each L, each N, each rule and each learning rate of a log grid: train a fresh
   :class:`~echotrain.models.looped.LoopedTransformer` from the same init on the same batches
   (AdamW, linear warm-up then cosine decay, a fixed token budget) and record the final
   validation loss in one JSON file per run, so an interrupted sweep resumes where it stopped;
3. per (L, rule, N): the argmin learning rate on the grid and a parabola fit in log2(lr) around
   it; the verdict compares how far the optimum moves across N under each rule;
4. plot: final validation loss against learning rate, one curve per N, one panel per rule.

Run ``echotrain experiment looped-lr --help`` for the options; docs/experiments/looped_lr.md has
the command, the numbers and the plot of the committed run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from echotrain.models.looped import RESIDUAL_SCALINGS, LoopedConfig, LoopedTransformer, residual_multiplier
from echotrain.optim.schedules import warmup_decay

RULE_SLUGS = {"1/N": "invN", "1/sqrt(N)": "invsqrtN", "none": "none"}


@dataclass
class LoopedLRArgs:
    """Options of the looped-lr experiment (defaults: the committed run, ~30 min on one shared core)."""

    out_dir: str = "docs/experiments/looped_lr"
    """Folder for one JSON per run, summary.json and the plot (loss_vs_lr.png)."""
    n_layers: list[int] = field(default_factory=lambda: [1])
    """L values: unique layers in the looped block."""
    n_loops: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """N values: loop counts."""
    rules: list[str] = field(default_factory=lambda: ["1/N", "1/sqrt(N)"])
    """Residual scaling rules to compare (see LoopedConfig.residual_scaling)."""
    lrs: list[float] = field(default_factory=lambda: [2.5e-4 * 2**k for k in range(7)])
    """Peak learning rates, a log2 grid (2.5e-4 ... 1.6e-2)."""
    lam: float = 1.0
    """lambda of the residual multiplier."""
    d_model: int = 128
    """Residual width."""
    n_heads: int = 4
    """Attention heads."""
    seq_len: int = 64
    """Tokens (bytes) predicted per training sequence."""
    batch_size: int = 8
    """Sequences per step; tokens per step = batch_size * seq_len."""
    steps: int = 300
    """Optimizer steps (token budget = steps * batch_size * seq_len)."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay to zero."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (0: keeps the learning rate the only knob)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    eval_sequences: int = 64
    """Validation sequences (fixed, evenly spaced over the held-out 10%)."""
    seed: int = 0
    """Seed of the init (same for every run of one architecture) and of the batch order."""
    threads: int = 1
    """torch intra-op threads."""


# ------------------------------------------------------------------------------------------ data


def load_corpus(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The help-topic texts of ``pydoc_data.topics`` as uint8 byte tensors (train, val).

    Topics are joined in sorted order (deterministic across Python builds of one version).
    """
    from pydoc_data.topics import topics

    data = torch.frombuffer(bytearray("\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return data[:-n_val], data[-n_val:]


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """(batch_size, seq_len + 1) int64 windows at random offsets of ``data``."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model: LoopedTransformer, val: torch.Tensor, seq_len: int, n_sequences: int) -> float:
    """Mean next-byte cross-entropy (nats) on ``n_sequences`` evenly spaced windows of ``val``."""
    starts = torch.linspace(0, len(val) - seq_len - 2, n_sequences).long().tolist()
    windows = torch.stack([val[s : s + seq_len + 1] for s in starts]).long()
    model.eval()
    losses = [model(w, labels=w).loss.item() for w in windows.split(16)]
    model.train()
    return sum(losses) / len(losses)


# ------------------------------------------------------------------------------------ one run


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to 0 at ``total``
    (:func:`echotrain.optim.schedules.warmup_decay`, the trainer's ``lr_scheduler=cosine``)."""
    return warmup_decay(step, warmup, total, "cosine", peak=peak)


def train_one(args: LoopedLRArgs, n_layers: int, n_loops: int, rule: str, lr: float, train, val) -> dict:
    """Train one model and return its record (final validation loss in nats per byte, curve)."""
    config = LoopedConfig(
        vocab_size=256, d_model=args.d_model, n_heads=args.n_heads, n_layers=n_layers, n_loops=n_loops,
        residual_scaling=rule, lam=args.lam,
    )
    torch.manual_seed(args.seed)
    model = LoopedTransformer(config)
    optimizer = model.configure_optimizers(lr, weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed + 1)
    curve, diverged, start = [], False, time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, args.warmup_steps, args.steps)
        batch = sample_batch(train, args.batch_size, args.seq_len, generator)
        loss = model(batch, labels=batch).loss
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            curve.append((step, loss.item()))
    val_loss = None if diverged else evaluate(model, val, args.seq_len, args.eval_sequences)
    if val_loss is not None and not math.isfinite(val_loss):
        diverged, val_loss = True, None
    return {
        "n_layers": n_layers, "n_loops": n_loops, "rule": rule, "lr": lr, "eps": model.eps,
        "val_loss": val_loss, "diverged": diverged, "train_curve": curve,
        "seconds": round(time.perf_counter() - start, 2), "params": model.num_params(),
        "train_flops_per_token": model.flops_per_token(args.seq_len), "tokens": args.steps * args.batch_size * args.seq_len,
        "fingerprint": _fingerprint(args),
    }


def _fingerprint(args: LoopedLRArgs) -> dict:
    """The options that change a run's result (grids and output folder excluded)."""
    d = asdict(args)
    for k in ("out_dir", "n_layers", "n_loops", "rules", "lrs", "threads"):
        d.pop(k)
    return d


def _run_path(out_dir: Path, n_layers: int, n_loops: int, rule: str, lr: float) -> Path:
    return out_dir / "runs" / f"L{n_layers}_N{n_loops}_{RULE_SLUGS[rule]}_lr{lr:.3e}.json"


def _write_json(path: Path, obj) -> None:
    """Write atomically (temp file + rename) so a killed sweep never leaves half a file."""
    from echotrain.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1))


# -------------------------------------------------------------------------------- the sweep


def run_sweep(args: LoopedLRArgs, log=print) -> list[dict]:
    """Train every (L, N, rule, lr) not already in ``out_dir/runs``; return all their records.

    Smaller N go first, so an interrupted sweep has complete curves for the cheap loop counts.
    Rules with the same eps at this (L, N) (all of them at N = 1, L = 1) share one run.

    Raises:
        ValueError: an unknown rule, or non-positive learning rates.
    """
    for rule in args.rules:
        if rule not in RESIDUAL_SCALINGS:
            raise ValueError(f"rules: {rule!r} is unknown; valid: {list(RESIDUAL_SCALINGS)}")
    if not args.lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        raise ValueError(f"lrs must be finite positive numbers, got {args.lrs}")
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    train, val = load_corpus()
    fingerprint = _fingerprint(args)
    records = []
    for n_layers in args.n_layers:
        for n_loops in sorted(args.n_loops):
            for rule in args.rules:
                eps = residual_multiplier(rule, n_loops, n_layers, args.lam)
                for lr in args.lrs:
                    path = _run_path(out_dir, n_layers, n_loops, rule, lr)
                    record = _load_if_same(path, fingerprint)
                    if record is None:  # an equivalent run (same eps) under another rule?
                        for other in RESIDUAL_SCALINGS:
                            if other != rule and math.isclose(residual_multiplier(other, n_loops, n_layers, args.lam), eps):
                                record = _load_if_same(_run_path(out_dir, n_layers, n_loops, other, lr), fingerprint)
                                if record is not None:
                                    record = {**record, "rule": rule, "shared_with": other}
                                    _write_json(path, record)
                                    break
                    if record is None:
                        record = train_one(args, n_layers, n_loops, rule, lr, train, val)
                        _write_json(path, record)
                        log(f"L={n_layers} N={n_loops:<2} {rule:<9} lr={lr:.2e}  val_loss="
                            f"{'diverged' if record['diverged'] else format(record['val_loss'], '.4f')}  ({record['seconds']:.0f}s)")
                    records.append(record)
    return records


def _load_if_same(path: Path, fingerprint: dict) -> dict | None:
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if record.get("fingerprint") == fingerprint else None


def load_records(out_dir: str | Path) -> list[dict]:
    """Every run record under ``out_dir/runs`` (to rebuild the summary and plot of a sweep)."""
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir, "runs").glob("*.json"))]


# ------------------------------------------------------------------------------ the analysis


def best_lrs(records: list[dict]) -> dict:
    """Per (L, rule, N): the grid argmin learning rate and a sub-grid estimate.

    The estimate fits a parabola to the loss at the argmin and its two grid neighbours in log2(lr)
    (the grid argmin when it lies on the grid's edge or a neighbour diverged). An (L, rule, N)
    whose learning-rate grid is incomplete (an interrupted sweep) is left out. Returns
    ``{L: {rule: {N: {"argmin_lr", "fit_lr", "best_loss"}}}}`` (JSON keys are strings).
    """
    table: dict = {}
    for r in records:
        table.setdefault(r["n_layers"], {}).setdefault(r["rule"], {}).setdefault(r["n_loops"], []).append(r)
    out: dict = {}
    for L, by_rule in table.items():
        grid = {f"{r['lr']:.3e}" for by_n in by_rule.values() for runs in by_n.values() for r in runs}
        for rule, by_n in by_rule.items():
            for N, runs in by_n.items():
                if {f"{r['lr']:.3e}" for r in runs} != grid:
                    continue
                runs = sorted(runs, key=lambda r: r["lr"])
                losses = [math.inf if r["val_loss"] is None else r["val_loss"] for r in runs]
                if all(math.isinf(x) for x in losses):
                    continue
                i = min(range(len(runs)), key=losses.__getitem__)
                fit = math.log2(runs[i]["lr"])
                if 0 < i < len(runs) - 1 and math.isfinite(losses[i - 1]) and math.isfinite(losses[i + 1]):
                    x = [math.log2(runs[j]["lr"]) for j in (i - 1, i, i + 1)]
                    y = [losses[j] for j in (i - 1, i, i + 1)]
                    # vertex of the parabola through three points
                    num = (x[1] - x[0]) ** 2 * (y[1] - y[2]) - (x[1] - x[2]) ** 2 * (y[1] - y[0])
                    den = (x[1] - x[0]) * (y[1] - y[2]) - (x[1] - x[2]) * (y[1] - y[0])
                    if den != 0:
                        fit = x[1] - 0.5 * num / den
                out.setdefault(L, {}).setdefault(rule, {})[N] = {
                    "argmin_lr": runs[i]["lr"], "fit_lr": 2**fit, "best_loss": losses[i],
                }
    return out


def verdict(best: dict) -> dict:
    """How far the best learning rate moves from the smallest to the largest N, per (L, rule).

    ``shift_grid``: log2(argmin_lr(N_max) / argmin_lr(N_min)) (grid steps of a log2 grid);
    ``spread_fit``: max - min of log2(fit_lr) over N; ``slope_fit``: least-squares slope of
    log2(fit_lr) on log2(N) (descriptive: 0 if the optimum transfers, -1/2 if it drifts like
    1/sqrt(N); not part of the verdict, which was fixed before the first sweep). The claim "holds" at one L when, under
    "1/N", the grid argmin moves by at most one grid step and the fitted optimum spreads less
    than under "1/sqrt(N)", while under "1/sqrt(N)" the argmin moves by at least one step.
    """
    result: dict = {}
    for L, by_rule in best.items():
        stats = {}
        for rule, by_n in by_rule.items():
            ns = sorted(by_n)
            x = [math.log2(n) for n in ns]
            y = [math.log2(by_n[n]["fit_lr"]) for n in ns]
            stats[rule] = {
                "n_loops": ns,
                "argmin_lr": [by_n[n]["argmin_lr"] for n in ns],
                "shift_grid": math.log2(by_n[ns[-1]]["argmin_lr"] / by_n[ns[0]]["argmin_lr"]),
                "spread_fit": max(y) - min(y),
                "slope_fit": _slope(x, y),
            }
        holds = None
        if "1/N" in stats and "1/sqrt(N)" in stats and len(stats["1/N"]["n_loops"]) > 1:
            a, b = stats["1/N"], stats["1/sqrt(N)"]
            holds = abs(a["shift_grid"]) <= 1 and a["spread_fit"] < b["spread_fit"] and abs(b["shift_grid"]) >= 1
        result[L] = {"rules": stats, "claim_holds": holds}
    return result


def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of y on x (0 for a single point)."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx else 0.0


def plot(records: list[dict], path: str | Path) -> None:
    """Final validation loss against learning rate: one panel per (L, rule), one curve per N;
    a last panel draws the fitted best learning rate against N for every (L, rule).

    Diverged runs are drawn as crosses on the top edge of their panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["n_layers"], r["rule"]) for r in records}, key=lambda p: (p[0], RESIDUAL_SCALINGS.index(p[1])))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.8), squeeze=False)
    axes = axes[0]
    finite = [r["val_loss"] for r in records if r["val_loss"] is not None]
    bottom, top = (min(finite) - 0.05, min(max(finite), min(finite) + 1.5) + 0.05) if finite else (0.0, 6.0)
    all_n = sorted({r["n_loops"] for r in records})
    all_lr = sorted({round(r["lr"], 12) for r in records})
    colors = {n: plt.cm.viridis(i / max(1, len(all_n) - 1)) for i, n in enumerate(all_n)}
    for ax, (L, rule) in zip(axes, panels):
        for n in all_n:
            runs = sorted((r for r in records if (r["n_layers"], r["rule"], r["n_loops"]) == (L, rule, n)), key=lambda r: r["lr"])
            ok = [r for r in runs if r["val_loss"] is not None]
            if ok:
                ax.plot([r["lr"] for r in ok], [min(r["val_loss"], top) for r in ok], "o-", color=colors[n], label=f"N={n}", ms=4)
                best = min(ok, key=lambda r: r["val_loss"])
                ax.plot(best["lr"], best["val_loss"], "*", color=colors[n], ms=12, mec="k")
            bad = [r["lr"] for r in runs if r["val_loss"] is None]
            if bad:
                ax.plot(bad, [top] * len(bad), "x", color=colors[n], ms=7)
        ax.set_xscale("log")
        ax.set_xticks(all_lr, [f"{lr:.2g}" for lr in all_lr], rotation=45, fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(bottom, top)
        ax.set_title(f"eps rule {rule}, L={L}")
        ax.set_xlabel("peak learning rate (AdamW)")
        ax.set_ylabel("final validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for L, by_rule in best_lrs(records).items():
        for rule, by_n in by_rule.items():
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n]["fit_lr"] for n in ns], "o-", label=f"{rule}, L={L}")
        first = next(iter(by_rule.values()))
        n0 = min(first)
        ax.plot(all_n, [first[n0]["fit_lr"] * (n / n0) ** -0.5 for n in all_n], "k:", lw=1,
                label="slope -1/2 (drift expected under 1/sqrt(N))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(all_n, [str(n) for n in all_n])
    ax.set_xlabel("loops N")
    ax.set_ylabel("best learning rate (parabola fit)")
    ax.set_title("best learning rate vs N")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("Looped transformer: loss vs learning rate per loop count N (star = best on the grid)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(records: list[dict], out_dir: str | Path) -> dict:
    """Write ``summary.json`` and ``loss_vs_lr.png`` in ``out_dir``; return the summary."""
    best = best_lrs(records)
    summary = {"best": best, "verdict": verdict(best)}
    _write_json(Path(out_dir, "summary.json"), summary)
    plot(records, Path(out_dir, "loss_vs_lr.png"))
    return summary


def format_table(summary: dict) -> str:
    """Markdown table of the argmin (and fitted) learning rate per (L, rule, N)."""
    lines = ["| L | rule | N | argmin lr | fitted lr | best val loss |", "|---|---|---|---|---|---|"]
    for L, by_rule in summary["best"].items():
        for rule, by_n in by_rule.items():
            for N, b in sorted(by_n.items(), key=lambda kv: int(kv[0])):
                lines.append(f"| {L} | {rule} | {N} | {b['argmin_lr']:.2e} | {b['fit_lr']:.2e} | {b['best_loss']:.4f} |")
    for L, v in summary["verdict"].items():
        for rule, s in v["rules"].items():
            lines.append(f"\nL={L} {rule}: argmin moves {s['shift_grid']:+.0f} grid steps (log2) from N={s['n_loops'][0]} "
                         f"to N={s['n_loops'][-1]}; fitted optimum spreads {s['spread_fit']:.2f} (log2), slope vs log2 N "
                         f"{s.get('slope_fit', float('nan')):+.2f}")
        lines.append(f"L={L}: claim holds: {v['claim_holds']}")
    return "\n".join(lines)


def format_loss_grid(records: list[dict]) -> str:
    """Markdown tables of the final validation loss, one per (L, rule): rows N, columns lr."""
    lrs = sorted({r["lr"] for r in records})
    cols = sorted({f"{lr:.3e}" for lr in lrs}, key=float)
    out = []
    for L, rule in sorted({(r["n_layers"], r["rule"]) for r in records}, key=lambda p: (p[0], RESIDUAL_SCALINGS.index(p[1]))):
        cell = {(r["n_loops"], f"{r['lr']:.3e}"): r for r in records if (r["n_layers"], r["rule"]) == (L, rule)}
        out += [f"\nL={L}, rule {rule}: final validation loss (nats/byte)\n",
                "| N | " + " | ".join(f"{float(c):.2g}" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for n in sorted({k[0] for k in cell}):
            vals = []
            for c in cols:
                r = cell.get((n, c))
                vals.append("" if r is None else "div." if r["val_loss"] is None else f"{r['val_loss']:.3f}")
            out.append(f"| {n} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def run(args: LoopedLRArgs, log=print) -> dict:
    """The whole experiment: sweep (resuming), then summary.json, the plot and a printed table."""
    records = run_sweep(args, log=log)
    summary = summarize(records, args.out_dir)
    log(format_loss_grid(records))
    log(format_table(summary))
    return summary


# ------------------------------------------------------------------------------------- CLI


def register(parser: argparse.ArgumentParser) -> None:
    """Add the options of :class:`LoopedLRArgs` to ``parser`` (``echotrain experiment looped-lr``)."""
    defaults = LoopedLRArgs()
    docs = {k: v.replace("%", "%%") for k, v in _field_docs().items()}  # argparse formats help with %
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            kind = type(value[0])
            parser.add_argument(flag, type=kind, nargs="+", default=value, help=f"{docs.get(name, '')} (default: {value})")
        else:
            parser.add_argument(flag, type=type(value), default=value, help=f"{docs.get(name, '')} (default: {value})")
    parser.add_argument("--short", action="store_true", help="tiny grid for CI (~10 s): d=32, N in {1, 2}, 3 lrs, 30 steps")
    parser.add_argument("--summarize-only", action="store_true", help="rebuild summary.json and the plot from out_dir/runs")
    parser.set_defaults(func=run_from_args)


def short_args(out_dir: str) -> LoopedLRArgs:
    """The CI-sized version of the experiment."""
    return LoopedLRArgs(
        out_dir=out_dir, n_loops=[1, 2], lrs=[1e-3, 4e-3, 1.6e-2], d_model=32, n_heads=2, seq_len=32,
        batch_size=8, steps=30, warmup_steps=5, eval_sequences=16,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """CLI entry point; returns the exit code."""
    if args.summarize_only:
        records = load_records(args.out_dir)
        summary = summarize(records, args.out_dir)
        print(format_loss_grid(records))
        print(format_table(summary))
        return 0
    if args.short:  # never overwrite the committed results with the CI-sized run
        default = args.out_dir == LoopedLRArgs().out_dir
        options = short_args(str(Path.home() / ".cache/echotrain/looped_lr_short") if default else args.out_dir)
    else:
        options = LoopedLRArgs(**{k: getattr(args, k) for k in asdict(LoopedLRArgs())})
    run(options)
    return 0


def _field_docs() -> dict[str, str]:
    """The one-line docstrings under each field of :class:`LoopedLRArgs` (for ``--help``)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(LoopedLRArgs)).body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = b.value.value
    return docs
