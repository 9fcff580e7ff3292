"""The RL trainer: orchestration only; every formula comes from :mod:`echotrain.rl`.

One training step (:meth:`Trainer.train_step`) reads top to bottom, in the spirit of CleanRL's ppo.py:

1. collect   B prompts x G completions per round, each round scored (``train/collect.py``);
             DAPO dynamic sampling keeps only groups with mixed correctness and refills
2. score     DAPO overlong reward shaping; overlong filtering of the loss mask
3. advantage group-relative or token-level advantages (``compute_token_advantages``)
4. old log-probs of the sampled tokens under the learner's current weights (no grad; the
   rollout policy itself unless ``staleness > 0``; the first mini-batch's from its own forward,
   the others' the sampler's own when it ran these weights in float32), the token entropy, and
   the reference policy's when ``kl_coef > 0``
5. update    one optimizer step per mini-batch of whole groups, exactly micro-batched
             (``train/update.py``: ECHO pre-pass, step statistics, SAM closure)
6. metrics   one line of metrics.jsonl (``train/metrics.py``), samples, progress bar, checkpoint
             (and a one-time warning when the first steps had no learning signal: ``train/no_signal.py``)

The step's data travels as one :class:`echotrain.train.step.StepData`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from echotrain.optim.sam import SAM
from echotrain.rl import compute_token_advantages, overlong_reward_penalty, truncated_response_mask
from echotrain.rl.advantages import ADV_NEEDS_PI_STATS
from echotrain.rl.entropy import adaptive_entropy_coef, applied_entropy_coef, high_entropy_mask
from echotrain.rl.objectives import loss_step_stats
from echotrain.train.checkpoint import CheckpointWriter, resume_from, seed_everything
from echotrain.train.collect import Collector, PromptStream, default_reward_fn
from echotrain.train.config import TrainConfig, save_config
from echotrain.train.config.preset_report import preset_label
from echotrain.train.dist import init_distributed, rank_seed
from echotrain.train.lag import LaggedRollouts
from echotrain.train.run_lock import lock_run_dir
from echotrain.train.features import prepare_policy
from echotrain.runtime.lora import is_lora, model_state, reference_policy, save_final_model
from echotrain.train.no_signal import ALL_ZERO_VARIANCE, NoSignalWatch, all_zero_variance
from echotrain.runtime.device import resolve_device, resolve_device_why, rng_devices  # noqa: F401  (resolve_device re-exported)
from echotrain.runtime.precision import autocast, resolve_for_why, setting_name
from echotrain.train.metrics import (MetricsLogger, NullLogger, print_summary, read_jsonl, run_info, sample_rows,
                                     step_record, write_json_atomic)
from echotrain.runtime.rollout import RolloutBatch
from echotrain.train.best import BEST_DIR, BestTracker
from echotrain.train.stability import stability_flags
from echotrain.rl.correction import parse_rollout_correction, rollout_mismatch_metrics
from echotrain.train.step import StepData
from echotrain.train.task_metrics import step_metrics_fn, task_step_metrics
from echotrain.train.warmup import warmup_reruns_on_resume
from echotrain.train.utilisation import build_meter
from echotrain.train.async_rollouts import RolloutWorkerError
from echotrain.runtime.episodes import TemplateError
from echotrain.train.update import (batched_log_probs, mini_batch_splits, old_log_probs, policy_log_probs,
                                    sampler_is_learner, update_mini_batch)

StepCallback = Callable[[int, dict], None]


def default_run_dir(cfg: TrainConfig) -> str:
    """``runs/<preset>-<UTC timestamp>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{cfg.preset.replace('+', '-')}-{stamp}")


