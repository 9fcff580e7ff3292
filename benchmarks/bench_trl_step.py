"""One RL step of echotrain's Trainer against TRL's GRPOTrainer, same settings, same process.

What is timed: one full RL step = rollout (generate B x G completions) + reward + advantages +
one optimizer step over the whole rollout batch (gradient accumulation over micro-batches of
``--micro-batch-size`` completions). Both sides get

- the same model: the embedded default SmolLM2-135M-Instruct (``echotrain.models.load_policy``),
  loaded twice (TRL patches its model's ``forward`` with a fused log-prob head, so the two
  trainers must not share a model object), float32, no dropout;
- the same prompts distribution: the default task (``echotrain.tasks.get_task("default")``),
  TRL through a ``datasets.Dataset`` of the same chat messages, and the same reward function
  object type (``echotrain.rewards.RewardFunction(task)``);
- the same batch (``--prompts`` B x ``--generations`` G), ``max_new_tokens`` /
  ``max_completion_length``, temperature, top_p = 1, top_k = 0;
- the same objective: DAPO token-level clip 0.2 / 0.28 with token-mean aggregation over the
  whole step (echotrain preset ``dapo`` without dynamic sampling or overlong shaping; TRL
  ``loss_type="dapo"``), group-std advantages, beta = 0 (no reference model), one optimizer step
  per rollout batch (TRL: ``steps_per_generation == gradient_accumulation_steps``,
  ``num_iterations=1``), AdamW lr 1e-6 betas (0.9, 0.99), grad-norm clip 1.0;
- float32 (echotrain ``autocast=off``, TRL ``bf16=False``), or with ``--bf16`` both in bfloat16
  mixed precision (echotrain ``autocast=bfloat16``, TRL ``bf16=True``: autocast through
  accelerate); no vLLM, no gradient checkpointing (TRL's default is on; it would make TRL
  slower, so it is off for equal settings), ``report_to="none"``, offline.

How: TRL's ``trainer.train()`` runs ``warmup + reps`` steps; a ``TrainerCallback`` times each of
its steps (``on_step_begin`` -> ``on_step_end``) and runs one echotrain ``Trainer.train_step``
between TRL steps, alternating the order (ours after TRL on even steps, before on odd ones) so
that both sides see the same machine load. The first ``warmup`` steps of each are discarded.
Each step is timed in wall-clock seconds and in process CPU seconds (``time.process_time``, all
threads): on a shared machine the wall clock mostly measures the other users' load, the CPU time
the work done. Reported: medians of each, the ratio TRL / echotrain (> 1: echotrain is faster),
a breakdown (generation, scoring, and the update: old log-probs, with-grad forward, backward,
optimizer; measured by wrapping the methods, no behaviour change) and the machine load
(``os.getloadavg``). ``--no-share-prefix`` is the ablation of echotrain's shared-prompt
prefill/forward (the G completions of a prompt share its KV cache). ``--set KEY=VALUE`` changes one of
echotrain's settings (e.g. ``decode_linear=torch``, the float32 linear layers of generation through
``F.linear`` instead of oneDNN); TRL's side is unchanged.

Usage (defaults: a small setting that takes a few minutes on 2 shared cores)::

    python benchmarks/bench_trl_step.py --threads 2 --prompts 2 --generations 4 \
        --max-new-tokens 24 --micro-batch-size 8 --warmup 1 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=2, help="B: prompts per step")
    p.add_argument("--generations", type=int, default=4, help="G: completions per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="max completion length in tokens")
    p.add_argument("--micro-batch-size", type=int, default=8, help="completions per forward/backward")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--loss-mode", default="vanilla", choices=["vanilla", "echo"],
                   help="echotrain's policy loss (vanilla = the same DAPO clip TRL computes; echo costs the same "
                        "on-policy)")
    p.add_argument("--no-share-prefix", dest="share_prefix", action="store_false",
                   help="ablation: echotrain without its shared-prompt prefill/forward (share_prompt_prefix=False)")
    p.add_argument("--warmup", type=int, default=1, help="steps of each side discarded before timing")
    p.add_argument("--reps", type=int, default=3, help="timed steps of each side")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="both sides in bfloat16 mixed precision (autocast)")
    p.add_argument("--model", default=None, help="policy (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another echotrain setting, as on the command line (e.g. decode_linear=torch); TRL is unchanged")
    return p.parse_args(argv)


#: Columns of the report. ``update`` = everything after the rollout and its scoring;
#: ``backward`` = update - old_log_prob - forward - optimizer (backward, loss math, stats).
PARTS = ("step", "generation", "scoring", "update", "old_log_prob", "forward", "backward", "optimizer")


class Timers:
    """Accumulating named timers, wall clock (``name``) and process CPU time (``name/cpu``)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def time(self, name: str):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.t[name] += time.perf_counter() - t0
            self.t[name + "/cpu"] += time.process_time() - c0

    def reset(self) -> dict[str, float]:
        out, self.t = dict(self.t), defaultdict(float)
        return out


