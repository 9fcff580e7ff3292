"""The update of one RL step with and without the three passes issue 21 removed, in one process,
alternating, as ratios: the later mini-batches' old log-probs from the sampler
(``reuse_sampler_log_probs``), ECHO's pre-pass from the kept with-grad forwards
(``log_prob_prepass=retain``) and the tied embedding's sparse gradient (``sparse_embedding_grad``).

What is timed: the trainer's own ``train_step`` on one fixed rollout batch of the default job
(embedded SmolLM2-135M-Instruct, 8 prompts x 8 rollouts, 32 new tokens, two mini-batches,
micro-batches of 32, AdamW; ``--set`` changes any setting, e.g. ``autocast=off``), generated once
and handed to every call, so the timed part is steps 2-6 of the step: advantages, old log-probs,
ECHO's pre-pass, both mini-batches' forward / backward / optimizer step and the metrics
(``time/update`` of the step's record). The weights, optimizer and scheduler are restored before
every call, so each arm updates the same weights from the same state. Arms: ``before`` (all three
off: the update before issue 21 removed them), each one alone, and ``all`` (all three on). ``--reps`` rounds, the order alternating, after one untimed warm-up call of each arm.
Printed: the median seconds of each arm and the ratio to ``before``, and the largest
difference of the arms' loss metrics from ``before`` (the same update up to float rounding).
``--arm NAME:KEY=VALUE,...`` (repeatable) replaces the built-in arms by arms of other update
settings, the first one the baseline of the ratios (e.g. micro-batch sizes). An arm can change
only what the trainer reads at each step (the update and objective settings); what it reads when
it is built (model, autocast, optimizer, LoRA) goes in ``--set`` for all arms. Values with commas
cannot be given in an arm.

    python benchmarks/bench_update_passes.py --threads 2 --reps 3 --set autocast=off
    python benchmarks/bench_update_passes.py --threads 2 --reps 3
    python benchmarks/bench_update_passes.py --threads 2 --reps 3 --set autocast=off \
        --arm mb8:micro_batch_size=8 --arm mb32:micro_batch_size=32
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: the arms: the three settings of each (reuse_sampler_log_probs, log_prob_prepass, sparse_embedding_grad)
ARMS = {
    "before": dict(reuse_sampler_log_probs=False, log_prob_prepass="forward", sparse_embedding_grad=False),
    "sampler log-probs": dict(reuse_sampler_log_probs=True, log_prob_prepass="forward", sparse_embedding_grad=False),
    "kept pre-pass": dict(reuse_sampler_log_probs=False, log_prob_prepass="retain", sparse_embedding_grad=False),
    "sparse embedding": dict(reuse_sampler_log_probs=False, log_prob_prepass="forward", sparse_embedding_grad=True),
    "all": dict(reuse_sampler_log_probs=True, log_prob_prepass="retain", sparse_embedding_grad=True),
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting, as on the command line (e.g. autocast=off, model=testbed)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="instead of the built-in arms: an arm of these settings (repeatable; the first is the "
                         "baseline of the ratios)")
    args = ap.parse_args(argv)

    from echotrain.cli import set_omp_wait_policy

    wait = set_omp_wait_policy()
    import torch

    torch.set_num_threads(args.threads)
    from echotrain.train.config import resolve_config
    from echotrain.train.config.parse import parse_overrides
    from echotrain.train.features import tied_trainable_embedding
    from echotrain.train.trainer import Trainer
    from echotrain.train.update import sampler_is_learner

    base = {**parse_overrides(args.set), "output_dir": tempfile.mkdtemp(prefix="bench_upd-"), "eval_prompts": 0,
            "progress": False, "plots": False, "save_every": 0}
    cfg = resolve_config(overrides=base)
    if args.arm:  # name -> the whole config of the arm
        arms = {name: resolve_config(overrides={**base, **parse_overrides(settings.split(",") if settings else [])})
                for name, _, settings in (spec.partition(":") for spec in args.arm)}
    else:
        arms = {name: dataclasses.replace(cfg, **settings) for name, settings in ARMS.items()}
    trainer = Trainer(cfg)
    data = trainer.rollouts.rollouts_for(1)  # one rollout batch, handed to every call below
    trainer.rollouts.rollouts_for = lambda step: copy.deepcopy(data)
    state = copy.deepcopy((trainer.model.state_dict(), trainer.optimizer.state_dict(),
                           trainer.scheduler.state_dict()))
    emb = tied_trainable_embedding(trainer.model)  # None: the sparse setting does not apply to this model
    tied = emb is not None

    def call(arm: str) -> dict:
        trainer.model.load_state_dict(state[0])
        trainer.optimizer.load_state_dict(state[1])
        trainer.scheduler.load_state_dict(state[2])
        trainer.cfg = arms[arm]
        trainer.sampler_is_learner = sampler_is_learner(trainer.cfg, trainer.autocast_dtype,
                                                        next(trainer.model.parameters()).dtype)
        if tied:
            emb.sparse = trainer.cfg.sparse_embedding_grad
        torch.manual_seed(cfg.seed)
        return trainer.train_step(1)

    names = list(arms)
    for name in names:
        call(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    records: dict[str, dict] = {}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            records[name] = call(name)
            times[name].append(records[name]["time/update"])
    base = statistics.median(times[names[0]])
    lengths = data.batch.response_mask.sum(-1)
    print(f"# {cfg.model or 'the default model (SmolLM2-135M-Instruct)'}, autocast {trainer.autocast_dtype}, "
          f"{len(lengths)} rows, mean response {float(lengths.float().mean()):.1f} tokens, {cfg.num_mini_batches} "
          f"mini-batches of micro-batch {cfg.micro_batch_size}, {args.threads} threads, OpenMP wait {wait}, "
          f"load avg {os.getloadavg()[0]:.1f}, {args.reps} reps; the tied-embedding setting applies: {tied}")
    print(f"| arm | median s (time/update) | ratio | largest metric difference from {names[0]} | per-rep s |")
    print("|---|---:|---:|---:|---|")
    out: dict = {}
    loss_keys = [k for k in records[names[0]] if k.startswith(("pg_", "echo/", "grad_norm", "ppo_kl"))]
    for name in names:
        med = statistics.median(times[name])
        diff = max((abs(records[name][k] - records[names[0]][k]) for k in loss_keys if k in records[name]), default=0.0)
        print(f"| {name} | {med:.2f} | {med / base:.2f} | {diff:.1e} | {', '.join(f'{t:.2f}' for t in times[name])} |")
        settings = {k: v for k, v in arms[name].to_dict().items() if cfg.to_dict().get(k) != v}
        out[name] = {"median_s": med, "ratio": med / base, "max_metric_diff": diff, "settings": settings}
    return out


if __name__ == "__main__":
    main()