def lr_lambda(cfg: TrainConfig, total_updates: int) -> Callable[[int], float]:
    """Multiplier of the peak lr after ``u`` optimizer steps: ``cfg.warmup_steps`` of linear warmup,
    then ``cfg.lr_scheduler`` over the remaining steps (:func:`echotrain.optim.schedules.warmup_decay`)."""
    from echotrain.optim.schedules import warmup_decay

    return lambda u: warmup_decay(u, cfg.warmup_steps, total_updates, cfg.lr_scheduler)


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
        eval_task: task for the fixed-prompt evaluations (``cfg.eval_prompts``; greedy unless ``eval_temperature``); default:
            ``task.eval_task()`` when the task has one (its held-out split), else the task built
            with ``seed + 1`` when it takes a seed, else the training task.

    Raises:
        FileNotFoundError: ``resume`` without a checkpoint in the run directory.
        echotrain.train.dist.WorldSizeMismatch: ``resume`` of a checkpoint written by another
            number of processes.
    """

    def __init__(self, cfg: TrainConfig, **kwargs: Any):
        self._run_lock = None
        try:
            self._init(cfg, **kwargs)
        except BaseException:  # a failed setup (a resume, a warm-up) leaves the run directory to the next writer
            if self._run_lock is not None:
                self._run_lock.release()
            raise

    def _init(self, cfg: TrainConfig, *, model: Any = None, tokenizer: Any = None, task: Any = None,
              reward_fn: Any = None, resume: bool = False, callbacks: Sequence[StepCallback] = (),
              eval_task: Any = None) -> None:
        self.cfg = cfg
        #: the run's device and why (runtime/device.py: ``auto`` = cuda when usable): the startup line,
        #: run_info.json's device_reason
        self.device, self.device_reason = resolve_device_why(cfg.device)
        # data parallelism (torchrun): rank, world size, sharding and collectives (train/dist.py)
        self.dist = init_distributed(cfg.dist_backend, self.device)
        if self.dist.enabled and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", self.dist.local_rank)
            self.device_reason += f", LOCAL_RANK={self.dist.local_rank} under torchrun"
        self.run_dir = Path(self.dist.broadcast(str(cfg.output_dir or default_run_dir(cfg))))
        #: rank 0's hold on the run directory (train/run_lock.py): a second writer is refused before
        #: a model loads; released when train() returns
        self._run_lock = lock_run_dir(self.run_dir) if self.dist.is_main else None
        self.callbacks = list(callbacks)
        seed_everything(cfg.seed)
        dtype = getattr(torch, cfg.dtype)
        if model is None or tokenizer is None:
            from echotrain.models import load_policy

            model, tokenizer = load_policy(cfg.model, dtype=dtype, device=str(self.device))
        self.model, self.tokenizer = prepare_policy(model, tokenizer, cfg, self.device, self.dist)
        #: bfloat16 for the model's forward passes under ``autocast`` (runtime/precision.py), else
        #: None; and why (the startup line, run_info.json's autocast_reason)
        self.autocast_dtype, self.autocast_reason = resolve_for_why(self.model, cfg.autocast)
        #: counts each step's FLOPs / decode bytes against the machine's peaks (train/utilisation.py);
        #: None when the model's shape is unknown or the peaks are off (run_info.json says why)
        #: the sampler runs the learner's weights in the learner's precision, so its rollout_log_prob are
        #: the old log-probs up to float rounding (reuse_sampler_log_probs)
        self.sampler_is_learner = sampler_is_learner(cfg, self.autocast_dtype, next(self.model.parameters()).dtype)
        self.utilisation, roofline_info = build_meter(self.model, self.autocast_dtype, self.device,
                                                      is_main=self.dist.is_main)
        if task is None:
            from echotrain.tasks import get_task

            task = get_task(cfg.task, **cfg.task_options)
        if eval_task is None and cfg.eval_prompts > 0:
            from echotrain.train.evaluate import default_eval_task

            eval_task = default_eval_task(task, cfg.task, cfg.task_options)
        self.task, self.eval_task = task, eval_task
        reward_fn = default_reward_fn(task, cfg.reward) if reward_fn is None else reward_fn
        #: the task's (or reward function's) step_metrics, or None (train/task_metrics.py)
        self.step_metrics = step_metrics_fn(task, reward_fn)
        #: the supervised warm-up on the environment's or sft_data's demonstrations (sft_steps; train/warmup.py),
        #: or None. A resumed run loads the warmed-up weights from its checkpoint, so the warm-up runs again only
        #: to rebuild a KL reference (the warmed-up policy; deterministic given the seed and, with sft_data, the
        #: file: a file changed since is refused)
        self.warmup = None
        needs_reference = cfg.kl_coef > 0 and not is_lora(self.model)  # LoRA: the reference is the model with adapters off
        if cfg.sft_steps and (not resume or warmup_reruns_on_resume(cfg, lora=is_lora(self.model))):
            self.warmup = self._warm_up(task, resume)
        #: on-policy distillation's teacher (train/distill.py), or None
        self.teacher = None
        if cfg.teacher:
            from echotrain.train.distill import Teacher

            self.teacher = Teacher(cfg, self.model, self.tokenizer, self.device, self.autocast_dtype)
        self.ref_model = None
        if needs_reference:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.total_updates = cfg.steps * cfg.num_mini_batches * cfg.ppo_epochs
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_updates))
        self.prompts = PromptStream(task, cfg.seed)
        self.loss_config = cfg.policy_loss_config()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.collector = Collector(cfg, self.model, tokenizer, reward_fn, self.prompts, self.dist, pad_id,
                                   autocast_dtype=self.autocast_dtype, utilisation=self.utilisation)
        # staleness=k: each step's rollouts were generated k steps ahead by the weights of then (train/lag.py)
        # (generation records each rollout's rollout_log_prob itself, so no behaviour pass is needed)
        self.rollouts = LaggedRollouts(lambda: self.collector.collect(), cfg.staleness, cfg.steps)
        # use_adaptive_entropy: the coefficient and the last optimizer step's entropy (none yet: TRL applies 0 first)
        self.entropy_state: dict[str, float] = {"coef": cfg.entropy_coef, "last_entropy": float("inf")}
        #: the best evaluation of best_metric so far (keep_best, early_stop_patience; train/best.py)
        self.best = BestTracker(cfg.best_metric, cfg.early_stop_patience)
        if cfg.async_rollouts:  # a worker process generates while this process trains (train/async_rollouts.py)
            self.rollouts = self._async_rollouts(tokenizer, reward_fn, pad_id)
        self.start_step = 0
        #: with ``resume``: the checkpoint continued from and the logged steps dropped after it
        #: (:class:`~echotrain.train.checkpoint.Resumed`; the CLI's startup output says both)
        self.resumed = None
        #: writes checkpoints, in a background thread with ``async_save`` (train/checkpoint.py)
        self.checkpoints = CheckpointWriter(background=cfg.async_save)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist.barrier()
        if cfg.rollout_rng == "stream" and self.dist.rank > 0:  # each rank samples its own stream
            seed_everything(rank_seed(cfg.seed, self.dist.rank))
        if resume:
            self.resumed = resume_from(self.run_dir, model=self.model, optimizer=self.optimizer,
                                       scheduler=self.scheduler, data=self.prompts, dist=self.dist,
                                       extra_state=self._load_extra_state)
            self.start_step = self.resumed.step
            from echotrain.optim.registry import set_adamw_fused

            set_adamw_fused(self.optimizer, cfg.adam_fused)  # the checkpoint's groups carry the old flag
        self.logger: Any = NullLogger()
        if self.dist.is_main:  # rank 0 alone writes the run directory
            # the run directory actually used, so the saved config reruns / resumes into it
            save_config(dataclasses.replace(cfg, output_dir=str(self.run_dir)), self.run_dir / "config.yaml")
            write_json_atomic(self.run_dir / "run_info.json", run_info(
                run_dir=self.run_dir, device=self.device, device_reason=self.device_reason, model_name=cfg.model, model=self.model, task_name=cfg.task,
                task=self.task, world_size=self.dist.world_size, dist_backend=self.dist.backend,
                lora=is_lora(self.model),
                autocast=setting_name(self.autocast_dtype), autocast_reason=self.autocast_reason,
                roofline=roofline_info, warmup=self._warmup_record()))
            self.logger = MetricsLogger(self.run_dir, report_to=cfg.report_to, project=cfg.wandb_project,
                                        config=cfg.to_dict(), start_step=self.start_step)

    def _warm_up(self, task: Any, resume: bool = False) -> Any:
        """Run the supervised warm-up (sft_steps) on the policy in place; its result.

        Raises:
            WarmupError: (resumed, with sft_data) the file differs from the one the run warmed up on.
        """
        from echotrain.train.episodes import env_factory_of, episode_budget
        from echotrain.train.warmup import WarmupError, file_sha256, sft_warmup

        cfg = self.cfg
        if resume and cfg.sft_data:
            before = self._previous_warmup().get("data_sha256")
            now = file_sha256(cfg.sft_data)
            if before is not None and before != now:
                raise WarmupError(f"sft_data={cfg.sft_data!r} changed since the run warmed up on it (sha256 {before[:12]}... "
                                  f"then, {now[:12]}... now): the KL reference, the warmed-up policy, would differ; "
                                  "restore the file or start a new run")
        episodes = bool(cfg.env or cfg.tools)  # without an environment a demonstration is one model turn
        result = sft_warmup(self.model, self.tokenizer, task, env_factory_of(cfg) if episodes else None,
                            steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, seed=cfg.seed,
                            micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                            autocast_dtype=self.autocast_dtype, max_new_tokens=cfg.max_new_tokens,
                            max_turns=cfg.max_turns if episodes else 1,
                            max_episode_tokens=(episode_budget(cfg.max_episode_tokens, cfg.max_turns, cfg.max_new_tokens)
                                                if episodes else None),
                            data=cfg.sft_data or None)
        self.dist.broadcast_params(self.model)  # ranks warmed up alike; non-deterministic kernels may differ
        if self.dist.is_main:
            left_out = f"; {result.too_long} left out, longer than an episode allows" if result.too_long else ""
            source = f"sft_data={cfg.sft_data}" if cfg.sft_data else f"env={cfg.env or 'tools'}"
            of = f" of {result.data_rows}" if result.data_rows not in (None, result.examples) else ""
            steps, demos = f"{result.steps} supervised step" + "s" * (result.steps != 1), "demonstration" + "s" * (
                (result.data_rows or result.examples) != 1)
            print(f"echotrain: warm-up: {steps} on {result.examples}{of} {demos} of "
                  f"{source}{left_out} (cross-entropy {result.losses[0]:.3f} -> {result.losses[-1]:.3f} nats a "
                  f"target token, {result.seconds:.0f} s)", file=sys.stderr)
        return result

    def _warmup_record(self) -> dict[str, Any] | None:
        """run_info.json's ``warmup``: the warm-up's summary, a note when a resumed run took the
        warmed-up weights from its checkpoint, None without sft_steps."""
        if self.warmup is not None:
            return self.warmup.summary()
        if self.cfg.sft_steps:  # resumed: the first run's record, if it wrote one
            return {**self._previous_warmup(), "steps": self.cfg.sft_steps,
                    "note": "resumed: the warmed-up weights came from the checkpoint"}
        return None

    def _previous_warmup(self) -> dict[str, Any]:
        """run_info.json's ``warmup`` record as the run left it ({} when there is none)."""
        try:
            return json.loads((self.run_dir / "run_info.json").read_text()).get("warmup") or {}
        except (OSError, ValueError, AttributeError):
            return {}

    def _async_rollouts(self, tokenizer: Any, reward_fn: Any, pad_id: int) -> Any:
        """The :class:`~echotrain.train.async_rollouts.AsyncRollouts` of this run, the threads split
        between the worker and this process (``rollout_threads`` / ``learner_threads``).

        Raises:
            AsyncUnsupported: under torchrun (one worker per rank and the version protocol across
                ranks are not built) or on a device other than the CPU.
        """
        from echotrain.train.async_rollouts import AsyncRollouts, AsyncUnsupported, WorkerSpec

        cfg = self.cfg
        if self.dist.enabled:
            raise AsyncUnsupported("async_rollouts=true is not supported under torchrun (one worker per rank and the "
                               "weight-version protocol across ranks are not built); use staleness=k (fixed lag)")
        if self.device.type != "cpu":
            raise AsyncUnsupported(f"async_rollouts=true runs on the CPU only; this run's device is {self.device}")
        total = torch.get_num_threads()
        rollout = cfg.rollout_threads or max(1, total // 2)
        torch.set_num_threads(cfg.learner_threads or max(1, total - rollout))
        spec = WorkerSpec(cfg=cfg, buffer=None, tokenizer=tokenizer, task=self.task, reward_fn=reward_fn, pad_id=pad_id,
                          autocast_dtype=self.autocast_dtype, prompt_draws=0, threads=rollout, seed=cfg.seed + 7919,
                          max_staleness=cfg.max_staleness)
        regen_prompts = PromptStream(self.task, cfg.seed + 104_729)
        regen = Collector(cfg, self.model, tokenizer, reward_fn, regen_prompts, self.dist, pad_id,
                          autocast_dtype=self.autocast_dtype)
        return AsyncRollouts(spec, self.model, self.prompts, regen.collect, cfg.max_staleness, cfg.async_stale,
                             cfg.async_timeout_s, regen_prompts=regen_prompts)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """``cfg.optimizer`` on the trainable parameters, from its registry entry (which settings it
        takes, whether it wraps ``cfg.sam_base``: SAM, Foret et al. 2021; late-phase SAM from
        ``sam_start`` x the run's optimizer steps, Zhou et al. ICLR 2025, arXiv 2410.10373)."""
        from echotrain.optim.registry import build_from_settings

        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        settings = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        eps=cfg.adam_eps, fused=cfg.adam_fused, rho=cfg.sam_rho, model=self.model, sam_start=cfg.sam_start,
                        sam_start_unit="fraction", total_steps=self.total_updates,
                        restart_momentum=cfg.sam_restart_momentum)
        return build_from_settings(cfg.optimizer, params, settings, base=cfg.sam_base)

    # ------------------------------------------------------------------ 4. log-probs
    def _log_probs(self, model: Any, batch: RolloutBatch, with_entropy: bool = False,
                   grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.utilisation is not None:  # every log-prob pass of the step goes through here
            self.utilisation.log_prob_pass(batch, grad)
        with autocast(model, self.autocast_dtype):
            return policy_log_probs(model, batch, self.cfg, with_entropy=with_entropy, grad=grad)

    def _log_probs_batched(self, model: Any, batch: RolloutBatch,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad log-probs (and entropy) of all rows, in micro-batches; (N, T) float32 on CPU."""
        return batched_log_probs(self._log_probs, model, batch, self.cfg.micro_batch_size, self.dist,
                                 with_entropy=with_entropy)

    def _pi_stats(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The current weights' log pi of the sampled tokens and sum_v pi(v)^2 at every response
        position, ``(N, T)`` float32 on CPU each: what verl's optimal token baselines read
        (``old_log_probs``, ``sum_pi_squared``; docs/design/objectives.md §1). When the sampler
        ran these weights in this precision (:attr:`sampler_is_learner`) they are the sampler's own
        numbers, recorded during generation (equal up to float rounding, no pass); else one no-grad
        pass of the full log-softmax at the sampling temperature, in micro-batches (sharded over
        ranks)."""
        from echotrain.runtime.rollout import response_log_softmax

        cfg = self.cfg
        if (self.sampler_is_learner and batch.rollout_log_prob is not None
                and batch.rollout_sum_pi_squared is not None):
            return batch.rollout_log_prob, batch.rollout_sum_pi_squared

        def forward(model: Any, mb: RolloutBatch, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
            if self.utilisation is not None:
                self.utilisation.log_prob_pass(mb, False)
            with autocast(model, self.autocast_dtype):
                ls = response_log_softmax(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.attended_mask,
                                          temperature=cfg.temperature, pack=cfg.pack_responses,
                                          packed_attention=cfg.packed_attention).float()
            ids = mb.response_ids.to(ls.device)[:, :ls.shape[1]]
            return ls.gather(-1, ids.unsqueeze(-1)).squeeze(-1), (2.0 * ls).exp().sum(-1)

        with torch.no_grad():
            return batched_log_probs(forward, self.model, batch, cfg.micro_batch_size, self.dist, with_entropy=True)

    def _ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference-policy log-probs for the KL term (None when ``kl_coef`` is 0): the initial
        model's copy, or with LoRA the same model with its adapters disabled."""
        if self.cfg.kl_coef <= 0:
            return None
        if self.ref_model is not None:
            return self._log_probs_batched(self.ref_model, batch)[0]
        with reference_policy(self.model) as ref:
            return self._log_probs_batched(ref, batch)[0]

    def reuses_first_forward(self) -> bool:
        """Whether the first mini-batch's old log-probs come from its own with-grad forward
        (``reuse_on_policy_log_probs``): not with several processes, SAM (its second pass runs at
        w + e), ``top_entropy_quantile`` < 1 (its mask reads every old entropy first), losses whose
        step statistics read the log-probs before that forward (Clip-Cov's
        mean log-prob) or a rollout correction (it reads every old log-prob before the first
        update). The later rows then take the sampler's numbers when :attr:`sampler_is_learner`."""
        declared = loss_step_stats(self.cfg.loss_mode)
        return (self.cfg.reuse_on_policy_log_probs and not self.dist.enabled and not isinstance(self.optimizer, SAM)
                and (declared is None or declared.ratio_only)
                and not parse_rollout_correction(self.loss_config.rollout_correction)
                and self.cfg.top_entropy_quantile >= 1.0)  # its mask reads every row's old entropy first

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore the trainer's own state from a checkpoint's ``extra``: the rollouts generated
        ahead and the adaptive entropy coefficient."""
        self.rollouts.load_state_dict(extra.get("rollouts"))
        self.best.load_state_dict(extra.get("best"))
        if self.cfg.use_adaptive_entropy and "entropy" in extra:
            self.entropy_state = dict(extra["entropy"])

    def entropy_coef_now(self) -> float | None:
        """The entropy bonus's coefficient for the next optimizer step (None: no entropy term):
        ``entropy_coeff`` (verl), the adaptive coefficient where the last step's entropy was at or
        below ``entropy_target`` (else 0), or ``entropy_coef`` (TRL)."""
        cfg = self.cfg
        if cfg.entropy_coeff:
            return cfg.entropy_coeff
        if cfg.use_adaptive_entropy:
            return applied_entropy_coef(self.entropy_state["coef"], self.entropy_state["last_entropy"],
                                        cfg.entropy_target)
        return cfg.entropy_coef or None

    # ------------------------------------------------------------------ 5. one optimizer step
    def update_mini_batch(self, data: StepData, rows: torch.Tensor, on_policy: bool = False,
                          fill_old: bool = False) -> dict[str, float]:
        """One optimizer step on the rows ``rows`` of ``data``
        (:func:`echotrain.train.update.update_mini_batch`); under ``use_adaptive_entropy`` the
        coefficient then moves with that step's entropy (Skywork-OR1)."""
        cfg = self.cfg
        out = update_mini_batch(data, rows, cfg=cfg, loss_config=self.loss_config, model=self.model,
                                optimizer=self.optimizer, scheduler=self.scheduler, dist=self.dist,
                                forward=self._log_probs, on_policy=on_policy, fill_old=fill_old,
                                entropy_coef=self.entropy_coef_now(), distill=self.teacher)
        if cfg.use_adaptive_entropy:
            h = out["entropy/current"]
            self.entropy_state = {"coef": adaptive_entropy_coef(
                self.entropy_state["coef"], h, target=cfg.entropy_target, delta=cfg.entropy_coef_delta,
                coef_min=cfg.entropy_coef_min, coef_max=cfg.entropy_coef_max), "last_entropy": h}
        return out

    # ------------------------------------------------------------------ one training step
    def train_step(self, step: int) -> dict[str, Any]:
        """Run training step ``step`` (1-based) and return its metrics record."""
        cfg = self.cfg
        t_start, cpu_start = time.perf_counter(), time.process_time()

        # 1. collect: rollouts, each round scored (DAPO dynamic sampling keeps mixed groups); with
        # staleness=k those generated k steps ago, while this step generates step + k's
        data = self.rollouts.rollouts_for(step)
        batch = data.batch

        # 2. score: DAPO overlong reward shaping; overlong filtering masks truncated responses
        if cfg.overlong_buffer > 0:
            data.rewards = data.rewards + cfg.overlong_penalty_factor * overlong_reward_penalty(
                batch.response_length, cfg.max_new_tokens, cfg.overlong_buffer)
        data.response_mask = (truncated_response_mask(batch.response_mask, batch.truncated).to(batch.response_mask.dtype)
                              if cfg.overlong_filtering else batch.response_mask.clone())
        t_update = time.perf_counter()

        # 3. advantages (one scalar per response broadcast over its tokens, or per token for the
        # token-level estimators; remax's baselines were rolled out with the responses)
        # (the optimal token baselines read pi and sum_v pi(v)^2 of the current weights: the sampler's
        # numbers when it ran them, else one no-grad pass)
        pi_stats = self._pi_stats(batch) if cfg.adv_estimator in ADV_NEEDS_PI_STATS else (None, None)
        data.advantages, data.seq_advantages = compute_token_advantages(
            data.rewards, batch.group_index, data.response_mask, adv_estimator=cfg.adv_estimator,
            reward_baselines=data.reward_baselines, gamma=cfg.gamma, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
            old_log_prob=pi_stats[0], sum_pi_squared=pi_stats[1])
        if cfg.objective == "distill":  # on-policy distillation alone: no policy-gradient signal
            data.advantages, data.seq_advantages = torch.zeros_like(data.advantages), torch.zeros_like(data.seq_advantages)
        # the mini-batches of whole groups, per PPO epoch (rank 0 draws the split; every rank uses it)
        splits = mini_batch_splits(batch.group_index, cfg.num_mini_batches, cfg.ppo_epochs, self.dist)

        # 4. old log-probs (rollout policy), entropy, reference log-probs; with reuse the first
        # update's own rows take theirs from its with-grad forward (the policy has not changed yet)
        reuse = self.reuses_first_forward()
        if batch.rollout_log_prob is not None:  # recorded inside generation (the sampling weights)
            data.rollout_log_prob = batch.rollout_log_prob
        # (the rows after the first mini-batch: the sampler's own numbers, when they are the learner's)
        sampled = (batch.rollout_log_prob, batch.rollout_entropy) if (
            cfg.recompute_old_log_prob and reuse and self.sampler_is_learner and batch.rollout_log_prob is not None
            and batch.rollout_entropy is not None) else None
        if cfg.recompute_old_log_prob:
            data.old_log_prob, data.entropy = old_log_probs(
                functools.partial(self._log_probs_batched, self.model, with_entropy=True), batch,
                splits[0] if reuse else None, sampled=sampled)
        else:  # coupled: the sampler's log-probs and entropy are pi_old's (no recompute pass)
            if batch.rollout_log_prob is None or batch.rollout_entropy is None:
                raise RuntimeError("recompute_old_log_prob=false needs the sampler's log-probs and entropy, which "
                                   "this rollout batch does not carry (generation did not record them)")
            data.old_log_prob, data.entropy = batch.rollout_log_prob.clone(), batch.rollout_entropy.clone()
        data.ref_log_prob = self._ref_log_probs(batch)
        if self.teacher is not None and cfg.distill_top_k > 0:  # the teacher's top-k, stored for the update
            data.teacher_top_values, data.teacher_top_indices = self.teacher.top_k(batch, cfg.micro_batch_size)
        if cfg.top_entropy_quantile < 1.0:  # "Beyond the 80/20 Rule": the step's high-entropy tokens only
            keep = high_entropy_mask(data.entropy, data.response_mask, cfg.top_entropy_quantile)
            data.response_mask = data.response_mask * keep.to(data.response_mask.dtype)

        # 5. update: one optimizer step per mini-batch
        # (coupled, old_log_prob is the sampler's: not the current weights' numbers even before any update)
        updates = [self.update_mini_batch(data, rows, on_policy=i == 0 and cfg.recompute_old_log_prob,
                                          fill_old=reuse and i == 0 and cfg.recompute_old_log_prob)
                   for i, rows in enumerate(splits)]
        t_update = time.perf_counter() - t_update

        # 6. metrics
        self._samples = sample_rows(step, data, cfg.log_samples)
        record = step_record(step, data, updates, last_lr=self.scheduler.get_last_lr()[0], t_start=t_start,
                             cpu_start=cpu_start, t_update=t_update, device=self.device)
        record[ALL_ZERO_VARIANCE] = int(all_zero_variance(data.rewards, batch.group_index))
        if self.teacher is not None:  # time/teacher, memory/teacher_mb
            record.update(self.teacher.step_metrics())
        # the task's own metrics of this step's rollouts (declared by the task, reduce="step")
        record.update(task_step_metrics(self.step_metrics, data.texts, data.examples, data.correct, builtin=record))
        # staleness/* (none when synchronous), async/*
        record.update(self.rollouts.step_metrics(step, data, record["time/step"]))
        if batch.episode_stats is not None:  # env=: turns, tool calls / errors, tokens, cuts (train/episodes.py)
            from echotrain.train.episodes import episode_metrics

            record.update(episode_metrics(batch))
        if data.rollout_log_prob is not None:  # train/inference mismatch of the step's recomputed rows, every step
            measured = data.response_mask  # (with the sampler's numbers reused: the first mini-batch's rows)
            if sampled is not None:
                measured = torch.zeros_like(measured)
                measured[splits[0]] = data.response_mask[splits[0]]
            record.update(rollout_mismatch_metrics(data.old_log_prob, data.rollout_log_prob, measured,
                                                   self.loss_config.log_ratio_clamp))
        if self.utilisation is not None:
            # (async: the worker generated, uncounted here: no decode figure)
            record.update(self.utilisation.step_metrics(0.0 if cfg.async_rollouts else data.time_generation, t_update))
        return record

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Accuracy on ``cfg.eval_prompts`` fixed prompts (greedy, or ``cfg.eval_n`` samples each at
        ``cfg.eval_temperature`` / ``cfg.eval_top_p``: avg@n and pass@n); appended to eval.jsonl.
        With ``env`` each sample is an episode with the run's environment (its final turn scored).

        Runs under a forked RNG, so enabling it does not change the training run."""
        from echotrain.train.evaluate import evaluate

        cfg = self.cfg
        t0 = time.perf_counter()
        # the CUDA generator forked too: evaluate() seeds torch (CPU and CUDA) and may sample on the GPU
        with torch.random.fork_rng(devices=rng_devices(self.device)), autocast(self.model, self.autocast_dtype):
            res = evaluate(self.model, self.tokenizer, self.eval_task, num_prompts=cfg.eval_prompts, n=cfg.eval_n,
                           ks=(cfg.eval_n,), max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature,
                           top_p=cfg.eval_top_p, seed=cfg.seed + 7,
                           batch_prompts=max(cfg.prompts_per_step * cfg.num_generations, 1), decode_loop=cfg.decode_loop,
                           sampler=cfg.sampler, decode_linear=cfg.decode_linear,
                           episodes=None if self.collector.episodes is None
                           else self.collector.episodes.eval_settings())
        out = {"eval/accuracy": res["accuracy"], "eval/format_rate": res["format_rate"]}
        if cfg.eval_n > 1:
            out["eval/pass@n"] = res[f"pass@{cfg.eval_n}"]
        self.logger.log_eval({"step": step, **out, "eval/prompts": cfg.eval_prompts,
                              "eval/temperature": cfg.eval_temperature, "time/eval": time.perf_counter() - t0})
        return out

    # ------------------------------------------------------------------ the loop
    def save(self, step: int) -> Path:
        """Checkpoint after ``step`` (atomic, keep-last-k), written by rank 0 with every rank's RNG
        state. With LoRA the model part is the adapters only. With ``async_save`` the file is
        written in the background: it is complete once ``self.checkpoints.wait()`` returns (the end
        of :meth:`train` waits). Returns the path (on every rank)."""
        from echotrain.train.checkpoint import rng_state

        rngs = self.dist.gather(rng_state())
        path = self.run_dir / "checkpoints" / f"step_{step:08d}.pt"
        if self.dist.is_main:
            extra = {"world_size": self.dist.world_size, "rng_ranks": rngs if self.dist.enabled else None}
            if self.cfg.staleness or self.cfg.async_rollouts:  # the rollouts generated ahead (train/lag.py;
                # every rank holds the same) / the async mode and its regeneration stream
                extra["rollouts"] = self.rollouts.state_dict()
            if self.cfg.use_adaptive_entropy:  # the adaptive coefficient and the last step's entropy
                extra["entropy"] = dict(self.entropy_state)
            extra["best"] = self.best.state_dict()  # the best evaluation so far (keep_best, early stopping)
            path = self.checkpoints.save(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                         scheduler=self.scheduler, data_state=self.prompts.state_dict(),
                                         keep_last=self.cfg.keep_last, extra=extra,
                                         model_state=model_state(self.model))
        self.dist.barrier()
        return path

    def save_best(self, step: int) -> Path:
        """The checkpoint of the best evaluation so far (``keep_best``, rank 0): written like
        :meth:`save` into ``<run>/best/checkpoints/`` keeping one, and ``best/best.json``."""
        extra = {"world_size": self.dist.world_size, "best": self.best.state_dict()}
        path = self.checkpoints.save(self.run_dir / BEST_DIR, step, model=self.model, optimizer=self.optimizer,
                                     scheduler=self.scheduler, data_state=self.prompts.state_dict(), keep_last=1,
                                     extra=extra, model_state=model_state(self.model))
        self.best.write_json(self.run_dir)
        return path

    def train(self) -> list[dict[str, Any]]:
        """Run steps ``start_step+1 .. cfg.steps``; returns all metrics records of the run. The run
        directory's lock (train/run_lock.py) is held throughout and released on return or raise.

        Raises:
            echotrain.train.run_lock.RunDirBusy: called again after returning, while another
                process writes the run directory.
        """
        if self.dist.is_main and (self._run_lock is None or not self._run_lock.held):
            self._run_lock = lock_run_dir(self.run_dir)
        try:
            return self._train()
        finally:
            if self._run_lock is not None:
                self._run_lock.release()

    def _train(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        t0 = time.perf_counter()
        main = self.dist.is_main
        from tqdm.auto import tqdm

        # the preset as trained: echo+loss_mode=gspo when a recipe key overrides the preset's (config/preset_report.py)
        bar = tqdm(total=cfg.steps, initial=self.start_step, desc=f"echotrain {preset_label(cfg)}", unit="step",
                   dynamic_ncols=True, disable=not (cfg.progress and main))
        no_signal = NoSignalWatch(cfg.no_signal_steps)
        try:
            if cfg.eval_prompts and self.start_step == 0 and main:
                self.evaluate(0)
            last_saved = self.last_step = self.start_step
            for step in range(self.start_step + 1, cfg.steps + 1):
                try:
                    record = self.train_step(step)
                except (RolloutWorkerError, TemplateError):  # nothing of this step is applied: keep the last completed one
                    if step - 1 > last_saved and not self.dist.enabled:  # (torchrun: the others are in another collective)
                        self.save(step - 1)
                    raise
                self.rollouts.after_step(step)  # async: publish the weights of version `step` to the worker
                self.last_step, stop = step, False
                if main and cfg.eval_prompts and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                    try:
                        record.update(self.evaluate(step))
                    except TemplateError:  # the step is applied: log and keep it, then stop
                        if not self.dist.enabled:
                            self.logger.log(record)
                            self.save(step)
                        raise
                    if self.best.update(step, record) and cfg.keep_best:
                        self.save_best(step)
                    stop = self.best.should_stop and step < cfg.steps
                stop = bool(self.dist.broadcast(stop))  # rank 0 evaluates; every rank stops with it
                self.logger.log(record)
                self.logger.log_samples(self._samples)
                if self.utilisation is not None and self.utilisation.note:  # the peaks were re-measured
                    tqdm.write(self.utilisation.note, file=sys.stderr)
                    self.utilisation.note = None
                warning = no_signal.update(record, last=step == cfg.steps)
                if warning and main and cfg.objective != "distill":  # distillation learns from the teacher
                    tqdm.write(warning, file=sys.stderr)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}", acc=f"{record['accuracy']:.3f}",
                                len=f"{record['response_length/mean']:.0f}")
                for cb in self.callbacks:
                    cb(step, record)
                if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop:
                    self.save(step)
                    last_saved = step
                    if cfg.plots and step != cfg.steps and main and not stop:
                        self.write_plots()
                if stop:
                    if main:
                        tqdm.write(f"echotrain: early stop after step {step}: {cfg.best_metric} did not improve in "
                                   f"{self.best.since} evaluations (best {self.best.best:.4g} at step "
                                   f"{self.best.best_step}; early_stop_patience={cfg.early_stop_patience})",
                                   file=sys.stderr)
                    break
        except BaseException:
            self.checkpoints.wait()  # a checkpoint being written in the background is finished first
            raise
        finally:
            self.rollouts.close()  # async: stop the worker
            bar.close()
            self.logger.close()
        try:  # the stability flags, plots and final model are written while the last checkpoint is
            records, stability = self._final_outputs()
        finally:
            self.checkpoints.wait()
        self.train_seconds = time.perf_counter() - t0
        if main and cfg.progress:
            print_summary(records, self.run_dir, self.train_seconds, evals=read_jsonl(self.run_dir / "eval.jsonl"),
                          steps_run=(self.start_step + 1, self.last_step), stability=stability)
        return records

    def _final_outputs(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """After the last step: all metrics records, and on rank 0 the stability flags
        (stability.json, returned), the plots and the final model; other ranks return None flags."""
        cfg = self.cfg
        self.dist.barrier()
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        if not self.dist.is_main:
            return records, None
        stability = stability_flags(records, evals=read_jsonl(self.run_dir / "eval.jsonl"))
        write_json_atomic(self.run_dir / "stability.json", stability)
        if cfg.plots:
            self.write_plots(records)
        if cfg.save_final_model and hasattr(self.model, "save_pretrained"):
            save_final_model(self.model, self.run_dir / "final_model", merged=cfg.lora_merge_final)
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(self.run_dir / "final_model")
        elif cfg.save_final_model:  # asked for, not possible: say so instead of leaving no folder silently
            print(f"echotrain: no final_model/ written: {type(self.model).__name__} has no save_pretrained; the "
                  "last checkpoint holds its weights (what `eval --model RUN_DIR` and teacher=RUN_DIR read)",
                  file=sys.stderr)
        return records, stability

    def write_plots(self, records: list[dict[str, Any]] | None = None) -> list[Path]:
        from echotrain.train.plots import plot_metrics

        records = read_jsonl(self.run_dir / "metrics.jsonl") if records is None else records
        return plot_metrics(records, self.run_dir / "plots", evals=read_jsonl(self.run_dir / "eval.jsonl"),
                            title=f"{self.run_dir} ({preset_label(self.cfg)}, seed {self.cfg.seed})")