def _wrap(obj, name: str, timers: Timers, key: str) -> None:
    """Time every call of ``obj.name`` into ``timers[key]`` (an instance/module attribute; benchmark only)."""
    fn = getattr(obj, name)

    @functools.wraps(fn)  # keeps markers such as the LR scheduler's _wrapped_by_lr_sched
    def timed(*a, **kw):
        with timers.time(key):
            return fn(*a, **kw)

    setattr(obj, name, timed)


def _row(t: dict[str, float], step: float, step_cpu: float, update: float, update_cpu: float, length) -> dict:
    """One step's record: wall and CPU seconds of each part."""
    row = {"response_length": length, "threads": torch.get_num_threads()}
    for suffix, total, upd in (("", step, update), ("/cpu", step_cpu, update_cpu)):
        g = lambda k: t.get(k + suffix, 0.0)  # noqa: E731
        row["step" + suffix] = total
        row["generation" + suffix] = g("generation")
        row["scoring" + suffix] = g("scoring")
        row["update" + suffix] = upd
        row["old_log_prob" + suffix] = g("old_log_prob")
        row["forward" + suffix] = g("forward") - g("old_log_prob")  # nested: with-grad forwards only
        row["optimizer" + suffix] = g("optimizer")
        row["backward" + suffix] = upd - row["old_log_prob" + suffix] - row["forward" + suffix] - g("optimizer")
    return row


