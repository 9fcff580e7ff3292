"""The step-global statistics of one optimizer step, and what a policy loss declares to get its own.

:func:`echotrain.rl.stepwise.compute_step_stats` fills a :class:`StepStats` once per optimizer
step (token and sequence counts, Balanced-Aggregation group statistics); a loss whose value
depends on the whole step beyond those (ECHO's batch ratio R) declares a :class:`LossStepStats`
in its registration (``register_policy_loss(name, step_stats=...)``), and ``compute_step_stats``
runs it without knowing which loss it is: its per-micro-batch sums join the step's single
all-reduce and its ``finish`` turns them into the object the loss reads as ``step.loss_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from echotrain.rl.aggregation import BalancedStats, agg_weights
from echotrain.rl.config import PolicyLossConfig

ReduceFn = Callable[[torch.Tensor, str], torch.Tensor]


class StepBatch(NamedTuple):
    """One micro-batch as the step statistics see it (checked, detached).

    ``old_log_prob`` ``(b, T)``; ``log_prob`` ``(b, T)``: the no-grad pre-pass values when the
    loss declares ``needs_log_prob``, else ``old_log_prob``; ``advantages`` ``(b, T)`` or
    ``(b,)``; ``response_mask`` bool ``(b, T)``; ``group_index`` ``(b,)`` step-wide ids (all 0
    with ``ba_scope="batch"``) or None.
    """

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor | None
    rollout_is_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class StepStats:
    """Step-global statistics for one optimizer step; pass as ``compute_policy_loss(..., step=)``."""

    loss_mode: str
    loss_agg_mode: str
    num_tokens: float  # valid tokens of the step (all micro-batches, all ranks)
    num_seqs: float  # non-empty sequences of the step
    dp_size: int  # each rank's loss is multiplied by this (DDP averages gradients)
    balanced: BalancedStats | None = None  # per-group stats for loss_agg_mode="balanced"
    loss_stats: Any = None  # what the loss's LossStepStats.finish returned (ECHO: EchoStats), else None
    config: PolicyLossConfig | None = None  # the config the stats were computed with (checked by the losses)
    correction: Any = None  # the step's rollout-correction statistics (echotrain.rl.correction.CorrectionStats), else None

    def agg_kwargs(self, cfg: PolicyLossConfig) -> dict[str, Any]:
        """Keyword arguments of :func:`~echotrain.rl.agg_weights` / :func:`~echotrain.rl.agg_loss`
        that are global to the step (token / sequence counts, BA group statistics) or come from
        ``cfg`` (``norm_constant``, BA flags)."""
        return dict(
            num_tokens=self.num_tokens,
            num_seqs=self.num_seqs,
            norm_constant=cfg.norm_constant,
            balanced=self.balanced,
            ba_scope=cfg.ba_scope,
            ba_count_zero_adv=cfg.ba_count_zero_adv,
        )


@dataclass(frozen=True)
class LossStepStats:
    """What a policy loss needs from the whole step beyond counts, declared at registration.

    Attributes:
        needs_log_prob: the statistics depend on the *current* policy, so every micro-batch
            needs a no-grad pre-pass ``log_prob`` (see :mod:`echotrain.rl.stepwise`).
        num_sums: length of the vector ``local_sums`` returns.
        local_sums: ``f(mb: StepBatch, cfg) -> (num_sums,) float64`` plain sums of one
            micro-batch; summed over micro-batches and all-reduced (SUM) with the step's counts.
        finish: ``f(sums, mbs, step, reduce_fn) -> stats``: the step's stats from the global
            ``sums``, this rank's ``mbs`` (list of :class:`StepBatch`), the step's counts
            (``step``, with ``loss_stats=None``) and ``reduce_fn(tensor, op)`` for any further
            all-reduce round; the result becomes ``step.loss_stats``.
        ratio_only: the statistics read the log-probs only through log rho = log_prob -
            old_log_prob (ECHO's R), so on-policy (log rho = 0) any equal pair, e.g. zeros, gives
            them without a forward pass. False (the default) when they read ``log_prob`` itself
            (Clip-Cov / KL-Cov's mean log-prob): then the pre-pass runs on-policy too.
    """

    needs_log_prob: bool
    num_sums: int
    local_sums: Callable[[StepBatch, PolicyLossConfig], torch.Tensor]
    finish: Callable[[torch.Tensor, list[StepBatch], StepStats, ReduceFn], Any]
    ratio_only: bool = False


def seq_weights(
    mask: torch.Tensor,
    advantages: torch.Tensor,
    loss_agg_mode: str,
    cfg: PolicyLossConfig,
    group_index: torch.Tensor | None,
    step: StepStats | None,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence aggregation weights ``(B,)`` float64, from the step's statistics when given;
    times a rollout correction's ``rollout_is_weights`` ``(B, T)`` when given (then ``(B, T)``).

    Raises:
        ValueError: ``step`` was computed for another ``loss_agg_mode`` or another config; the
            errors of :func:`~echotrain.rl.agg_weights`.
    """
    if step is None:
        w = agg_weights(
            mask,
            loss_agg_mode,
            advantages=advantages,
            group_index=group_index,
            norm_constant=cfg.norm_constant,
            ba_scope=cfg.ba_scope,
            ba_count_zero_adv=cfg.ba_count_zero_adv,
        )
    else:
        if step.loss_agg_mode != loss_agg_mode:
            raise ValueError(f"step was computed for loss_agg_mode={step.loss_agg_mode!r}, not {loss_agg_mode!r}")
        if step.config is not None and step.config != cfg:
            raise ValueError(f"step was computed with config {step.config}, not {cfg}")
        w = agg_weights(mask, loss_agg_mode, advantages=advantages, group_index=group_index, **step.agg_kwargs(cfg))
    return w if rollout_is_weights is None else w.unsqueeze(-1) * rollout_is_weights.to(torch.float64)
