"""Train with echotrain's objectives inside TRL: ``EchoGRPOTrainer`` / ``EchoGRPOConfig``.

TRL 1.16 has no policy-loss hook: ``GRPOTrainer._compute_loss`` hard-codes its ``loss_type``
branches. :class:`EchoGRPOTrainer` overrides that one method (and tags each rollout with its
prompt group); everything else (generation, vLLM, rewards, advantages, logging) is TRL's::

    from echotrain.integrations.trl import EchoGRPOConfig, EchoGRPOTrainer

    args = EchoGRPOConfig(output_dir="out", loss_mode="echo", loss_agg_mode="token-mean",
                          epsilon=0.2, epsilon_high=0.28, batch_clip_low=0.02, batch_clip_high=0.02,
                          num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=4)
    trainer = EchoGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds)
    trainer.train()

The loss is :func:`echotrain.rl.compute_policy_loss` of TRL's per-token log-probs
(``log_prob``), ``old_per_token_logps`` (``old_log_prob``; TRL leaves it out when it equals the
current log-probs, i.e. on-policy, and then ``log_prob.detach()`` is used, as TRL does), TRL's
group advantages ``(B,)`` and ``completion_mask`` (times ``tool_mask``). The token clip is TRL's
``epsilon`` / ``epsilon_high``; TRL's ``loss_type`` is ignored.

Exact gradient accumulation. TRL sums the losses of ``gradient_accumulation_steps`` micro-batches
per optimizer step; its own normalisers are the step's only in special cases (``dapo`` divides
by the generation batch's token count times ``gradient_accumulation_steps / steps_per_generation``,
exact only when one optimizer step consumes the whole generation batch; ``grpo`` and ``bnpo``
average per-micro-batch means, exact only for equal micro-batch token counts).
Here, at the first micro-batch of each optimizer step, the trainer computes the step's statistics
over all of the step's micro-batches (they are already in TRL's rollout buffer) with
:func:`echotrain.rl.compute_step_stats` (all-reduced across processes), and every micro-batch's
loss uses them: the accumulated gradient equals the gradient of the loss of the whole step as
one batch, for every ``loss_agg_mode`` including ``balanced``, and for ECHO's batch ratio R. ECHO
off-policy (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``)
needs the current policy's log-probs of the whole step first: a no-grad pre-pass over the
step's micro-batches (one extra forward per micro-batch; skipped on-policy, where R = 1).
This requires ``steps_per_generation`` to be a multiple of ``gradient_accumulation_steps`` (so
that an optimizer step never spans two rollout buffers; TRL's default makes them equal), and
the pre-pass must see the same function as the with-grad pass: keep ``disable_dropout=True``
(the default of :class:`EchoGRPOConfig`).

Several processes (``accelerate launch --multi_gpu --num_processes N``; on CPU with
``use_cpu=True``, see docs/distributed.md): ``compute_step_stats`` all-reduces the step statistics
over accelerate's process group and ``group_index`` is step-global, so ECHO's R, the token counts
and BA's group statistics are those of the whole step across processes, and each process's loss
is multiplied by the world size (DDP averages gradients); tests/integrations/test_trl_distributed.py.

TRL's static ``entropy_coef`` bonus is mapped: minus ``entropy_coef`` x the mean token entropy
over the optimizer step's tokens (:func:`echotrain.rl.entropy.entropy_bonus`, ``"token-mean"``),
exact over the accumulation window (TRL divides each micro-batch's own mean by the window's
length, the same only when micro-batches hold equal token counts).

Not supported (a clear error at construction): ``beta > 0`` (KL to a reference),
``top_entropy_quantile < 1`` and ``use_adaptive_entropy`` (both read state beyond one loss call:
the echotrain trainer has them, keys of the same names), ``off_policy_mask_threshold``, vLLM
importance-sampling correction, MoE auxiliary losses. Metrics: ``echotrain/<name>`` for the
loss's metrics (``pg_clipfrac``, ``ppo_kl``, ``echo/R_batch`` ...), and TRL's ``entropy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from echotrain.rl.entropy import entropy_bonus
from echotrain.rl import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    StepStats,
    compute_policy_loss,
    compute_step_stats,
    needs_log_prob_prepass,
)
from echotrain.rl.config import with_policy_loss_fields
from echotrain.rl.correction_names import parse_rollout_correction
from echotrain.rl.objectives import loss_step_stats

__all__ = ["EchoGRPOConfig", "EchoGRPOTrainer"]

#: PolicyLossConfig fields that TRL already has under its own names (``epsilon``, ``epsilon_high``).
TRL_OWNED = ("clip_ratio_low", "clip_ratio_high")


@dataclass
@with_policy_loss_fields(exclude=TRL_OWNED, keep=("help",))
class EchoGRPOConfig(GRPOConfig):
    """:class:`trl.GRPOConfig` plus echotrain's objective fields (TRL's ``loss_type`` is ignored).

    The loss settings are :class:`echotrain.rl.PolicyLossConfig`'s fields and the flat settings
    the built-in losses declare in their registrations (``tau_pos`` ...; same names, defaults and
    help; checked by PolicyLossConfig), except the token clip, which is TRL's ``epsilon`` (eps_low) and
    ``epsilon_high`` (eps_high, default eps_low). ``norm_constant`` unset (None) = TRL's
    ``max_completion_length``.
    """

    loss_mode: str = field(default="echo", metadata={"help": (
        "echotrain policy loss: any name in echotrain.rl.POLICY_LOSSES (vanilla = token PPO clip, gspo, gspo_token, "
        "echo = batch-level clip of R then token clip, and verl's / TRL's cispo, sapo, geo_mean, dppo_tv, dppo_kl, gpg, "
        "clip_cov, kl_cov, dro, luspo, vespo; docs/design/objectives.md). TRL's sapo_temperature_* are tau_pos / "
        "tau_neg here; TRL's cispo epsilon_high (the cap) is 1 + epsilon_high here with cispo_lower_clip=False.")})
    loss_agg_mode: str = field(default="token-mean", metadata={"help": (
        "echotrain loss aggregation: any name in echotrain.rl.AGG_MODES (token-mean = DAPO, seq-mean-token-mean = "
        "GRPO, seq-mean-token-sum, seq-mean-token-sum-norm = Dr. GRPO with C = norm_constant, token-sum, balanced = "
        "Balanced Aggregation, arXiv 2605.04077). Always exact over the optimizer step.")})
    disable_dropout: bool = field(default=True, metadata={"help": (
        "Disable dropout (TRL's default is False): the ECHO pre-pass and the with-grad pass must agree.")})

    def __post_init__(self):
        super().__post_init__()
        if self.loss_mode not in POLICY_LOSSES:
            raise ValueError(f"loss_mode={self.loss_mode!r} is not one of {sorted(POLICY_LOSSES)}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} is not one of {list(AGG_MODES)}")
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) so that each optimizer step's "
                "micro-batches are in one rollout buffer (exact step statistics)"
            )
        self.policy_loss_config()  # PolicyLossConfig checks every loss setting (ValueError naming it)

    def policy_loss_config(self) -> PolicyLossConfig:
        """The :class:`echotrain.rl.PolicyLossConfig` these fields describe.

        Raises:
            ValueError: a setting that fails its PolicyLossConfig check (naming it).
        """
        values = {name: getattr(self, name) for name in self.policy_loss_keys}
        if values["norm_constant"] is None:
            values["norm_constant"] = float(self.max_completion_length)
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return PolicyLossConfig(clip_ratio_low=self.epsilon, clip_ratio_high=eps_high, **values)


class EchoGRPOTrainer(GRPOTrainer):
    """:class:`trl.GRPOTrainer` whose policy loss is :func:`echotrain.rl.compute_policy_loss`.

    Args: those of :class:`trl.GRPOTrainer`; ``args`` must be an :class:`EchoGRPOConfig`.

    Raises:
        TypeError: ``args`` is not an :class:`EchoGRPOConfig`.
        ValueError: a TRL option this trainer does not support (see the module docstring).
    """

    def __init__(self, *pargs: Any, args: EchoGRPOConfig | None = None, **kwargs: Any):
        if not isinstance(args, EchoGRPOConfig):
            raise TypeError(f"EchoGRPOTrainer needs args=EchoGRPOConfig(...), got {type(args).__name__}")
        unsupported = {
            "beta": args.beta != 0.0,
            "top_entropy_quantile": args.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
            # the adaptive controller keeps state across TRL's steps: the echotrain trainer has it
            "use_adaptive_entropy": args.use_adaptive_entropy,
            "vllm_importance_sampling_correction": args.use_vllm and args.vllm_importance_sampling_correction,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"EchoGRPOTrainer does not support {bad} (the echotrain loss has no such term)")
        if parse_rollout_correction(args.rollout_correction) and not args.use_vllm:
            raise ValueError(f"rollout_correction={args.rollout_correction!r} needs the sampler's per-token log-probs, "
                             "which TRL records only when generating with vLLM (use_vllm=True: "
                             "sampling_per_token_logps); set rollout_correction=None")
        super().__init__(*pargs, args=args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError("EchoGRPOTrainer does not support MoE auxiliary losses (set router_aux_loss_coef=0)")
        self.policy_loss_config = args.policy_loss_config()
        self._step_stats: StepStats | None = None

    # -------------------------------------------------------------- rollouts carry their group
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        n = output["completion_ids"].shape[0]
        g = self.num_generations if self.model.training else self.num_generations_eval or self.num_generations
        start = self.accelerator.process_index * n  # TRL's process_slice: rows are global-order contiguous
        rows = torch.arange(start, start + n, device=output["completion_ids"].device)
        output["group_index"] = rows // g  # shuffled with the other tensors by TRL
        return output

    # -------------------------------------------------------------- the step's statistics
    def _mask(self, inputs: dict[str, Any]) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask

    def _log_probs(self, model, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True)
        return logps, entropies

    def compute_step_stats_for(self, model, mbs: list[dict[str, Any]]) -> StepStats:
        """Step-global statistics of one optimizer step from its micro-batches (TRL input dicts).

        A loss with a pre-pass (ECHO, Clip-Cov, KL-Cov) runs it here off-policy; on-policy (no
        ``old_per_token_logps``) the current log-probs equal the old ones: for statistics of log rho
        only (ECHO, ``ratio_only``) zeros stand for both (R = 1 exactly); the others run the
        pre-pass and use its log-probs as both.
        """
        cfg = self.policy_loss_config
        loss_mode, agg = self.args.loss_mode, self.args.loss_agg_mode
        prepass = needs_log_prob_prepass(loss_mode, cfg)
        ratio_only = prepass and loss_step_stats(loss_mode).ratio_only
        stat_mbs = []
        for mb in mbs:
            mask = self._mask(mb)
            old = mb.get("old_per_token_logps")
            entry = {"response_mask": mask, "advantages": mb["advantages"], "group_index": mb["group_index"],
                     "rollout_log_prob": mb.get("sampling_per_token_logps")}
            if old is None and ((prepass and not ratio_only) or parse_rollout_correction(cfg.rollout_correction)):
                # the pre-pass's statistics read the log-probs, or the correction needs pi_old itself
                with torch.no_grad():
                    entry["old_log_prob"] = entry["log_prob"] = self._log_probs(model, mb)[0]
            elif old is None:
                entry["old_log_prob"] = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
                entry["log_prob"] = entry["old_log_prob"]
            else:
                entry["old_log_prob"] = old
                if prepass:
                    with torch.no_grad():
                        entry["log_prob"] = self._log_probs(model, mb)[0]
            stat_mbs.append(entry)
        return compute_step_stats(stat_mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)

    # -------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            window = self.current_gradient_accumulation_steps
            if self._step % self.args.gradient_accumulation_steps == 0 or self._step_stats is None:
                first = self._step % self.args.steps_per_generation
                mbs = self._buffered_inputs[first:first + window]
                self._step_stats = self.compute_step_stats_for(model, mbs)
            step = self._step_stats
        else:  # evaluation: the batch is its own step
            step = self.compute_step_stats_for(model, [inputs])
        log_prob, entropies = self._log_probs(model, inputs)
        mask = self._mask(inputs)
        old = inputs.get("old_per_token_logps")
        old = log_prob.detach() if old is None else old
        loss, metrics = compute_policy_loss(
            self.args.loss_mode, old, log_prob, inputs["advantages"], mask, self.args.loss_agg_mode,
            self.policy_loss_config, group_index=inputs["group_index"], step=step,
            rollout_log_prob=inputs.get("sampling_per_token_logps"))  # vLLM's log-probs: rollout_correction
        if self.args.entropy_coef != 0.0:  # TRL's bonus: the mean entropy over the step's tokens, exact
            loss = loss - self.args.entropy_coef * entropy_bonus(entropies, mask, step, "token-mean")
        m = mask.bool()
        self._metrics[mode]["entropy"].append(float(entropies.detach()[m].mean()) if m.any() else 0.0)
        for k, v in metrics.items():
            self._metrics[mode][f"echotrain/{k}"].append(float(v))
        return loss