def make_timed_grpo_trainer_class(timers: Timers):
    """GRPOTrainer with timers around generation, scoring and the loss forward (no behaviour change)."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            with timers.time("generation"):
                return super()._generate(prompts)

        def _calculate_rewards(self, *args, **kwargs):
            with timers.time("scoring"):
                return super()._calculate_rewards(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            with timers.time("rollout_total"):
                return super()._generate_and_score_completions(inputs)

        def compute_loss(self, *args, **kwargs):  # the with-grad forward (TRL has no old-log-prob pass on-policy)
            with timers.time("forward"):
                return super().compute_loss(*args, **kwargs)

    return TimedGRPOTrainer


def build_echotrain(args, model, tokenizer, task, out_dir):
    from echotrain.train.config import resolve_config
    from echotrain.train.config.parse import parse_overrides
    from echotrain.train.trainer import Trainer

    micro = min(args.micro_batch_size, args.prompts * args.generations)
    cfg = resolve_config(overrides=dict(
        preset="dapo", dynamic_sampling=False, overlong_buffer_len=0, overlong_filtering=False,
        loss_mode=args.loss_mode, loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
        adv_estimator="grpo", kl_coef=0.0,
        prompts_per_step=args.prompts, num_generations=args.generations, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, rollout_batch_size=0,
        num_mini_batches=1, ppo_epochs=1, micro_batch_size=micro,
        optimizer="adamw", lr=args.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8,
        max_grad_norm=1.0, lr_scheduler="constant", warmup_steps=0,
        steps=args.warmup + args.reps, seed=args.seed, device="cpu", num_threads=args.threads,
        dtype="float32", autocast="bfloat16" if args.bf16 else "off", output_dir=out_dir, save_every=0, save_final_model=False, plots=False,
        progress=False, log_samples=0, share_prompt_prefix=args.share_prefix,
        **parse_overrides(args.set),
    ))
    return Trainer(cfg, model=model, tokenizer=tokenizer, task=task)


def build_trl(args, model, tokenizer, task, out_dir, callback, timers):
    from datasets import Dataset
    from trl import GRPOConfig

    from echotrain.rewards import RewardFunction

    n_prompts = args.prompts * (args.warmup + args.reps + 1)
    examples = list(task.sample(n_prompts, args.seed + 12345))
    dataset = Dataset.from_list([{"prompt": ex.messages, "ex_id": i} for i, ex in enumerate(examples)])
    reward = RewardFunction(task)

    def echotrain_reward(prompts, completions, ex_id, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards, _info = reward(texts, [examples[i] for i in ex_id])
        return [float(r) for r in rewards]

    n = args.prompts * args.generations
    micro = min(args.micro_batch_size, n)
    if n % micro:
        raise SystemExit(f"B*G = {n} must be a multiple of --micro-batch-size {micro} for TRL")
    cfg = GRPOConfig(
        output_dir=out_dir, use_cpu=True, seed=args.seed, report_to="none", disable_tqdm=True,
        logging_strategy="no", save_strategy="no", dataloader_num_workers=0, dataloader_pin_memory=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
        num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, num_iterations=1,
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        mask_truncated_completions=False, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8,
        optim="adamw_torch", max_grad_norm=1.0, max_steps=args.warmup + args.reps,
        bf16=args.bf16, fp16=False, gradient_checkpointing=False, disable_dropout=True, use_vllm=False,
        log_completions=False, shuffle_dataset=True,
    )
    cls = make_timed_grpo_trainer_class(timers)
    return cls(model=model, reward_funcs=[echotrain_reward], args=cfg, train_dataset=dataset,
               processing_class=tokenizer, callbacks=[callback])


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import TrainerCallback

    from echotrain.models import load_policy
    from echotrain.tasks import get_task

    t_load = time.perf_counter()
    model_ours, tok_ours = load_policy(args.model)
    model_trl, tok_trl = load_policy(args.model)
    task = get_task("default")
    tmp = tempfile.mkdtemp(prefix="bench_trl_step_")
    ours = build_echotrain(args, model_ours, tok_ours, task, os.path.join(tmp, "echotrain"))

    records: dict[str, list[dict]] = {"trl": [], "echotrain": []}
    loads: list[float] = []
    ours_t, trl_t = Timers(), Timers()
    import echotrain.train.collect as collect_module

    _wrap(collect_module, "generate_rollouts", ours_t, "generation")
    _wrap(ours.collector, "reward_fn", ours_t, "scoring")
    _wrap(ours, "_log_probs", ours_t, "forward")
    _wrap(ours, "_log_probs_batched", ours_t, "old_log_prob")
    _wrap(ours.optimizer, "step", ours_t, "optimizer")

    def report(side: str, k: int, row: dict) -> None:
        records[side].append(row)
        print(f"  {side:9s} step {k}: {row['step']:6.2f} s wall, {row['step/cpu']:6.2f} s cpu (generation "
              f"{row['generation/cpu']:.2f}, update {row['update/cpu']:.2f} cpu-s; length "
              f"{row['response_length']})", flush=True)

    def run_ours(k: int) -> None:
        torch.set_num_threads(args.threads)
        loads.append(os.getloadavg()[0])
        ours_t.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        rec = ours.train_step(k + 1)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        t = ours_t.reset()
        upd, upd_cpu = (wall - t.get("generation", 0.0) - t.get("scoring", 0.0),
                        cpu - t.get("generation/cpu", 0.0) - t.get("scoring/cpu", 0.0))
        report("echotrain", k, _row(t, wall, cpu, upd, upd_cpu, rec["response_length/mean"]))

    class Interleave(TrainerCallback):
        """Times TRL's optimizer steps and runs one echotrain step between them (order alternates)."""

        def on_step_begin(self, a, state, control, **kw):
            k = state.global_step
            if k % 2 == 1:
                run_ours(k)
            torch.set_num_threads(args.threads)
            loads.append(os.getloadavg()[0])
            trl_t.reset()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, a, state, control, **kw):
            self.opt = trl_t.time("optimizer")
            self.opt.__enter__()

        def on_optimizer_step(self, a, state, control, **kw):
            self.opt.__exit__(None, None, None)

        def on_step_end(self, a, state, control, **kw):
            wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            k = state.global_step - 1
            t = trl_t.reset()
            upd, upd_cpu = (wall - t.get("generation", 0.0) - t.get("scoring", 0.0),
                        cpu - t.get("generation/cpu", 0.0) - t.get("scoring/cpu", 0.0))
            lengths = trl._metrics["train"].get("completions/mean_length") or [None]
            report("trl", k, _row(t, wall, cpu, upd, upd_cpu, lengths[-1]))
            if k % 2 == 0:
                run_ours(k)

    trl = build_trl(args, model_trl, tok_trl, task, os.path.join(tmp, "trl"), Interleave(), trl_t)
    print(f"setup {time.perf_counter() - t_load:.1f} s; B={args.prompts} G={args.generations} "
          f"T={args.max_new_tokens} micro={args.micro_batch_size} threads={args.threads} "
          f"loadavg={os.getloadavg()}", flush=True)
    trl.train()

    def summary(side: str) -> dict:
        recs = records[side][args.warmup:]
        keys = [k + sfx for k in PARTS for sfx in ("", "/cpu")]
        out = {k: statistics.median(r[k] for r in recs) for k in keys}
        lens = [r["response_length"] for r in recs if r.get("response_length") is not None]
        out["response_length_mean"] = statistics.mean(lens) if lens else None
        out["steps_wall"] = [round(r["step"], 2) for r in records[side]]
        out["steps_cpu"] = [round(r["step/cpu"], 2) for r in records[side]]
        return out

    res = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "settings": {k: getattr(args, k) for k in vars(args)},
        "versions": _versions(),
        "loadavg_during": {"min": min(loads), "max": max(loads), "mean": statistics.mean(loads)},
        "cpu_count": os.cpu_count(),
        "trl": summary("trl"),
        "echotrain": summary("echotrain"),
    }
    # paired: TRL step k against echotrain step k (adjacent in time, so under the same load)
    pairs = list(zip(records["trl"], records["echotrain"]))[args.warmup:]
    res["paired_ratio_median"] = {sfx or "wall": statistics.median(a["step" + sfx] / b["step" + sfx] for a, b in pairs)
                                  for sfx in ("", "/cpu")}
    res["ratio"] = {}
    for k in ("step", "generation", "update"):
        for sfx in ("", "/cpu"):
            o = res["echotrain"][k + sfx]
            res["ratio"][k + sfx] = res["trl"][k + sfx] / o if o > 0 else None
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


