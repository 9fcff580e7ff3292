"""The RL trainer: orchestration only; every formula comes from :mod:`echotrain.rl`.

One training step, top to bottom (:meth:`Trainer.train_step`), in the spirit of CleanRL's ppo.py:

1. rollout   sample B prompts, G completions each, in one batched ``generate`` call (KV cache)
2. reward    score the completions (task scorer with timeouts); DAPO overlong shaping;
             DAPO dynamic sampling keeps only groups with mixed correctness and refills
3. advantage group-relative advantages (``compute_advantages``)
4. old log-probs of the sampled tokens under the rollout policy (no grad), the reference
   policy's when ``kl_coef > 0``, and the token entropy
5. update    for each PPO epoch, for each mini-batch of whole groups (one optimizer step each):
             [ECHO no-grad pre-pass] -> step-global statistics -> per micro-batch forward,
             ``compute_policy_loss(..., step=stats)`` (+ KL) and ``backward`` -> clip grad norm
             -> optimizer step -> scheduler step. With ``optimizer=sam`` / ``late_sam`` the
             forward/backward passes and the clipping form a closure that SAM calls twice
             (at w and at w + e; Foret et al. 2021), from ``sam_start`` on for late_sam.
6. metrics   one line of metrics.jsonl, sample completions, progress bar, checkpoint

With more than one mini-batch (or epoch) the later optimizer steps are off-policy, which is
where ECHO's batch clip and GSPO's sequence ratio differ from token-level PPO.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from echotrain.optim.sam import SAM
from echotrain.rl import (
    compute_advantages,
    compute_policy_loss,
    compute_step_stats,
    kl_penalty,
    needs_log_prob_prepass,
    overlong_reward_penalty,
    step_agg_loss,
    zero_variance_groups,
)
from echotrain.train.checkpoint import (
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from echotrain.train.config import TrainConfig, save_config
from echotrain.train.dist import WorldSizeMismatch, init_distributed, rank_seed
from echotrain.train.lora import apply_lora, is_lora, load_model_state, model_state, reference_policy, save_final_model
from echotrain.train.metrics import (MetricsLogger, NullLogger, peak_memory_mb, print_summary, read_jsonl,
                                     truncate_jsonl)
from echotrain.train.rollout import (RolloutBatch, concat_rollouts, forward_log_probs, generate_rollouts,
                                     generate_rollouts_per_group, group_seed)

StepCallback = Callable[[int, dict], None]


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda if available else cpu; otherwise ``torch.device(name)``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_run_dir(cfg: TrainConfig) -> str:
    """``runs/<preset>-<UTC timestamp>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.preset.replace('+', '-')}-{stamp}")


def lr_lambda(cfg: TrainConfig, total_updates: int) -> Callable[[int], float]:
    """Multiplier of the peak lr after ``u`` optimizer steps: ``cfg.warmup_steps`` of linear warmup,
    then ``cfg.lr_scheduler`` over the remaining steps (:func:`echotrain.optim.schedules.warmup_decay`)."""
    from echotrain.optim.schedules import warmup_decay

    return lambda u: warmup_decay(u, cfg.warmup_steps, total_updates, cfg.lr_scheduler)


class PromptStream:
    """Reproducible prompts with a resumable position: draw ``d`` is ``task.sample(n, seed_d)``
    with ``seed_d`` derived from the run seed and ``d``; the position is the draw counter."""

    def __init__(self, task: Any, seed: int):
        self.task, self.seed, self.draws = task, seed, 0

    def next(self, n: int) -> list[Any]:
        seed = (self.seed * 1_000_003 + 7919 * self.draws + 1) % (2**31 - 1)
        self.draws += 1
        return list(self.task.sample(n, seed))

    def state_dict(self) -> dict[str, int]:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.draws = int(state["draws"])


