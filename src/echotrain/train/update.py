"""Steps 4-5 of a training step: log-probs and the policy update (one optimizer step per mini-batch).

Per PPO epoch the step's prompt groups are shuffled and split into ``num_mini_batches``
mini-batches of whole groups (:func:`mini_batch_splits`). Each mini-batch is one optimizer
step (:func:`update_mini_batch`): split into micro-batches (:func:`echotrain.rl.split_micro_batches`;
with torchrun each rank takes its whole groups first), [ECHO pre-pass: a no-grad forward, or the
with-grad forwards run first with their graphs kept (``log_prob_prepass``)] -> step-global
statistics (:func:`echotrain.rl.compute_step_stats`) -> per micro-batch forward,
``compute_policy_loss(..., step=stats)`` (+ KL and, with a teacher, the distillation term
aggregated with the same normalisers: train/distill.py) and
``backward`` -> all-reduce (sum) of the gradients -> clip grad norm -> optimizer step -> scheduler
step. With ``optimizer=sam`` / ``late_sam`` the passes and the clipping form a closure that SAM
calls twice (at w and at w + e; Foret et al. 2021, arXiv 2010.01412).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from echotrain.metrics import StepMetrics, declare_metric
from echotrain.optim.sam import SAM
from echotrain.rl import compute_policy_loss, compute_step_stats, kl_penalty, needs_log_prob_prepass, step_agg_loss
from echotrain.rl.config import PolicyLossConfig
from echotrain.rl.correction import apply_rollout_correction, parse_rollout_correction
from echotrain.rl.distill import distill_token_divergence
from echotrain.rl.entropy import entropy_bonus
from echotrain.rl.stepwise import split_micro_batches
from echotrain.train.config import TrainConfig
from echotrain.train.config.schema import LOG_PROB_PREPASSES
from echotrain.train.dist import DistContext
from echotrain.train.distill import DISTILL_KL
from echotrain.runtime.rollout import RolloutBatch, forward_log_probs
from echotrain.train.step import StepData

ENTROPY_CURRENT = declare_metric(
    "entropy/current", reduce="token_mean", unit="nats per token",
    when="entropy_coeff, entropy_coef or use_adaptive_entropy",
    help="mean token entropy of the policy being updated over the loss's tokens (the entropy term's H)",
    label="current policy (entropy term)", panel="Entropy")
ENTROPY_COEF = declare_metric(
    "entropy/coef", reduce="last", unit="coefficient", when="entropy_coeff, entropy_coef or use_adaptive_entropy",
    help="the entropy coefficient the last optimizer step applied (adaptive: 0 while entropy > entropy_target)",
    label="applied coefficient", panel="Entropy coefficient")
KL_REF = declare_metric("kl/ref", reduce="token_mean", unit="nats per token", when="kl_coef > 0",
                        help="mean KL estimate (kl_penalty) of the policy to the reference over valid tokens",
                        label="KL to reference", panel="Policy drift")
GRAD_NORM = declare_metric("grad_norm", reduce="mean", unit="global L2 norm", summary=True,
                           help="global gradient norm before clipping", label="before clipping",
                           panel="Gradient norm")
KL_BEHAVIOUR_CURRENT = declare_metric(
    "rollout_corr/kl_current", reduce="token_mean", unit="nats per token", when="every step (rollout_log_prob recorded)",
    help="k1 KL(mu || pi_theta): mean (rollout_log_prob - log_prob) over the loss's tokens (after any rejection) at "
         "each update's forward, the behaviour policy against the weights being updated; per mini-batch without "
         "rejection it is KL(mu || pi_old) of those tokens plus the drift since pi_old",
    label="KL(rollout || current), k1", panel="Policy drift")
LR = declare_metric("lr", reduce="last", unit="learning rate", help="learning rate of the last optimizer step")
SAM_ACTIVE = declare_metric("sam/active", reduce="mean", unit="fraction of updates", when="optimizer=sam/late_sam",
                            help="share of the step's optimizer updates that were SAM steps")

#: ``forward(model, batch, with_entropy=False, grad=False) -> (log_prob (b, T), entropy (b, T) | None)``
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def entropy_in_loss(cfg: TrainConfig) -> bool:
    """Whether the loss has an entropy term (``entropy_coeff``, ``entropy_coef`` or
    ``use_adaptive_entropy``): the update's forward then returns the entropy with grad."""
    return bool(cfg.entropy_coeff or cfg.entropy_coef or cfg.use_adaptive_entropy)


