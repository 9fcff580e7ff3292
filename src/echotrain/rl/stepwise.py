"""Exact gradient accumulation and data parallelism for one optimizer step.

Every normaliser of a policy loss (token count, sequence count, Balanced-Aggregation group
statistics, ECHO's batch ratio R) is global to the optimizer step. When the step's mini-batch is
split into micro-batches (gradient accumulation) and/or across data-parallel ranks, each
micro-batch must use the *step's* values, not its own, or the summed gradient is not the
gradient of the loss the config names. This module computes those step-global statistics once
per step (summing locally, all-reducing across ranks) so that::

    sum over micro-batches and ranks of grad(loss_mb)  ==  grad(loss of the whole step as one batch)

exactly (to float rounding) for every loss mode and every ``loss_agg_mode``.

Usage in a trainer, for one optimizer step whose mini-batch is split into micro-batches ``mbs``
(each a dict of tensors with verl's keys ``old_log_prob``, ``advantages``, ``response_mask``,
plus ``group_index`` for ``loss_agg_mode="balanced"``)::

    from echotrain.rl import (compute_policy_loss, compute_step_stats, needs_log_prob_prepass,
                              shard_batch, split_micro_batches)

    # batch: this rank's share of the step (shard_batch(step_batch, rank, world_size) if you shard here)
    mbs = split_micro_batches(batch, micro_batch_size)
    # 1. ECHO only: the batch ratio R depends on the *current* policy over all tokens of the
    #    step, so run the policy once without grad to get every micro-batch's log_prob.
    if needs_log_prob_prepass(loss_mode, config):
        with torch.no_grad():
            for mb in mbs:
                mb["log_prob"] = policy_log_prob(model, mb)  # (B_mb, T) current log-probs
    # 2. step-global statistics (all-reduced over the default process group if
    #    torch.distributed is initialised; pass process_group=... to choose another one).
    step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                              config=config)
    # 3. the with-grad pass: each micro-batch's loss uses the step's statistics.
    optimizer.zero_grad()
    for mb in mbs:
        log_prob = policy_log_prob(model, mb)                # with grad
        loss, metrics = compute_policy_loss(loss_mode, mb["old_log_prob"], log_prob,
                                            mb["advantages"], mb["response_mask"],
                                            loss_agg_mode, config,
                                            group_index=mb.get("group_index"), step=step)
        loss.backward()                                      # do NOT divide by len(mbs)
    optimizer.step()

Rules:
- Do not rescale the micro-batch losses (no ``/ len(mbs)``): the step's normalisers already
  make the sum over micro-batches the step loss.
- Data parallelism: ``compute_step_stats`` all-reduces (SUM) the local statistics, so every rank
  gets the same global ones. DDP/FSDP *average* gradients over ranks, so each rank's loss is
  multiplied by ``step.dp_size`` (the world size of the process group by default, as verl's
  ``agg_loss(..., dp_size)`` does); the average then equals the global gradient exactly. If you
  *sum* gradients yourself (``all_reduce(SUM)`` without dividing), pass ``dp_size=1``.
- ``group_index`` values must identify a prompt group across the whole step (all micro-batches
  and ranks): small non-negative integers, e.g. the prompt's index in the step's batch.
- ECHO: the pre-pass ``log_prob`` must come from the same parameters as the with-grad pass
  (same step, before ``optimizer.step()``), and with dropout off or the same dropout masks. The
  with-grad pass then uses R, kappa and the sum S = sum_{i,t} w_{i,t} rho_{i,t} dl/drho~ fixed
  by this pre-pass, plus a surrogate term S * kappa_mb(theta) whose gradient is this micro-batch's
  share of dkappa/dtheta; the sum over micro-batches is the full-batch autograd gradient.
- Extra per-token terms (e.g. beta * KL to the reference) are aggregated with
  ``step_agg_loss(kl_mat, mask, step, config, advantages=..., group_index=...)``: same
  normalisers, same ``dp_size``, so they are exact too.
- Rollout correction (``config.rollout_correction``, :mod:`echotrain.rl.correction`): give each
  micro-batch its ``rollout_log_prob`` and pass ``rollout_log_prob=mb["rollout_log_prob"]`` to
  ``compute_policy_loss``; aggregate extra terms with the corrected mask
  (``apply_rollout_correction(..., stats=step.correction).response_mask``), since rejected tokens
  leave the step's normalisers.
- Other loss modes need no pre-pass: their step statistics depend only on ``response_mask``,
  ``advantages`` and ``group_index``, so ``compute_step_stats`` can run before any forward pass.
- Metrics returned by ``compute_policy_loss`` are local to the micro-batch (clip fractions,
  ``ppo_kl``), except the ECHO batch metrics, which are the step's.

Testing without processes: ``compute_step_stats`` takes ``reduce_fn(tensor, op) -> tensor``
(``op`` is ``"sum"`` or ``"max"``), which replaces the all-reduce; tests use it to emulate
several ranks in threads of one process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from echotrain.rl.aggregation import AGG_MODES, BalancedStats, agg_loss, balanced_stats
from echotrain.rl.config import PolicyLossConfig, as_policy_loss_config
from echotrain.rl.correction import (
    NUM_SUMS,
    CorrectionInputs,
    RawCorrection,
    correction_inputs,
    local_sums,
    parse_rollout_correction,
    raw_correction,
)
from echotrain.rl.correction import finish as finish_correction
from echotrain.rl.objectives import PREPASS_LOSS_MODES, POLICY_LOSSES, loss_step_stats
from echotrain.rl.step import ReduceFn, StepBatch, StepStats
from echotrain.rl.validation import check_choice, check_group_index, check_token_inputs

__all__ = [
    "MAX_GROUP_IDS",
    "PREPASS_LOSS_MODES",
    "ReduceFn",
    "StepStats",
    "compute_step_stats",
    "needs_log_prob_prepass",
    "shard_batch",
    "split_micro_batches",
    "step_agg_loss",
]

#: Largest number of dense group ids a step may use (per-group sums are dense float64 vectors).
MAX_GROUP_IDS = 10_000_000


def needs_log_prob_prepass(loss_mode: str, config: PolicyLossConfig | Mapping[str, Any] | None = None) -> bool:
    """True if :func:`compute_step_stats` needs each micro-batch's current ``log_prob``: the loss's
    registration declares it (``LossStepStats.needs_log_prob``; ECHO)."""
    stats = loss_step_stats(loss_mode)  # raises on an unknown loss_mode
    return stats is not None and stats.needs_log_prob


def _default_reduce(process_group: Any) -> tuple[ReduceFn, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return (lambda t, op: t), 1

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=process_group)
        return t

    return reduce, dist.get_world_size(process_group)


def compute_step_stats(
    mbs: Sequence[Mapping[str, Any]],
    *,
    loss_mode: str,
    loss_agg_mode: str,
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    process_group: Any = None,
    reduce_fn: ReduceFn | None = None,
    dp_size: int | None = None,
) -> StepStats:
    """Sum one optimizer step's statistics over this rank's micro-batches and all-reduce them.

    Args:
        mbs: this rank's micro-batches; each a mapping with ``old_log_prob`` ``(b, T)``,
            ``advantages`` ``(b, T)`` or ``(b,)``, ``response_mask`` ``(b, T)``; plus
            ``log_prob`` ``(b, T)`` (current policy, no grad) for ECHO and ``group_index``
            ``(b,)`` (step-wide dense non-negative int ids) for ``balanced``; plus
            ``rollout_log_prob`` ``(b, T)`` (the sampler's log-probs) when
            ``config.rollout_correction`` is set: the correction's mask then replaces
            ``response_mask`` in every count, and its step statistics (batch normalisation,
            metrics) join the all-reduce as ``step.correction``.
        loss_mode: a name in :data:`echotrain.rl.POLICY_LOSSES`.
        loss_agg_mode: a name in :data:`echotrain.rl.AGG_MODES`.
        config: :class:`PolicyLossConfig` or dict (the one the losses will use).
        process_group: torch.distributed group for the all-reduce (default: the world).
        reduce_fn: ``f(tensor, op) -> tensor`` replacing the all-reduce (``op`` is "sum" or
            "max"); for tests and custom backends. Default: ``dist.all_reduce`` when
            torch.distributed is initialised, else identity (one process).
        dp_size: loss multiplier (int >= 1) for gradient-averaging data parallelism
            (DDP/FSDP). Default: the process group's world size with torch.distributed, else 1
            (also with ``reduce_fn``). Pass 1 if your gradient reduction sums instead of averaging.

    Returns:
        :class:`StepStats`.

    Raises:
        ValueError: unknown mode names; missing ``log_prob`` (ECHO) or ``group_index``
            (balanced); bad tensors (see :func:`echotrain.rl.compute_policy_loss`);
            ``seq-mean-token-sum-norm`` without ``config.norm_constant``; ``dp_size`` < 1.
    """
    check_choice("loss_mode", loss_mode, POLICY_LOSSES)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    cfg = as_policy_loss_config(config)
    if loss_agg_mode == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs config.norm_constant")
    if reduce_fn is None:
        reduce_fn, world = _default_reduce(process_group)
    else:
        world = 1
    if dp_size is not None and not (isinstance(dp_size, int) and dp_size >= 1):
        raise ValueError(f"dp_size must be an int >= 1 (or None for the world size), got {dp_size!r}")
    dp_size = world if dp_size is None else dp_size
    loss_stats = loss_step_stats(loss_mode)
    needs_log_prob = needs_log_prob_prepass(loss_mode)
    balanced = loss_agg_mode == "balanced"

    corr_names = parse_rollout_correction(cfg.rollout_correction)
    corr_raw: list[tuple[CorrectionInputs, RawCorrection]] = []
    prepared: list[StepBatch] = []
    device = None
    for k, mb in enumerate(mbs):
        for key in ("old_log_prob", "advantages", "response_mask") + (("log_prob",) if needs_log_prob else ()) + (
            ("group_index",) if balanced else ()
        ):
            if mb.get(key) is None:
                why = f" ({loss_mode} needs the no-grad pre-pass log_prob)" if key == "log_prob" else ""
                raise ValueError(f"micro-batch {k} has no {key!r}{why}")
        log_prob = mb["log_prob"].detach() if needs_log_prob else mb["old_log_prob"]
        adv, mask = check_token_inputs(mb["old_log_prob"], log_prob, mb["advantages"], mb["response_mask"])
        gi = mb.get("group_index")
        if balanced:
            check_group_index("group_index", gi, mask.shape[0])
            if mask.shape[0] and int(gi.min()) < 0:
                raise ValueError(f"micro-batch {k}: group_index must be non-negative step-wide group ids")
        if cfg.ba_scope == "batch" and gi is not None:
            gi = torch.zeros_like(gi)
        if corr_names:  # the corrected mask is the step's: counts, BA and the loss's statistics use it
            if mb.get("rollout_log_prob") is None:
                raise ValueError(f"micro-batch {k} has no 'rollout_log_prob' (rollout_correction="
                                 f"{cfg.rollout_correction!r} needs the sampler's per-token log-probs)")
            x = correction_inputs(mb["old_log_prob"], mb["rollout_log_prob"], adv, mask, cfg)
            corr_raw.append((x, raw_correction(corr_names, x, cfg)))
            mask = corr_raw[-1][1].keep
        prepared.append(StepBatch(mb["old_log_prob"].detach(), log_prob, adv.detach(), mask, gi))
        device = mask.device
    device = device or torch.device("cpu")
    f64 = dict(dtype=torch.float64, device=device)

    # Round 0: the number of group ids, so that every rank's per-group vectors line up.
    n_ids = 0
    if balanced:
        local = max([int(p.group_index.max()) + 1 for p in prepared if p.group_index.numel()] + [0])
        n_ids = int(reduce_fn(torch.tensor([float(local)], **f64), "max").item())
        if n_ids > MAX_GROUP_IDS:
            raise ValueError(
                f"group_index max is {n_ids - 1}: ids must be small dense integers (e.g. the prompt's index in "
                f"the step), at most {MAX_GROUP_IDS - 1}, because per-group sums are dense vectors"
            )

    # Round 1: plain sums (tokens, non-empty seqs, the loss's declared sums, BA's per-group sums), one all-reduce.
    n_loss = loss_stats.num_sums if loss_stats is not None else 0
    sums = torch.zeros(2, **f64)
    loss_sums = torch.zeros(n_loss, **f64)
    bal_vec = torch.zeros(6 * n_ids, **f64)
    for p in prepared:
        lengths = p.response_mask.sum(-1)
        sums[0] += lengths.sum()
        sums[1] += (lengths > 0).sum()
        if loss_stats is not None:
            loss_sums += loss_stats.local_sums(p, cfg)
        if balanced:
            bal_vec += balanced_stats(p.advantages, p.response_mask, p.group_index, num_group_ids=n_ids,
                                      count_zero_adv=cfg.ba_count_zero_adv).to_vector()
    n_corr = NUM_SUMS if corr_names else 0
    corr_sums = torch.zeros(n_corr, **f64)
    corr_max = torch.full((2,), float("-inf"), **f64)
    for x, raw in corr_raw:
        s_, m_ = local_sums(x, raw)
        corr_sums += s_.to(corr_sums.device)
        corr_max = torch.maximum(corr_max, m_.to(corr_max.device))
    both = reduce_fn(torch.cat([sums, loss_sums, corr_sums, bal_vec]), "sum")
    sums, loss_sums = both[:2], both[2:2 + n_loss]
    corr_sums, bal_vec = both[2 + n_loss:2 + n_loss + n_corr], both[2 + n_loss + n_corr:]
    correction = None
    if corr_names:  # the weights' min / max: one MAX round
        correction = finish_correction(corr_names, corr_sums, reduce_fn(corr_max, "max"), cfg)
        prepared = [p._replace(rollout_is_weights=raw.weights / correction.norm_factor)
                    for p, (_, raw) in zip(prepared, corr_raw)]
    step = StepStats(
        loss_mode=loss_mode,
        loss_agg_mode=loss_agg_mode,
        num_tokens=float(sums[0]),
        num_seqs=float(sums[1]),
        dp_size=dp_size,
        balanced=BalancedStats.from_vector(bal_vec) if balanced else None,
        config=cfg,
        correction=correction,
    )
    if loss_stats is None:
        return step
    # Round 2 and on (if the loss needs them): the loss's own statistics from the global sums.
    return replace(step, loss_stats=loss_stats.finish(loss_sums, prepared, step, reduce_fn))


def step_agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    step: StepStats,
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    advantages: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate an extra per-token loss (e.g. the KL term) of one micro-batch with the step's
    normalisers, exactly as the policy loss is aggregated (``step.loss_agg_mode``, ``dp_size``).

    Args:
        loss_mat: ``(b, T)`` per-token loss of this micro-batch.
        response_mask: ``(b, T)`` bool / 0-1.
        step: from :func:`compute_step_stats`.
        config: the policy-loss config (``norm_constant``, BA flags); default: ``step.config``.
        advantages, group_index: this micro-batch's, for ``balanced``.

    Returns:
        0-d tensor; summed over micro-batches (and ranks) it equals :func:`agg_loss` of the step.

    Raises:
        ValueError: as :func:`echotrain.rl.agg_loss` (e.g. ``balanced`` without ``advantages``);
            ``config`` differs from the one ``step`` was computed with.
    """
    cfg = step.config if config is None and step.config is not None else as_policy_loss_config(config)
    if step.config is not None and cfg != step.config:
        raise ValueError(f"config {cfg} differs from the one step was computed with ({step.config})")
    return agg_loss(
        loss_mat,
        response_mask,
        step.loss_agg_mode,
        advantages=advantages,
        group_index=group_index,
        dp_size=step.dp_size,
        **step.agg_kwargs(cfg),
    )


def split_micro_batches(batch: Mapping[str, Any], micro_batch_size: int | Sequence[int]) -> list[dict[str, Any]]:
    """Split a batch (mapping of tensors with a leading batch dim) into micro-batches.

    Args:
        batch: tensors of shape ``(B, ...)``; non-tensor values are copied to every piece.
        micro_batch_size: rows per micro-batch (the last may be shorter), or a list of sizes
            summing to B.

    Returns:
        list of dicts (views of the input tensors).

    Raises:
        ValueError: tensors with different leading sizes, sizes not summing to B, size < 1.
    """
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    sizes_b = {v.shape[0] for v in tensors.values()}
    if len(sizes_b) != 1:
        raise ValueError(f"batch tensors have different leading sizes: { {k: v.shape[0] for k, v in tensors.items()} }")
    (B,) = sizes_b
    if isinstance(micro_batch_size, int):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        sizes = [min(micro_batch_size, B - s) for s in range(0, B, micro_batch_size)]
    else:
        sizes = list(micro_batch_size)
        if sum(sizes) != B or any(s < 0 for s in sizes):
            raise ValueError(f"micro-batch sizes {sizes} must be >= 0 and sum to the batch size {B}")
    parts = {k: torch.split(v, sizes) for k, v in tensors.items()}
    rest = {k: v for k, v in batch.items() if k not in tensors}
    return [{**rest, **{k: p[j] for k, p in parts.items()}} for j in range(len(sizes))]


def shard_batch(batch: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's contiguous shard of ``batch`` (``torch.tensor_split`` along dim 0).

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return {k: (torch.tensor_split(v, world_size)[rank] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