class Trainer:
    """Runs :class:`TrainConfig` end to end and writes the run directory.

    Args:
        cfg: a validated config (see :func:`echotrain.train.config.resolve_config`).
        model, tokenizer: the policy; loaded with ``echotrain.models.load_policy(cfg.model)`` if None.
        task: loaded with ``echotrain.tasks.get_task(cfg.task, **cfg.task_options)`` if None.
        reward_fn: ``reward_fn(completions, examples) -> (rewards (N,), info)`` with ``info["correct"]``;
            default ``echotrain.rewards.RewardFunction(task)``.
        resume: continue from the run directory's latest checkpoint (model, optimizer, scheduler,
            RNG states, data position); metrics lines after it are dropped and recomputed.
        callbacks: ``fn(step, record)`` called after each step's metrics are written (before its
            checkpoint); tests use one to simulate a kill.
        eval_task: task for the start/end greedy evaluation (``cfg.eval_prompts``); default:
            ``task.eval_task()`` when the task has one (its held-out split), else the task built
            with ``seed + 1`` when it takes a seed, else the training task.

    Raises:
        FileNotFoundError: ``resume`` without a checkpoint in the run directory.
        echotrain.train.dist.WorldSizeMismatch: ``resume`` of a checkpoint written by another
            number of processes.
    """

    def __init__(self, cfg: TrainConfig, *, model: Any = None, tokenizer: Any = None, task: Any = None,
                 reward_fn: Any = None, resume: bool = False, callbacks: Sequence[StepCallback] = (),
                 eval_task: Any = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        # data parallelism (torchrun): rank, world size, sharding and collectives (train/dist.py)
        self.dist = init_distributed(cfg.dist_backend, self.device)
        if self.dist.enabled and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.run_dir = Path(self.dist.broadcast(str(cfg.output_dir or default_run_dir(cfg))))
        self.callbacks = list(callbacks)
        seed_everything(cfg.seed)
        dtype = getattr(torch, cfg.dtype)
        if model is None or tokenizer is None:
            from echotrain.models import load_policy

            model, tokenizer = load_policy(cfg.model, dtype=dtype, device=str(self.device))
        self.model = model.to(self.device)
        if cfg.lora_r > 0:
            self.model = apply_lora(self.model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                    target_modules=cfg.lora_target_modules)
        self.dist.broadcast_params(self.model)  # every rank starts from rank 0's weights (and adapters)
        # no dropout: the ECHO pre-pass and the with-grad pass must see the same function
        self.model.eval()
        if cfg.gradient_checkpointing:
            from echotrain.train.features import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.model)
        if cfg.chat_template:
            from echotrain.train.features import read_chat_template

            tokenizer.chat_template = read_chat_template(cfg.chat_template)
        self.tokenizer = tokenizer
        if task is None:
            from echotrain.tasks import get_task

            task = get_task(cfg.task, **cfg.task_options)
        if eval_task is None and cfg.eval_prompts > 0 and callable(getattr(task, "eval_task", None)):
            eval_task = task.eval_task()  # the task's own held-out split (e.g. the testbed task)
        if eval_task is None and cfg.eval_prompts > 0:
            eval_task = task
            if "seed" in getattr(task, "__dict__", {}):  # other questions than the training ones
                from echotrain.tasks import get_task

                try:
                    eval_task = get_task(cfg.task, **{**cfg.task_options, "seed": int(task.seed) + 1})
                except (KeyError, TypeError, ValueError):
                    eval_task = task
        self.task, self.eval_task = task, eval_task
        if reward_fn is None:
            from echotrain.rewards import RewardFunction

            if cfg.reward:
                from echotrain.rewards.custom import CustomRewardTask, load_reward

                reward_fn = RewardFunction(CustomRewardTask(task, load_reward(cfg.reward)))
            else:
                reward_fn = RewardFunction(task)
        self.reward_fn = reward_fn
        self.ref_model = None
        if cfg.kl_coef > 0 and not is_lora(self.model):  # LoRA: the reference is the model with adapters off
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.total_updates = cfg.steps * cfg.num_mini_batches * cfg.ppo_epochs
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_updates))
        self.prompts = PromptStream(task, cfg.seed)
        self.loss_config = cfg.policy_loss_config()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.start_step = 0
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist.barrier()
        if cfg.rollout_rng == "stream" and self.dist.rank > 0:  # each rank samples its own stream
            seed_everything(rank_seed(cfg.seed, self.dist.rank))
        if resume:
            self._resume()
        self.logger: Any = NullLogger()
        if self.dist.is_main:  # rank 0 alone writes the run directory
            # the run directory actually used, so the saved config reruns / resumes into it
            save_config(dataclasses.replace(cfg, output_dir=str(self.run_dir)), self.run_dir / "config.yaml")
            self._write_run_info()
            self.logger = MetricsLogger(self.run_dir, report_to=cfg.report_to, project=cfg.wandb_project,
                                        config=cfg.to_dict())

    def _write_run_info(self) -> None:
        """``run_info.json``: what ``auto`` / ``0`` / empty config values resolved to in this run
        (device, threads, model, task) and the library versions, for reproducing it."""
        import platform

        import transformers

        import echotrain

        info = {
            "run_dir": str(self.run_dir),
            "device": str(self.device),
            "torch_num_threads": torch.get_num_threads(),
            "model": self.cfg.model or "smollm2-135m-instruct (embedded default)",
            "model_class": type(self.model).__name__,
            "task": self.cfg.task,
            "task_class": type(self.task).__name__,
            "world_size": self.dist.world_size,
            "dist_backend": self.dist.backend,
            "lora": is_lora(self.model),
            "versions": {"echotrain": echotrain.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()},
        }
        tmp = self.run_dir / "run_info.json.tmp"
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "run_info.json")

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """``cfg.optimizer`` on the trainable parameters, from its registry entry (which settings it
        takes, whether it wraps ``cfg.sam_base``: SAM, Foret et al. 2021; late-phase SAM from
        ``sam_start`` x the run's optimizer steps, Zhou et al. ICLR 2025, arXiv 2410.10373)."""
        from echotrain.optim.registry import build_from_settings

        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        settings = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        eps=cfg.adam_eps, rho=cfg.sam_rho, model=self.model, sam_start=cfg.sam_start,
                        sam_start_unit="fraction", total_steps=self.total_updates,
                        restart_momentum=cfg.sam_restart_momentum)
        return build_from_settings(cfg.optimizer, params, settings, base=cfg.sam_base)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        path, damaged = latest_valid_checkpoint(self.run_dir)
        if path is None:
            extra = f"; damaged: {', '.join(map(str, damaged))}" if damaged else ""
            raise FileNotFoundError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}{extra}")
        state = load_checkpoint(path, map_location=self.device)
        saved_world = int(state.get("extra", {}).get("world_size", 1))
        if saved_world != self.dist.world_size:
            raise WorldSizeMismatch(
                f"--resume: {path} was written by a run of {saved_world} process(es) and this run has "
                f"{self.dist.world_size}; resume with the same number (torchrun --nproc_per_node {saved_world}): "
                "each rank's RNG stream is part of the checkpoint, so another world size cannot continue it exactly")
        load_model_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["data"])
        rngs = state.get("extra", {}).get("rng_ranks")
        set_rng_state(rngs[self.dist.rank] if rngs else state["rng"])
        self.start_step = int(state["step"])
        if not self.dist.is_main:
            return
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.start_step)
        truncate_jsonl(self.run_dir / "samples.jsonl", self.start_step)
        truncate_jsonl(self.run_dir / "eval.jsonl", self.start_step)

    # ------------------------------------------------------------------ 1-2. rollout and reward
    def _rollout_round(self, group_offset: int) -> tuple[RolloutBatch, list[Any], list[str], torch.Tensor, dict]:
        cfg = self.cfg
        draw = self.prompts.draws
        examples = self.prompts.next(cfg.prompts_per_step)
        mine = self.dist.shard(len(examples))  # this rank's whole prompt groups (all of them in one process)
        local = [examples[i] for i in mine]
        rows = [ex for ex in examples for _ in range(cfg.num_generations)]
        part = None
        if local:
            t0 = time.perf_counter()
            sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, batch_size=cfg.rollout_batch_size)
            if cfg.rollout_rng == "group":
                batch = generate_rollouts_per_group(
                    self.model, self.tokenizer, [ex.messages for ex in local], cfg.num_generations,
                    seeds=[group_seed(cfg.seed, draw, g) for g in mine], group_offset=group_offset + mine.start,
                    pad_token_id=self.pad_id, **sampling)
            else:
                batch = generate_rollouts(self.model, self.tokenizer, [ex.messages for ex in local],
                                          cfg.num_generations, group_offset=group_offset + mine.start, **sampling)
            self._t_gen += time.perf_counter() - t0
            t0 = time.perf_counter()
            texts = [self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                     for ids, mask in zip(batch.response_ids, batch.response_mask)]
            local_rows = [ex for ex in local for _ in range(cfg.num_generations)]
            rewards, info = self.reward_fn(texts, local_rows)
            self._t_score += time.perf_counter() - t0
            part = (batch, texts, rewards.float(), {k: info[k] for k in ("correct", "format_ok") if k in info},
                    (int(info.get("n_timeouts", 0)), int(info.get("n_exceptions", 0))))
        if not self.dist.enabled:
            self._n_reward_timeouts += part[4][0]
            self._n_reward_exceptions += part[4][1]
        if not self.dist.enabled:
            return part[0], rows, part[1], part[2], part[3]
        # every rank gets the whole round (as one process would have it): rank order = group order
        parts = [p for p in self.dist.gather(part) if p is not None]
        self._n_reward_timeouts += sum(p[4][0] for p in parts)  # every rank's, so rank 0 logs them all
        self._n_reward_exceptions += sum(p[4][1] for p in parts)
        batch = concat_rollouts([p[0] for p in parts], self.pad_id)
        texts = [t for p in parts for t in p[1]]
        info = {k: torch.cat([torch.as_tensor(p[3][k]) for p in parts]) for k in parts[0][3]}
        return batch, rows, texts, torch.cat([p[2] for p in parts]), info

    def collect(self) -> dict[str, Any]:
        """Steps 1-2: rollouts and rewards for one step, with DAPO dynamic sampling if enabled.

        Returns a dict with the kept ``batch`` (RolloutBatch with dense group ids), ``rewards``,
        ``correct``, ``format_ok``, ``examples``, ``texts`` and sampling statistics.
        """
        cfg = self.cfg
        parts, rounds, n_seen, n_zero = [], 0, 0, 0
        kept_groups = 0
        while True:
            batch, rows, texts, rewards, info = self._rollout_round(group_offset=rounds * cfg.prompts_per_step)
            rounds += 1
            correct = torch.as_tensor(info["correct"], dtype=torch.float32)
            fmt = torch.as_tensor(info.get("format_ok", torch.zeros(len(rows), dtype=torch.bool)), dtype=torch.bool)
            keep = torch.ones(len(rows), dtype=torch.bool)
            zv = zero_variance_groups(correct, batch.group_index)
            n_seen += cfg.prompts_per_step
            n_zero += int(zv.view(-1, cfg.num_generations)[:, 0].sum())
            if cfg.dynamic_sampling:
                keep = ~zv
                room = (cfg.prompts_per_step - kept_groups) * cfg.num_generations
                keep &= torch.cumsum(keep.long(), 0) <= room
            idx = keep.nonzero().squeeze(-1)
            if len(idx):
                parts.append((batch.select(idx), rewards[idx], correct[idx], fmt[idx],
                              [rows[i] for i in idx.tolist()], [texts[i] for i in idx.tolist()]))
                kept_groups += len(idx) // cfg.num_generations
            if not cfg.dynamic_sampling or kept_groups >= cfg.prompts_per_step or rounds >= cfg.max_sampling_rounds:
                break
        if not parts:  # nothing informative after max_sampling_rounds: keep the last round (A = 0)
            parts.append((batch, rewards, correct, fmt, rows, texts))
        kept = concat_rollouts([p[0] for p in parts], self.pad_id)
        # dense group ids 0..n_groups-1 (stepwise needs small ids identifying groups in the step)
        _, kept.group_index = torch.unique(kept.group_index, return_inverse=True)
        return {
            "batch": kept,
            "rewards": torch.cat([p[1] for p in parts]),
            "correct": torch.cat([p[2] for p in parts]),
            "format_ok": torch.cat([p[3] for p in parts]),
            "examples": [e for p in parts for e in p[4]],
            "texts": [t for p in parts for t in p[5]],
            "rounds": rounds,
            "zero_variance_frac": n_zero / max(1, n_seen),
        }

    # ------------------------------------------------------------------ 4. log-probs
    def _log_probs(self, model: Any, batch: RolloutBatch, with_entropy: bool = False,
                   grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if grad and self.cfg.gradient_checkpointing:
            from echotrain.train.features import checkpointed_forward

            with torch.set_grad_enabled(True), checkpointed_forward(model):
                return forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                         batch.response_mask, temperature=self.cfg.temperature,
                                         with_entropy=with_entropy, share_prefix=False)  # no KV cache under checkpointing
        with torch.set_grad_enabled(grad):
            return forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                     batch.response_mask, temperature=self.cfg.temperature, with_entropy=with_entropy,
                                     share_prefix=self.cfg.share_prompt_prefix)

    @torch.no_grad()
    def _log_probs_batched(self, model: Any, batch: RolloutBatch,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad log-probs (and entropy) of all rows, in micro-batches; (N, T) float32 on CPU.

        With several processes each rank computes its contiguous share of the rows and all
        ranks receive all of them."""
        lps, ents = [], []
        mine = self.dist.shard(len(batch))
        for idx in torch.arange(mine.start, mine.stop).split(self.cfg.micro_batch_size):
            if not len(idx):  # this rank has no rows (fewer groups than processes)
                continue
            lp, ent = self._log_probs(model, batch.select(idx), with_entropy=with_entropy)
            lps.append(lp.cpu())
            if ent is not None:
                ents.append(ent.cpu())
        if self.dist.enabled:
            parts = self.dist.gather((lps, ents))
            lps, ents = [t for p in parts for t in p[0]], [t for p in parts for t in p[1]]
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)

    def _ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference-policy log-probs for the KL term (None when ``kl_coef`` is 0): the initial
        model's copy, or with LoRA the same model with its adapters disabled."""
        if self.cfg.kl_coef <= 0:
            return None
        if self.ref_model is not None:
            return self._log_probs_batched(self.ref_model, batch)[0]
        with reference_policy(self.model) as ref:
            return self._log_probs_batched(ref, batch)[0]

    # ------------------------------------------------------------------ 5. one optimizer step
    def update_mini_batch(self, data: dict[str, Any], rows: torch.Tensor, on_policy: bool = False,
                          fill_old: bool = False) -> dict[str, float]:
        """One optimizer step on the sequences ``rows`` of the step's data, exactly micro-batched.

        ``on_policy``: no optimizer step has happened since the old log-probs were computed (the
        first mini-batch of the first epoch), so the ECHO pre-pass is the old log-probs themselves.
        ``fill_old`` (on-policy only, ``reuse_on_policy_log_probs``): ``data["old_log_prob"]`` and
        ``data["entropy"]`` of ``rows`` are not computed yet; the with-grad forward supplies them
        (detached), and the step statistics use ratio 1 (old = current = 0 placeholders).

        Returns this optimizer step's metrics (token-weighted over micro-batches). With SAM the
        forward/backward passes run twice (closure at w and at w + e) and the metrics are those
        of the first pass; the step statistics (ECHO's R, BA's group counts) stay those at w.
        """
        cfg = self.cfg
        batch: RolloutBatch = data["batch"].select(rows)
        _, batch.group_index = torch.unique(batch.group_index, return_inverse=True)
        if self.dist.enabled:  # this rank's whole groups of the mini-batch (step-wide group ids kept)
            mine = self.dist.shard(int(batch.group_index.max()) + 1 if len(batch) else 0)
            local = ((batch.group_index >= mine.start) & (batch.group_index < mine.stop)).nonzero().squeeze(-1)
            rows, batch = rows[local], batch.select(local)
        mbs = []
        for idx in torch.arange(len(rows)).split(cfg.micro_batch_size):
            if not len(idx):  # no rows on this rank in this mini-batch: it still joins the collectives
                continue
            r = rows[idx]
            mbs.append({
                "r": r,
                "rows": batch.select(idx),
                "old_log_prob": data["old_log_prob"][r],
                "advantages": data["advantages"][r],
                "response_mask": data["response_mask"][r],
                "group_index": batch.group_index[idx],
                "ref_log_prob": data["ref_log_prob"][r] if data["ref_log_prob"] is not None else None,
            })
        if fill_old and not on_policy:
            raise ValueError("fill_old needs an on-policy update")
        if needs_log_prob_prepass(cfg.loss_mode, self.loss_config):
            with torch.no_grad():
                for mb in mbs:
                    # same parameters as the old-log-prob pass: reuse it (saves one forward)
                    mb["log_prob"] = (mb["old_log_prob"].clone() if on_policy
                                      else self._log_probs(self.model, mb["rows"])[0].cpu())
        stat_mbs = [{k: v for k, v in mb.items() if k not in ("r", "rows", "ref_log_prob")} for mb in mbs]
        # all-reduced over ranks when torch.distributed is initialised; dp_size=1 because
        # dist.all_reduce_grads sums the ranks' gradients (each rank's loss is its share of the step's)
        stats = compute_step_stats(stat_mbs, loss_mode=cfg.loss_mode, loss_agg_mode=cfg.loss_agg_mode,
                                   config=self.loss_config, dp_size=1)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        first: dict[str, float] = {}

        def closure() -> torch.Tensor:
            """Forward + backward over all micro-batches, then clip; metrics of the first call."""
            sums: dict[str, float] = {}
            weight = 0.0
            batch_metrics: dict[str, float] = {}
            total = torch.zeros(())
            for mb in mbs:
                log_prob, ent = self._log_probs(self.model, mb["rows"], grad=True, with_entropy=fill_old)
                if fill_old:  # on-policy: the old log-probs are these, and no update has happened yet
                    mb["old_log_prob"] = log_prob.detach().cpu()
                    data["old_log_prob"][mb["r"]] = mb["old_log_prob"]
                    data["entropy"][mb["r"]] = ent.cpu()
                mask = mb["response_mask"].to(log_prob.device)
                advantages, group_index = mb["advantages"].to(log_prob.device), mb["group_index"].to(log_prob.device)
                loss, m = compute_policy_loss(
                    cfg.loss_mode, mb["old_log_prob"].to(log_prob.device), log_prob, advantages,
                    mask, cfg.loss_agg_mode, self.loss_config, group_index=group_index, step=stats)
                if mb["ref_log_prob"] is not None:  # kl_coef > 0 (a reference copy, or LoRA adapters off)
                    kl_mat = kl_penalty(log_prob, mb["ref_log_prob"].to(log_prob.device), cfg.kl_penalty)
                    # aggregated exactly like the policy loss, with the step's normalisers
                    kl_loss = step_agg_loss(kl_mat, mask, stats, self.loss_config, advantages=advantages,
                                            group_index=group_index)
                    loss = loss + cfg.kl_coef * kl_loss
                    kl_mean = torch.where(mask.bool(), kl_mat.detach(), 0).sum() / mask.sum().clamp(min=1)
                    m = dict(m, **{"kl/ref": float(kl_mean)})
                loss.backward()
                total += loss.detach().float().cpu()
                n_tok = float(mask.sum())
                for k, v in m.items():
                    if k.startswith("echo/"):
                        batch_metrics[k] = float(v)
                    else:
                        sums[k] = sums.get(k, 0.0) + float(v) * n_tok
                weight += n_tok
            self.dist.all_reduce_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if not first:  # SAM calls this twice; the metrics are those at w, not at w + e
                if self.dist.enabled:  # token-weighted over the whole step, as in one process
                    parts = self.dist.gather((sums, weight, batch_metrics))
                    sums, weight = {}, sum(p[1] for p in parts)
                    for p in parts:
                        for k, v in p[0].items():
                            sums[k] = sums.get(k, 0.0) + v
                        batch_metrics = batch_metrics or p[2]
                first.update({k: v / weight for k, v in sums.items()} if weight > 0 else {k: 0.0 for k in sums})
                first.update(batch_metrics)
                first["grad_norm"] = float(grad_norm)
            return total

        out = {"lr": self.scheduler.get_last_lr()[0]}
        if isinstance(self.optimizer, SAM):  # SAM and LateSAM: step() zeroes the grads and calls the closure
            # 1 if this update is a SAM step (always for sam; from sam_start on for late_sam)
            out["sam/active"] = float(getattr(self.optimizer, "sam_active", lambda: True)())
            self.optimizer.step(closure)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            closure()
            self.optimizer.step()
        self.scheduler.step()
        return {**first, **out}

    # ------------------------------------------------------------------ one training step
    def train_step(self, step: int) -> dict[str, Any]:
        """Run training step ``step`` (1-based) and return its metrics record."""
        cfg = self.cfg
        t_start, cpu_start = time.perf_counter(), time.process_time()
        self._t_gen = self._t_score = 0.0
        self._n_reward_timeouts = self._n_reward_exceptions = 0

        # 1-2. rollout, reward (+ DAPO dynamic sampling)
        data = self.collect()
        batch: RolloutBatch = data["batch"]
        rewards = data["rewards"]
        if cfg.overlong_buffer > 0:
            rewards = rewards + cfg.overlong_penalty_factor * overlong_reward_penalty(
                batch.response_length, cfg.max_new_tokens, cfg.overlong_buffer)
        response_mask = batch.response_mask.clone()
        if cfg.overlong_filtering:
            response_mask = response_mask * (~batch.truncated).float().unsqueeze(-1)
        t_update = time.perf_counter()

        # 3. advantages (one scalar per response, broadcast over its tokens)
        adv = compute_advantages(rewards, batch.group_index, adv_estimator=cfg.adv_estimator)
        advantages = adv.unsqueeze(-1) * response_mask

        # the mini-batches of whole groups, per PPO epoch (rank 0 draws the split; every rank uses it)
        n_groups = int(batch.group_index.max()) + 1
        splits = []
        for _epoch in range(cfg.ppo_epochs):
            group_perm = self.dist.broadcast(torch.randperm(n_groups) if self.dist.is_main else None)
            splits += [torch.isin(batch.group_index, groups).nonzero().squeeze(-1)
                       for groups in group_perm.tensor_split(min(cfg.num_mini_batches, n_groups))]

        # 4. old log-probs (rollout policy), reference log-probs, entropy; the first update's own
        # rows can take theirs from its with-grad forward (nothing has changed the policy yet)
        reuse = cfg.reuse_on_policy_log_probs and not self.dist.enabled and not isinstance(self.optimizer, SAM)
        if reuse and len(splits[0]) < len(batch):
            rest = torch.ones(len(batch), dtype=torch.bool)
            rest[splits[0]] = False
            rest = rest.nonzero().squeeze(-1)
            lp_rest, ent_rest = self._log_probs_batched(self.model, batch.select(rest), with_entropy=True)
            old_log_prob = torch.zeros(len(batch), lp_rest.shape[1], dtype=lp_rest.dtype)
            entropy = torch.zeros_like(old_log_prob)
            old_log_prob[rest], entropy[rest] = lp_rest, ent_rest
        elif reuse:
            old_log_prob = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
            entropy = torch.zeros_like(old_log_prob)
        else:
            old_log_prob, entropy = self._log_probs_batched(self.model, batch, with_entropy=True)
        ref_log_prob = self._ref_log_probs(batch)
        data.update(old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask,
                    ref_log_prob=ref_log_prob, entropy=entropy)

        # 5. update: one optimizer step per mini-batch
        updates = []
        for rows in splits:
            updates.append(self.update_mini_batch(data, rows, on_policy=not updates, fill_old=reuse and not updates))
        t_update = time.perf_counter() - t_update

        # 6. metrics
        lengths = batch.response_length
        valid = batch.response_mask.bool()
        n_tokens = float(batch.response_mask.sum())
        step_time = time.perf_counter() - t_start
        record: dict[str, Any] = {
            "step": step,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "accuracy": float(data["correct"].mean()),
            "format_rate": float(data["format_ok"].float().mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "truncated_frac": float(batch.truncated.float().mean()),
            "entropy": float(entropy[valid].mean()) if valid.any() else 0.0,
            "advantages/abs_mean": float(adv.abs().mean()),
            "groups/kept": n_groups,
            "groups/zero_variance_frac": data["zero_variance_frac"],
            "sampling_rounds": data["rounds"],
            "optimizer_steps": len(updates),
            "reward/timeouts": self._n_reward_timeouts,
            "reward/exceptions": self._n_reward_exceptions,
        }
        keys = sorted({k for u in updates for k in u})
        for k in keys:
            vals = [u[k] for u in updates if k in u]
            record[k] = sum(vals) / len(vals)
        if updates and "echo/R_batch" in keys:
            rs = [u["echo/R_batch"] for u in updates if "echo/R_batch" in u]
            record["echo/R_batch_min"], record["echo/R_batch_max"] = min(rs), max(rs)
        record["lr"] = updates[-1]["lr"] if updates else self.scheduler.get_last_lr()[0]
        record.update({
            "time/generation": self._t_gen,
            "time/scoring": self._t_score,
            "time/update": t_update,
            "time/step": step_time,
            "time/step_cpu": time.process_time() - cpu_start,
            "throughput/tokens_per_s": n_tokens / max(step_time, 1e-9),
            "memory/peak_mb": peak_memory_mb(self.device),
        })
        from echotrain.train.features import spread_sample_rows

        rows = spread_sample_rows(batch.group_index, cfg.log_samples)
        self._samples = [
            {"step": step, "question": getattr(data["examples"][i], "question", None),
             "answer": getattr(data["examples"][i], "answer", None), "group": int(batch.group_index[i]),
             "completion": data["texts"][i], "reward": float(rewards[i]), "correct": float(data["correct"][i])}
            for i in rows
        ]
        return record

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy accuracy on ``cfg.eval_prompts`` fixed prompts; appended to eval.jsonl.

        Runs under a forked RNG, so enabling it does not change the training run."""
        from echotrain.train.evaluate import evaluate

        cfg = self.cfg
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            res = evaluate(self.model, self.tokenizer, self.eval_task, num_prompts=cfg.eval_prompts, n=1, ks=(1,),
                           max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed + 7,
                           batch_prompts=max(cfg.prompts_per_step * cfg.num_generations, 1))
        out = {"eval/accuracy": res["accuracy"], "eval/format_rate": res["format_rate"]}
        self.logger.log_eval({"step": step, **out, "eval/prompts": cfg.eval_prompts,
                              "time/eval": time.perf_counter() - t0})
        return out

    # ------------------------------------------------------------------ the loop
    def save(self, step: int) -> Path:
        """Checkpoint after ``step`` (atomic, keep-last-k), written by rank 0 with every rank's RNG
        state. With LoRA the model part is the adapters only. Returns the path (on every rank)."""
        from echotrain.train.checkpoint import rng_state

        rngs = self.dist.gather(rng_state())
        path = self.run_dir / "checkpoints" / f"step_{step:08d}.pt"
        if self.dist.is_main:
            extra = {"world_size": self.dist.world_size, "rng_ranks": rngs if self.dist.enabled else None}
            path = save_checkpoint(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                   scheduler=self.scheduler, data_state=self.prompts.state_dict(),
                                   keep_last=self.cfg.keep_last, extra=extra, model_state=model_state(self.model))
        self.dist.barrier()
        return path

    def train(self) -> list[dict[str, Any]]:
        """Run steps ``start_step+1 .. cfg.steps``; returns all metrics records of the run."""
        cfg = self.cfg
        t0 = time.perf_counter()
        bar = None
        main = self.dist.is_main
        if cfg.progress and main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc=f"echotrain {cfg.preset}", unit="step",
                       dynamic_ncols=True)
        try:
            if cfg.eval_prompts and self.start_step == 0 and main:
                self.evaluate(0)
            for step in range(self.start_step + 1, cfg.steps + 1):
                record = self.train_step(step)
                if main and cfg.eval_prompts and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                    record.update(self.evaluate(step))
                self.logger.log(record)
                self.logger.log_samples(self._samples)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{record['reward/mean']:.3f}", acc=f"{record['accuracy']:.3f}",
                                    len=f"{record['response_length/mean']:.0f}")
                for cb in self.callbacks:
                    cb(step, record)
                if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                    self.save(step)
                    if cfg.plots and step != cfg.steps and main:
                        self.write_plots()
        finally:
            if bar is not None:
                bar.close()
            self.logger.close()
        self.dist.barrier()
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        if not main:
            return records
        stability = self.write_stability(records)
        if cfg.plots:
            self.write_plots(records)
        if cfg.save_final_model and hasattr(self.model, "save_pretrained"):
            save_final_model(self.model, self.run_dir / "final_model", merged=cfg.lora_merge_final)
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(self.run_dir / "final_model")
        self.train_seconds = time.perf_counter() - t0
        if cfg.progress:
            print_summary(records, self.run_dir, self.train_seconds, evals=read_jsonl(self.run_dir / "eval.jsonl"),
                          steps_run=(self.start_step + 1, cfg.steps), stability=stability)
        return records

    def write_stability(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``stability.json``: the run's stability flags (:func:`echotrain.train.stability.stability_flags`)."""
        from echotrain.train.stability import stability_flags

        result = stability_flags(records)
        tmp = self.run_dir / "stability.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "stability.json")
        return result

    def write_plots(self, records: list[dict[str, Any]] | None = None) -> list[Path]:
        from echotrain.train.plots import plot_metrics

        records = read_jsonl(self.run_dir / "metrics.jsonl") if records is None else records
        return plot_metrics(records, self.run_dir / "plots", evals=read_jsonl(self.run_dir / "eval.jsonl"),
                            title=f"{self.run_dir} ({self.cfg.preset}, seed {self.cfg.seed})")
