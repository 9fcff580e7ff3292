"""Experiment: does SAM applied only late in training match full SAM? (Zhou et al., ICLR 2025)

Claim (arXiv 2410.10373, Sec. 4): switching from SGD to SAM for the last few epochs gives nearly
the test accuracy and the sharpness (top Hessian eigenvalue) of SAM used from the start, at a
fraction of SAM's doubled cost.

Set-up (CPU-sized stand-in for the paper's WideResNet/CIFAR-10):

- data: scikit-learn's bundled ``digits`` (1,797 8x8 grey images, 10 classes; ships with the
  package, no download), pixels / 16, a fixed stratified 75/25 train/test split;
- model: MLP 64-``hidden``-``hidden``-10 with ReLU;
- optimizer: mini-batch SGD with momentum 0.9 and weight decay; the paper's WRN step schedule
  (LR x1 for the first 30% of epochs, x0.2 to 60%, x0.04 after); SAM (rho 0.05) wraps the same
  SGD;
- arms: one per switch epoch s: SGD for epochs [0, s), SAM for [s, epochs). s = 0 is full SAM,
  s = epochs is SGD only; the paper's proportion (175 of 200) is s = 0.875 * epochs;
- each seed fixes the initial weights and the batch order, shared by all arms (paired runs);
- measured: test accuracy, lambda_max of the training-loss Hessian on the whole training set in
  eval mode (Lanczos, :mod:`echotrain.optim.sharpness`), its trace (Hutchinson), the training wall-clock
  and the number of gradient evaluations (forward+backward passes).

Run: ``echotrain experiment late-sam --out docs/experiments`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from echotrain.optim.late_sam import LateSAM
from echotrain.optim.schedules import step_decay
from echotrain.optim.sharpness import hessian_trace, model_loss_fn, top_hessian_eigenvalue


@dataclass
class LateSamConfig:
    """Hyper-parameters of one training run (shared by every arm and seed)."""

    epochs: int = 200
    """Training epochs (as the paper's WRN-16-8 on CIFAR-10)."""
    batch_size: int = 64
    """Mini-batch size; the last, smaller batch of an epoch is kept."""
    lr: float = 0.05
    """Initial learning rate of SGD."""
    lr_schedule: str = "wrn"
    """``"wrn"``: the paper's WideResNet step schedule (:func:`echotrain.optim.schedules.step_decay`: x0.2 at 30% of the
    epochs, x0.04 from 60%); ``"constant"``: no decay (an ablation: a larger late-phase LR)."""
    momentum: float = 0.9
    """SGD momentum (the paper: 0.9)."""
    weight_decay: float = 5e-4
    """SGD weight decay (L2, coupled)."""
    rho: float = 0.05
    """SAM radius (Foret et al.'s CIFAR-10 default); fixed before any run, not tuned."""
    hidden: int = 128
    """Width of the two hidden layers."""
    restart_momentum: bool = True
    """Clear the momentum buffer at the switch (the paper's code uses a fresh optimizer)."""
    lanczos_iters: int = 40
    """Max Hessian-vector products for lambda_max (Lanczos, relative tolerance 1e-4)."""
    trace_samples: int = 20
    """Hutchinson samples for tr(H) (0 to skip)."""
    test_fraction: float = 0.25
    """Share of digits held out for testing (stratified)."""
    split_seed: int = 0
    """Seed of the train/test split (fixed across seeds and arms)."""


@dataclass
class RunResult:
    """One (seed, switch epoch) run."""

    seed: int
    switch_epoch: int
    sam_start_step: int
    first_sam_epoch: int | None
    test_acc: float
    train_loss: float
    lambda_max: float
    lambda_converged: bool
    trace: float | None
    wall_s: float
    cpu_s: float
    grad_evals: int
    grad_evals_per_epoch: list[int] = field(default_factory=list)


# --- data and model ---------------------------------------------------------------------------


def load_digits_split(test_fraction: float = 0.25, split_seed: int = 0):
    """scikit-learn digits as float32 tensors: (x_train, y_train, x_test, y_test).

    x: (n, 64) float32 in [0, 1]; y: (n,) int64 in 0..9. Stratified split, fixed by ``split_seed``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y
    )
    as_x = lambda a: torch.tensor(a / 16.0, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(hidden: int, seed: int) -> nn.Module:
    """MLP 64 -> hidden -> hidden -> 10 (ReLU), initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


LR_SCHEDULES = ("wrn", "constant")


# --- one run ----------------------------------------------------------------------------------


def train_one(cfg: LateSamConfig, data, seed: int, switch_epoch: int) -> RunResult:
    """Train one model: SGD for epochs [0, switch_epoch), SAM for [switch_epoch, epochs)."""
    x_tr, y_tr, x_te, y_te = data
    n = len(x_tr)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    model = make_model(cfg.hidden, seed)
    opt = LateSAM(
        model.parameters(), torch.optim.SGD,
        sam_start=switch_epoch, sam_start_unit="epoch", steps_per_epoch=steps_per_epoch,
        restart_momentum=cfg.restart_momentum, rho=cfg.rho, model=model,
        lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
    )
    if cfg.lr_schedule == "wrn":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: step_decay(epoch, cfg.epochs))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    order_gen = torch.Generator().manual_seed(seed)

    grad_evals_per_epoch: list[int] = []
    first_sam_epoch = None
    start, start_cpu = time.perf_counter(), time.process_time()
    for epoch in range(cfg.epochs):
        model.train()
        evals = 0
        if first_sam_epoch is None and opt.sam_active():
            first_sam_epoch = epoch
        perm = torch.randperm(n, generator=order_gen)
        for i in range(0, n, cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            xb, yb = x_tr[idx], y_tr[idx]

            def closure():
                nonlocal evals
                evals += 1
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss

            opt.step(closure)
        sched.step()
        grad_evals_per_epoch.append(evals)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu

    # Evaluation: test accuracy, training loss and sharpness at the final weights, eval mode.
    model.eval()
    with torch.no_grad():
        test_acc = (model(x_te).argmax(-1) == y_te).float().mean().item()
    loss_fn = model_loss_fn(model, F.cross_entropy, (x_tr, y_tr))
    with torch.no_grad():
        train_loss = loss_fn().item()
    eig = top_hessian_eigenvalue(loss_fn, model.parameters(), max_iter=cfg.lanczos_iters, tol=1e-4, seed=seed)
    trace = None
    if cfg.trace_samples > 0:
        trace = hessian_trace(loss_fn, model.parameters(), samples=cfg.trace_samples, seed=seed).trace
    return RunResult(
        seed=seed, switch_epoch=switch_epoch, sam_start_step=opt.sam_start_step,
        first_sam_epoch=first_sam_epoch, test_acc=test_acc, train_loss=train_loss,
        lambda_max=eig.eigenvalue, lambda_converged=eig.converged, trace=trace, wall_s=wall, cpu_s=cpu,
        grad_evals=sum(grad_evals_per_epoch), grad_evals_per_epoch=grad_evals_per_epoch,
    )


# --- the experiment ---------------------------------------------------------------------------


def default_switch_epochs(epochs: int) -> list[int]:
    """Full SAM, SAM for the last 75/50/25/20/12.5/10 %, SGD only (sorted, unique)."""
    fracs = [0.0, 0.25, 0.5, 0.75, 0.8, 0.875, 0.9, 1.0]
    return sorted({int(round(f * epochs)) for f in fracs})


def run_late_sam(
    cfg: LateSamConfig,
    seeds: list[int],
    switch_epochs: list[int],
    out_dir: Path | None = None,
    log=print,
) -> list[RunResult]:
    """Train every (switch epoch, seed) pair, then write JSON, table and plot to ``out_dir``.

    Args:
        cfg: shared hyper-parameters.
        seeds: one run per seed and arm (same seed: same init and batch order in every arm).
        switch_epochs: arms; each in [0, cfg.epochs] (0: full SAM; cfg.epochs: SGD only).
        out_dir: if given, ``late_sam.json``, ``late_sam_table.md`` and ``late_sam.png`` go here.
        log: progress printer.

    Raises:
        ValueError: a switch epoch outside [0, epochs], or no seeds.
    """
    if not seeds:
        raise ValueError("seeds is empty")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={cfg.lr_schedule!r} is unknown; valid: {list(LR_SCHEDULES)}")
    bad = [s for s in switch_epochs if not 0 <= s <= cfg.epochs]
    if bad:
        raise ValueError(f"switch_epochs {bad} outside [0, epochs={cfg.epochs}]")
    data = load_digits_split(cfg.test_fraction, cfg.split_seed)
    results = []
    # Seeds outside, arms inside: load from other processes on a shared machine spreads over
    # all arms instead of biasing whichever arm ran during a busy minute.
    for seed in seeds:
        for s in switch_epochs:
            r = train_one(cfg, data, seed, s)
            log(
                f"switch={s:3d} seed={seed} acc={r.test_acc:.4f} lambda_max={r.lambda_max:.3f} "
                f"loss={r.train_loss:.4f} wall={r.wall_s:.2f}s cpu={r.cpu_s:.2f}s grad_evals={r.grad_evals}"
            )
            results.append(r)
    if out_dir is not None:
        write_report(cfg, seeds, results, Path(out_dir))
    return results


def write_report(cfg: LateSamConfig, seeds: list[int], results: list[RunResult], out_dir: Path) -> None:
    """Write ``late_sam.json`` (config, every run, summary), ``late_sam_table.md`` and ``late_sam.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, cfg.epochs)
    (out_dir / "late_sam.json").write_text(
        json.dumps({"config": asdict(cfg), "seeds": seeds, "runs": [asdict(r) for r in results],
                    "summary": summary}, indent=1)
    )
    (out_dir / "late_sam_table.md").write_text(markdown_table(summary))
    decays = [0.3 * cfg.epochs, 0.6 * cfg.epochs] if cfg.lr_schedule == "wrn" else []
    plot(summary, cfg.epochs, out_dir / "late_sam.png", lr_decay_epochs=decays,
         note=f"rho={cfg.rho}, lr={cfg.lr} ({cfg.lr_schedule} schedule)")


def rerender(out_dir: Path) -> None:
    """Rewrite the table and the plot in ``out_dir`` from its ``late_sam.json`` (no training)."""
    data = json.loads((out_dir / "late_sam.json").read_text())
    cfg = LateSamConfig(**data["config"])
    results = [RunResult(**r) for r in data["runs"]]
    write_report(cfg, data["seeds"], results, out_dir)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: list[RunResult], epochs: int) -> list[dict]:
    """Per arm: mean and sample std over seeds of every measure, costs relative to SGD only, and
    paired (same-seed) comparisons: ``acc_minus_sgd`` = acc(arm) - acc(SGD) and
    ``lambda_gap_closed`` = (lambda(SGD) - lambda(arm)) / (lambda(SGD) - lambda(full SAM)), the
    share of full SAM's sharpness reduction that the arm achieves (1: all of it, 0: none)."""
    arms = sorted({r.switch_epoch for r in results})
    by = {(r.switch_epoch, r.seed): r for r in results}
    rows = []
    for s in arms:
        rs = [r for r in results if r.switch_epoch == s]
        row = {"switch_epoch": s, "sam_epochs": epochs - s, "seeds": len(rs)}
        for key in ("test_acc", "lambda_max", "train_loss", "wall_s", "cpu_s", "grad_evals"):
            row[key] = _mean_std([float(getattr(r, key)) for r in rs])
        traces = [r.trace for r in rs if r.trace is not None]
        row["trace"] = _mean_std(traces) if traces else None
        paired = [(r, by.get((epochs, r.seed)), by.get((0, r.seed))) for r in rs]
        if all(sgd is not None for _, sgd, _ in paired):
            row["acc_minus_sgd"] = _mean_std([r.test_acc - sgd.test_acc for r, sgd, _ in paired])
        else:
            row["acc_minus_sgd"] = None
        if all(sgd is not None and sam is not None and sgd.lambda_max != sam.lambda_max for _, sgd, sam in paired):
            row["lambda_gap_closed"] = _mean_std(
                [(sgd.lambda_max - r.lambda_max) / (sgd.lambda_max - sam.lambda_max) for r, sgd, sam in paired]
            )
        else:
            row["lambda_gap_closed"] = None
        rows.append(row)
    sgd_row = next((row for row in rows if row["switch_epoch"] == epochs), None)
    for row in rows:
        for key in ("wall_s", "cpu_s", "grad_evals"):
            row[f"{key}_vs_sgd"] = row[key][0] / sgd_row[key][0] if sgd_row else None
    return rows


def _label(row: dict, epochs: int) -> str:
    if row["switch_epoch"] == 0:
        return "full SAM"
    if row["switch_epoch"] == epochs:
        return "SGD only"
    return f"SGD->SAM, last {row['sam_epochs']} ep ({100 * row['sam_epochs'] / epochs:.1f}%)"


def _pm(ms: tuple[float, float] | None, fmt: str = ".3f", mult: float = 1.0) -> str:
    if ms is None:
        return "-"
    return f"{mult * ms[0]:{fmt}} +- {mult * ms[1]:{fmt.lstrip('+')}}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown_table(summary: list[dict]) -> str:
    """Two GitHub-markdown tables (mean +- sample std over seeds): quality, then cost."""
    epochs = summary[0]["switch_epoch"] + summary[0]["sam_epochs"] if summary else 0
    lines = [
        "| arm | switch epoch | test acc (%) | acc - SGD (pp, paired) | lambda_max | share of SAM's lambda_max drop (paired) | tr(H) | train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {_label(r, epochs)} | {r['switch_epoch']} | {_pm(r['test_acc'], '.2f', 100)} "
            f"| {_pm(r['acc_minus_sgd'], '+.2f', 100)} | {_pm(r['lambda_max'])} | {_pm(r['lambda_gap_closed'], '.2f')} "
            f"| {_pm(r['trace'], '.2f')} | {_pm(r['train_loss'], '.4f')} |"
        )
    lines += [
        "",
        "| arm | gradient evaluations | x SGD | training CPU time (s) | x SGD | training wall-clock (s) | x SGD |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {_label(r, epochs)} | {r['grad_evals'][0]:.0f} | {_ratio(r['grad_evals_vs_sgd'])} "
            f"| {_pm(r['cpu_s'], '.2f')} | {_ratio(r['cpu_s_vs_sgd'])} "
            f"| {_pm(r['wall_s'], '.2f')} | {_ratio(r['wall_s_vs_sgd'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], epochs: int, path: Path, lr_decay_epochs: list[float] = (), note: str = "") -> None:
    """Test accuracy and lambda_max (mean +- std) against the switch epoch; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["switch_epoch"] for r in summary]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("test_acc", "test accuracy (%)", 100.0),
        ("lambda_max", "top Hessian eigenvalue (train loss)", 1.0),
        ("cpu_s", "training CPU time (s, 1 thread)", 1.0),
    ]
    for ax, (key, title, mult) in zip(axes, panels):
        ys = [mult * r[key][0] for r in summary]
        es = [mult * r[key][1] for r in summary]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3)
        ax.set_xlabel(f"switch epoch (SGD before, SAM after; {epochs} epochs)")
        ax.set_title(title)
        for i, e in enumerate(lr_decay_epochs):
            ax.axvline(e, color="grey", ls=":", lw=1, label="LR decay" if i == 0 else None)
        if lr_decay_epochs and key == "lambda_max":
            ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    seeds = summary[0]["seeds"] if summary else 0
    fig.suptitle(f"Late-phase SAM on sklearn digits (MLP), mean +- std over {seeds} seeds; "
                 f"0 = full SAM, right end = SGD only. {note}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI --------------------------------------------------------------------------------------


def register(parser: argparse.ArgumentParser) -> None:
    """Options of ``echotrain experiment late-sam``."""
    d = LateSamConfig()
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (0..N-1) per arm (default 5)")
    parser.add_argument("--epochs", type=int, default=d.epochs, help=f"training epochs (default {d.epochs})")
    parser.add_argument(
        "--switch-epochs", type=str, default=None,
        help="comma-separated switch epochs (0 = full SAM, EPOCHS = SGD only); default: "
             "fractions 0, .25, .5, .75, .8, .875, .9, 1 of EPOCHS",
    )
    parser.add_argument("--rho", type=float, default=d.rho, help=f"SAM radius (default {d.rho})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"initial SGD learning rate (default {d.lr})")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule,
                        help="'wrn': the paper's x0.2 at 30%% / x0.04 from 60%% of epochs (default); 'constant': no decay")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help=f"batch size (default {d.batch_size})")
    parser.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden width (default {d.hidden})")
    parser.add_argument("--no-restart-momentum", action="store_true", help="keep the SGD momentum buffer at the switch")
    parser.add_argument("--lanczos-iters", type=int, default=d.lanczos_iters, help="max Hessian-vector products for lambda_max")
    parser.add_argument("--trace-samples", type=int, default=d.trace_samples, help="Hutchinson samples for tr(H) (0: skip)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="folder for late_sam.json / late_sam_table.md / late_sam.png")
    parser.add_argument("--rerender", action="store_true",
                        help="only rewrite the table and plot in --out from its late_sam.json (no training)")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run :func:`run_late_sam` from parsed CLI options and print the table."""
    torch.set_num_threads(args.threads)
    if args.rerender:
        if args.out is None:
            raise SystemExit("--rerender needs --out FOLDER holding late_sam.json")
        rerender(args.out)
        print((args.out / "late_sam_table.md").read_text())
        return 0
    cfg = LateSamConfig(
        epochs=args.epochs, rho=args.rho, lr=args.lr, lr_schedule=args.lr_schedule,
        batch_size=args.batch_size, hidden=args.hidden,
        restart_momentum=not args.no_restart_momentum, lanczos_iters=args.lanczos_iters,
        trace_samples=args.trace_samples,
    )
    if args.switch_epochs:
        switch = sorted({int(s) for s in args.switch_epochs.split(",")})
    else:
        switch = default_switch_epochs(cfg.epochs)
    results = run_late_sam(cfg, list(range(args.seeds)), switch, out_dir=args.out)
    print(markdown_table(summarize(results, cfg.epochs)))
    return 0