def policy_log_probs(model: Any, batch: RolloutBatch, cfg: TrainConfig, with_entropy: bool = False,
                     grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(b, T)`` (and entropy) of ``batch``'s response tokens at ``cfg.temperature``,
    with grad if ``grad`` (the entropy too when the loss has an entropy term); on the model's device. Under gradient checkpointing the with-grad
    pass shares the prompt only through the packed layout (``pack_responses``), not the KV cache."""
    checkpointing = contextlib.nullcontext()
    if grad and cfg.gradient_checkpointing:
        from echotrain.train.features import checkpointed_forward

        checkpointing = checkpointed_forward(model)
    with torch.set_grad_enabled(grad), checkpointing:
        # (attended_mask: an episode's response_mask has holes on the environment's tokens, which
        # the forward still attends to; the log-probs there are ignored by the loss)
        return forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                 batch.attended_mask, temperature=cfg.temperature, with_entropy=with_entropy,
                                 entropy_grad=grad and entropy_in_loss(cfg),
                                 share_prefix=cfg.share_prompt_prefix, pack=cfg.pack_responses,
                                 packed_attention=cfg.packed_attention,
                                 # transformers turns the KV cache off under checkpointing
                                 kv_cache=not (grad and cfg.gradient_checkpointing))


@torch.no_grad()
def batched_log_probs(forward: Forward, model: Any, batch: RolloutBatch, micro_batch_size: int, dist: DistContext,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad log-probs (and entropy) of all rows, in micro-batches; (N, T) float32 on CPU.

    With several processes each rank computes its contiguous share of the rows and all
    ranks receive all of them."""
    lps, ents = [], []
    mine = dist.shard(len(batch))
    for idx in torch.arange(mine.start, mine.stop).split(micro_batch_size):
        if not len(idx):  # this rank has no rows (fewer groups than processes)
            continue
        lp, ent = forward(model, batch.select(idx), with_entropy=with_entropy)
        lps.append(lp.cpu())
        if ent is not None:
            ents.append(ent.cpu())
    if dist.enabled:
        parts = dist.gather((lps, ents))
        lps, ents = [t for p in parts for t in p[0]], [t for p in parts for t in p[1]]
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def sampler_is_learner(cfg: TrainConfig, autocast_dtype: torch.dtype | None, param_dtype: torch.dtype) -> bool:
    """Whether the sampler's ``rollout_log_prob`` are the old log-probs up to float rounding, so
    ``reuse_sampler_log_probs`` takes them: the setting is on, the rollouts were sampled by the
    learner's current weights (``staleness=0``, no ``async_rollouts``), in float32 (float32
    parameters, no autocast: bfloat16 rounds the cached decode and the packed update apart by
    ~1e-2), and no ``rollout_correction`` is set (its ratio pi_old / mu would be 1 by construction)."""
    return (cfg.reuse_sampler_log_probs and cfg.staleness == 0 and not cfg.async_rollouts and autocast_dtype is None
            and param_dtype == torch.float32 and not parse_rollout_correction(cfg.rollout_correction))


def old_log_probs(batched: Callable[[RolloutBatch], tuple[torch.Tensor, torch.Tensor]], batch: RolloutBatch,
                  first_rows: torch.Tensor | None,
                  sampled: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Old log-probs and entropy ``(N, T)`` of the rollout policy, from ``batched(rows)`` (no grad).

    ``first_rows`` (``reuse_on_policy_log_probs``): the first update's rows, left as 0
    placeholders because its with-grad forward supplies them (:func:`update_mini_batch` with
    ``fill_old``); None computes all rows. ``sampled`` (``reuse_sampler_log_probs``, only with
    ``first_rows``): the sampler's own ``(rollout_log_prob, rollout_entropy)`` ``(N, T)`` float32,
    taken for the other rows instead of ``batched`` when the sampler ran the learner's weights in
    the learner's precision (the same numbers up to float rounding)."""
    if first_rows is None:
        return batched(batch)
    if len(first_rows) == len(batch):
        old_log_prob = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        return old_log_prob, torch.zeros_like(old_log_prob)
    rest = torch.ones(len(batch), dtype=torch.bool)
    rest[first_rows] = False
    rest = rest.nonzero().squeeze(-1)
    if sampled is not None:
        lp_rest, ent_rest = sampled[0][rest].float(), sampled[1][rest].float()
    else:
        lp_rest, ent_rest = batched(batch.select(rest))
    old_log_prob = torch.zeros(len(batch), lp_rest.shape[1], dtype=lp_rest.dtype)
    entropy = torch.zeros_like(old_log_prob)
    old_log_prob[rest], entropy[rest] = lp_rest, ent_rest
    return old_log_prob, entropy


def retains_prepass_graph(setting: str) -> bool:
    """Whether an off-policy mini-batch's log-prob pre-pass (ECHO's batch ratio: losses whose
    step statistics read the current ``log_prob``) comes from its with-grad forwards, run for
    every micro-batch first with their graphs kept (``retain``: one forward of the mini-batch
    less; the activations of the whole mini-batch are held at once), or from a separate no-grad
    forward (``forward``, the default: one micro-batch's activations at a time). On the default
    job on a 2-core CPU ``retain`` was no faster (docs/benchmarks.md, "Three passes fewer in the
    update"; why is not measured). Both compute the same
    log-probs: bit for bit when the two passes use the same layout, up to float rounding when
    they do not (gradient checkpointing without the packed layout: the no-grad pass shares the
    prompt through the KV cache, the with-grad pass runs it per row).

    Raises:
        ValueError: ``setting`` is not one of :data:`LOG_PROB_PREPASSES`.
    """
    if setting not in LOG_PROB_PREPASSES:
        raise ValueError(f"log_prob_prepass must be one of {LOG_PROB_PREPASSES}, got {setting!r}")
    return setting == "retain"


def mini_batch_splits(group_index: torch.Tensor, num_mini_batches: int, ppo_epochs: int,
                      dist: DistContext) -> list[torch.Tensor]:
    """Row indices of each mini-batch, epoch after epoch: a random permutation of the groups
    (``torch.randperm``, drawn by rank 0 and broadcast) cut into ``min(num_mini_batches, n_groups)``
    parts of whole groups. ``group_index``: (N,) dense int64 group ids."""
    n_groups = int(group_index.max()) + 1
    splits = []
    for _epoch in range(ppo_epochs):
        group_perm = dist.broadcast(torch.randperm(n_groups) if dist.is_main else None)
        splits += [torch.isin(group_index, groups).nonzero().squeeze(-1)
                   for groups in group_perm.tensor_split(min(num_mini_batches, n_groups))]
    return splits


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a mini-batch: ``rows`` (b,) index the step's rows; ``batch`` holds their
    tokens; the others are those rows of :class:`~echotrain.train.step.StepData` (``group_index``
    dense over the mini-batch); ``log_prob`` is the ECHO pre-pass (None otherwise)."""

    rows: torch.Tensor
    batch: RolloutBatch
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    ref_log_prob: torch.Tensor | None = None
    log_prob: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None
    teacher_top_values: torch.Tensor | None = None
    teacher_top_indices: torch.Tensor | None = None

    @property
    def group_index(self) -> torch.Tensor:
        """(b,) int64 group ids, dense over the mini-batch (the batch's own)."""
        return self.batch.group_index

    def stats_inputs(self) -> dict[str, torch.Tensor | None]:
        """The tensors :func:`echotrain.rl.compute_step_stats` reads."""
        return dict(old_log_prob=self.old_log_prob, advantages=self.advantages, response_mask=self.response_mask,
                    group_index=self.group_index, log_prob=self.log_prob, rollout_log_prob=self.rollout_log_prob)


def micro_batches(data: StepData, rows: torch.Tensor, micro_batch_size: int, dist: DistContext) -> list[MicroBatch]:
    """The micro-batches of the mini-batch ``rows`` on this rank (its whole groups of the
    mini-batch under torchrun; possibly none, the rank still joins the collectives)."""
    batch = data.batch.select(rows)
    _, batch.group_index = torch.unique(batch.group_index, return_inverse=True)
    if dist.enabled:  # this rank's whole groups of the mini-batch (step-wide group ids kept)
        mine = dist.shard(int(batch.group_index.max()) + 1 if len(batch) else 0)
        local = ((batch.group_index >= mine.start) & (batch.group_index < mine.stop)).nonzero().squeeze(-1)
        rows, batch = rows[local], batch.select(local)
    token_fields = [f.name for f in dataclasses.fields(RolloutBatch)]
    tensors = {"rows": rows, "old_log_prob": data.old_log_prob[rows], "advantages": data.advantages[rows],
               "response_mask": data.response_mask[rows],
               **{"batch." + k: getattr(batch, k) for k in token_fields}}
    if data.ref_log_prob is not None:
        tensors["ref_log_prob"] = data.ref_log_prob[rows]
    if data.rollout_log_prob is not None:
        tensors["rollout_log_prob"] = data.rollout_log_prob[rows]
    if data.teacher_top_values is not None:  # distill_top_k > 0: the teacher's stored top-k
        tensors["teacher_top_values"] = data.teacher_top_values[rows]
        tensors["teacher_top_indices"] = data.teacher_top_indices[rows]
    return [MicroBatch(batch=RolloutBatch(**{k: mb.pop("batch." + k) for k in token_fields}), **mb)
            for mb in split_micro_batches(tensors, micro_batch_size)]


def update_mini_batch(data: StepData, rows: torch.Tensor, *, cfg: TrainConfig, loss_config: PolicyLossConfig,
                      model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, dist: DistContext,
                      forward: Forward, on_policy: bool = False, fill_old: bool = False,
                      entropy_coef: float | None = None, distill: Any = None) -> dict[str, float]:
    """One optimizer step on the sequences ``rows`` of the step's data, exactly micro-batched.

    ``on_policy``: no optimizer step has happened since the old log-probs were computed (the
    first mini-batch of the first epoch), so the ECHO pre-pass is the old log-probs themselves.
    ``fill_old`` (on-policy only, ``reuse_on_policy_log_probs``): ``data.old_log_prob`` and
    ``data.entropy`` of ``rows`` are not computed yet; the with-grad forward supplies them
    (detached, written into ``data``), and the step statistics use ratio 1 (old = current = 0
    placeholders). ``forward`` is :func:`policy_log_probs` (or a wrapper of it).
    ``entropy_coef``: the entropy bonus's coefficient for this optimizer step (docs/design/
    objectives.md §11): ``cfg.entropy_coeff`` (verl, aggregated by ``loss_agg_mode``) when that is
    set, else TRL's token-mean bonus with this value (the trainer's adaptive state); None: no term.
    ``distill``: on-policy distillation's term (docs/design/objectives.md §12), an object with
    ``coeff``, ``beta``, ``objective``, ``student_log_softmax(model, batch)`` (the policy's ``(b, T, V)``
    log-softmax with grad: then the update's forward, its log-probs gathered from it) and
    ``log_softmax(batch)`` (the teacher's, no grad; used unless the micro-batch carries the teacher's
    stored top-k); the term ``coeff x step_agg_loss(divergence)`` is aggregated like the KL term, with
    the step's normalisers, so it is exact over micro-batches. ``objective="distill"``: the policy
    loss is not computed (its advantages are 0), the loss is the distillation term (+ KL / entropy
    terms if set). None: no term.

    Returns this optimizer step's metrics (each reduced over the micro-batches as declared in
    :mod:`echotrain.metrics`), ``grad_norm``, ``lr`` and, with
    SAM, ``sam/active``. With SAM the forward/backward passes run twice (closure at w and at
    w + e) and the metrics are those of the first pass; the step statistics (ECHO's R, BA's
    group counts) stay those at w.

    Raises:
        ValueError: ``fill_old`` without ``on_policy``.
    """
    if fill_old and not on_policy:
        raise ValueError("fill_old needs an on-policy update")
    mbs = micro_batches(data, rows, cfg.micro_batch_size, dist)
    # the with-grad forwards already run for the pre-pass (log_prob_prepass=retain), consumed once
    retained: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(mbs)
    if needs_log_prob_prepass(cfg.loss_mode, loss_config):
        if on_policy:  # same parameters as the old-log-prob pass: reuse it (saves one forward)
            for mb in mbs:
                mb.log_prob = mb.old_log_prob.clone()
        elif retains_prepass_graph(cfg.log_prob_prepass) and distill is None:
            # every micro-batch's with-grad forward now, graphs kept: their detached log-probs are
            # the pre-pass, and the loss below reuses them (one forward of the mini-batch less)
            retained = [forward(model, mb.batch, grad=True, with_entropy=entropy_coef is not None) for mb in mbs]
            for mb, (log_prob, _) in zip(mbs, retained):
                mb.log_prob = log_prob.detach().cpu()
        else:
            with torch.no_grad():
                for mb in mbs:
                    mb.log_prob = forward(model, mb.batch)[0].cpu()
    # all-reduced over ranks when torch.distributed is initialised; dp_size=1 because
    # dist.all_reduce_grads sums the ranks' gradients (each rank's loss is its share of the step's)
    stats = compute_step_stats([mb.stats_inputs() for mb in mbs], loss_mode=cfg.loss_mode,
                               loss_agg_mode=cfg.loss_agg_mode, config=loss_config, dp_size=1)
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    first: dict[str, float] = {}

    def closure() -> torch.Tensor:
        """Forward + backward over all micro-batches, then clip; metrics of the first call."""
        acc = StepMetrics()  # each key reduced over the micro-batches as its declaration says
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            student_all = None
            if distill is not None:  # the full distributions (with grad); the log-probs gathered from them
                student_all = distill.student_log_softmax(model, mb.batch)
                log_prob = torch.gather(student_all, -1, mb.batch.response_ids.to(student_all.device).unsqueeze(-1)
                                        ).squeeze(-1)
                ent = None
                if fill_old or entropy_coef is not None:
                    with contextlib.nullcontext() if entropy_coef is not None else torch.no_grad():
                        ent = -(student_all.exp() * student_all).sum(-1)
            elif retained[i] is not None:  # the pre-pass's forward (first call only: SAM's at w + e runs its own)
                (log_prob, ent), retained[i] = retained[i], None
            else:
                log_prob, ent = forward(model, mb.batch, grad=True, with_entropy=fill_old or entropy_coef is not None)
            if fill_old:  # on-policy: the old log-probs are these, and no update has happened yet
                mb.old_log_prob = log_prob.detach().cpu()
                data.old_log_prob[mb.rows] = mb.old_log_prob
                data.entropy[mb.rows] = ent.detach().cpu()
            mask = mb.response_mask.to(log_prob.device)
            advantages, group_index = mb.advantages.to(log_prob.device), mb.group_index.to(log_prob.device)
            old = mb.old_log_prob.to(log_prob.device)
            extra: dict[str, Any] = {}
            if stats.correction is not None:  # rollout_correction: its mask is the KL term's too
                corrected = apply_rollout_correction(old, mb.rollout_log_prob.to(log_prob.device), advantages, mask,
                                                     loss_config, stats=stats.correction)
                mask = corrected.response_mask.to(mask.dtype)
                extra["rollout_is_weights"] = corrected.rollout_is_weights
            if distill is not None and distill.objective == "distill":  # advantages 0: no policy loss
                loss, m = log_prob.sum() * 0.0, {}
            else:
                loss, m = compute_policy_loss(
                    cfg.loss_mode, old, log_prob, advantages,
                    mask, cfg.loss_agg_mode, loss_config, group_index=group_index, step=stats, **extra)
            if stats.correction is not None:
                m = {**m, **corrected.metrics}
            if mb.rollout_log_prob is not None:
                d = torch.where(mask.bool(), mb.rollout_log_prob.to(log_prob.device) - log_prob.detach(), 0)
                m = {**m, KL_BEHAVIOUR_CURRENT.name: float(d.sum() / mask.sum().clamp(min=1))}
            if mb.ref_log_prob is not None:  # kl_coef > 0 (a reference copy, or LoRA adapters off)
                kl_mat = kl_penalty(log_prob, mb.ref_log_prob.to(log_prob.device), cfg.kl_penalty)
                # aggregated exactly like the policy loss, with the step's normalisers
                kl_loss = step_agg_loss(kl_mat, mask, stats, loss_config, advantages=advantages,
                                        group_index=group_index)
                loss = loss + cfg.kl_coef * kl_loss
                kl_mean = torch.where(mask.bool(), kl_mat.detach(), 0).sum() / mask.sum().clamp(min=1)
                m = dict(m, **{"kl/ref": float(kl_mean)})
            if distill is not None:  # on-policy distillation: divergence to the teacher, aggregated like KL
                if mb.teacher_top_values is not None:
                    div = distill_token_divergence(
                        student_all, beta=distill.beta, teacher_values=mb.teacher_top_values.to(student_all.device),
                        teacher_indices=mb.teacher_top_indices.to(student_all.device))
                else:
                    div = distill_token_divergence(student_all, beta=distill.beta,
                                                   teacher_log_prob=distill.log_softmax(mb.batch).to(student_all.device))
                div = torch.where(mask.bool(), div, 0.0)
                loss = loss + distill.coeff * step_agg_loss(div, mask, stats, loss_config, advantages=advantages,
                                                            group_index=group_index)
                m = {**m, DISTILL_KL.name: float(div.detach().sum() / mask.sum().clamp(min=1))}
                del student_all
            if entropy_coef is not None:  # the entropy term, from this forward's entropy (with grad)
                if ent is None:  # the retained pre-pass forward ran without entropy
                    raise RuntimeError("the entropy term needs the update's forward to return the entropy")
                h = entropy_bonus(ent, mask, stats, "loss_agg_mode" if cfg.entropy_coeff else "token-mean",
                                  advantages=advantages, group_index=group_index)
                loss = loss - entropy_coef * h
                h_mean = torch.where(mask.bool(), ent.detach(), 0).sum() / mask.sum().clamp(min=1)
                m = {**m, ENTROPY_CURRENT.name: float(h_mean), ENTROPY_COEF.name: float(entropy_coef)}
            loss.backward()
            total += loss.detach().float().cpu()
            acc.add(m, float(mask.sum()))
        dist.all_reduce_grads(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if not first:  # SAM calls this twice; the metrics are those at w, not at w + e
            step_acc = acc
            if dist.enabled:  # over the whole step, as in one process
                step_acc = StepMetrics()
                for part in dist.gather(acc):
                    step_acc.merge(part)
            first.update(step_acc.result())
            first["grad_norm"] = float(grad_norm)
        return total

    out = {"lr": scheduler.get_last_lr()[0]}
    if isinstance(optimizer, SAM):  # SAM and LateSAM: step() zeroes the grads and calls the closure
        # 1 if this update is a SAM step (always for sam; from sam_start on for late_sam)
        out["sam/active"] = float(getattr(optimizer, "sam_active", lambda: True)())
        optimizer.step(closure)
    else:
        optimizer.zero_grad(set_to_none=True)
        closure()
        optimizer.step()
    scheduler.step()
    return {**first, **out}