def _versions() -> dict:
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "python": sys.version.split()[0]}


def _print(res: dict) -> None:
    print("\n== one RL step: median seconds over the timed steps, wall clock | process CPU time ==")
    print("update = step - generation - scoring (advantages, old log-probs, forward, backward, optimizer)")
    head = ["step", "generation", "scoring", "update", "old_log_prob", "forward", "backward", "optimizer"]
    print(f"{'':10s} " + " ".join(f"{h:>12s}" for h in head) + f" {'resp len':>9s}")
    for side in ("trl", "echotrain"):
        r = res[side]
        cells = " ".join(f"{r[h]:5.1f}|{r[h + '/cpu']:5.1f} " for h in head)
        L = r["response_length_mean"]
        print(f"{side:10s} {cells} {(L if L is not None else float('nan')):9.1f}")
    q = res["ratio"]
    print(f"TRL / echotrain (> 1: echotrain faster): step {q['step']:.2f}x wall, {q['step/cpu']:.2f}x CPU; "
          f"generation {q['generation/cpu']:.2f}x CPU; update {q['update/cpu']:.2f}x CPU")
    pr = res["paired_ratio_median"]
    print(f"median of the paired per-step ratios (TRL step k / echotrain step k): {pr['wall']:.2f}x wall, "
          f"{pr['/cpu']:.2f}x CPU  (columns are medians of each part; they need not add up)")
    la = res["loadavg_during"]
    print(f"load average (1 min) during the run: {la['min']:.1f} .. {la['max']:.1f} on {res['cpu_count']} CPUs; "
          f"versions {res['versions']}")


if __name__ == "__main__":
    main()
