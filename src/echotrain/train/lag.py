"""Fixed-lag rollouts (``staleness=k``): step t trains on rollouts sampled by the weights of step t - k.

The study axis of off-policy RL (AReaL's ``max_head_offpolicyness``, prime-rl's
``max_off_policy_steps``, PipelineRL's ``max_lag``), made deterministic. Versions count training
steps: the weights at the start of step t have version ``t - 1`` (t - 1 steps of updates, each of
``num_mini_batches x ppo_epochs`` optimizer steps); "the weights of step s" are those that sample
step s's rollouts in a synchronous run, version ``s - 1``.

Mechanism (our choice, a documented flag): the trainer *generates ahead* into a queue instead of
keeping old weights. At step t, with the weights of step t (version t - 1), it generates and scores
the rollouts of step t + k and puts them at the back of the queue; then it trains on the queue's
front, the rollouts of step t, which were generated k steps earlier by the weights of step t - k.
At step 1 it fills the queue with the rollouts of steps 1 .. k + 1, all from the initial weights,
so for t <= k the rollouts come from the initial weights (version 0) and the staleness of step t
is ``min(k, t - 1)``. The last k steps generate too, for steps past ``steps`` (our choice, a
documented flag): the queue then always holds the next k steps' rollouts, the final checkpoint
included, so ``--resume RUN steps=N`` continues at lag k exactly as an uninterrupted N-step run
(staleness 0, 1, 2, 2, 2, 2 for 3 + 3 steps at k = 2, not 0, 1, 2, 0, 1, 2) and a run of N steps
is the first N steps of a longer one (the same random draws). The cost: k batches generated that
a run which is not continued never trains on (k / steps of the generation, 2 / 150 on the
testbed). A checkpoint of an earlier echotrain (a finished run's queue empty) still resumes: the
missing batches are generated with the current weights, and the run's first line says so
(:attr:`LaggedRollouts.resume_note`).

This gives exactly the rollouts that k weight snapshots would (the same weights sample the same
prompt draws, in the same order) at a fraction of the memory: the queue holds k rollout batches
(token ids, masks, rewards, behaviour log-probs: ``staleness/queue_mb``, ~0.12 MB per batch on
the default job: 64 rows, 89 prompt and 32 response tokens) instead of k copies of the trainable weights (k x 540 MB for SmolLM2-135M in float32),
with LoRA or without. The queue is part of the checkpoint (written atomically with it), so a
resume continues exactly. Under torchrun every rank holds the whole (gathered) rollout batch, so
each rank's queue is the same and rank 0's copy in the checkpoint restores all of them.

By default the learner recomputes ``old_log_prob`` with its own weights (the proximal policy of
decoupled PPO, Hilton et al. 2022, arXiv 2110.00641; AReaL, arXiv 2505.24298); the sampler's
per-token log-probs travel with the rollouts as ``rollout_log_prob`` (the behaviour policy), and
``rollout_version`` records the version of the weights that sampled each rollout
(``recompute_old_log_prob=false`` trains against the sampler's log-probs instead).

Metrics (added to each ``metrics.jsonl`` record when ``staleness > 0``; a synchronous run has
none of them, so its records are unchanged) are declared in :data:`STALENESS_METRICS`. With
``staleness > 0`` the step's ``time/generation`` and ``time/scoring`` are the seconds the step
spent generating (the batches of later steps: k + 1 of them at step 1, one at each later step),
and ``entropy`` / ``ppo_kl`` are the learner's on the older weights' rollouts. KL(old || current)
is the existing ``ppo_kl``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from echotrain.metrics import Metric, declare_metric
from echotrain.runtime.rollout import RolloutBatch
from echotrain.train.step import StepData

#: The metrics this module adds (only with ``staleness > 0``), declared in the metric schema.
STALENESS_METRICS: dict[str, Metric] = {m.name: m for m in (
    declare_metric("staleness/min", reduce="step", unit="training steps", when="staleness > 0 or async_rollouts=true",
                   help="learner version minus rollout_version (the weights that sampled the rollout) (min over the step's rollouts)"),
    declare_metric("staleness/mean", reduce="step", unit="training steps", when="staleness > 0 or async_rollouts=true", panel="Staleness", label="mean staleness (steps)",
                   help="as staleness/min, averaged (mean over the step's rollouts)"),
    declare_metric("staleness/max", reduce="step", unit="training steps", when="staleness > 0 or async_rollouts=true", panel="Staleness", label="max staleness (steps)",
                   help="as staleness/min, the largest (max over the step's rollouts)"),
    declare_metric("staleness/token_mean", reduce="step", unit="training steps",
                   when="staleness > 0 or async_rollouts=true",
                   help="as staleness/mean, weighted by each rollout's trained tokens (response_mask): the staleness "
                        "of the average trained token (verl's token-weighted figure; differs from the per-sample mean "
                        "when rollouts of different ages and lengths share a step)"),
    declare_metric("staleness/queue_depth", reduce="step", unit="rollout batches", when="staleness > 0",
                   help="batches generated ahead for later steps, held in the queue (value after the step)"),
    declare_metric("staleness/queue_mb", reduce="step", unit="MiB", when="staleness > 0",
                   help="memory of the queued batches' tensors (value after the step)"),
)}


def staleness_summary(step: int, data: StepData) -> dict[str, float]:
    """``staleness/min|mean|max|token_mean`` of step ``step`` (1-based) trained on ``data``: the lag
    of each rollout is ``(step - 1) - data.rollout_version`` (training steps since the weights that
    sampled it); ``token_mean`` weights each rollout by its trained tokens (``data.response_mask``
    row sums, ``data.batch.response_mask`` before the trainer sets the loss mask; the per-sample
    mean when no rollout has a token)."""
    lag = ((step - 1) - data.rollout_version).double()
    mask = data.response_mask if data.response_mask is not None else data.batch.response_mask
    tokens = mask.double().sum(-1)
    token_mean = float((lag * tokens).sum() / tokens.sum()) if tokens.sum() > 0 else float(lag.mean())
    return {"staleness/min": float(lag.min()), "staleness/mean": float(lag.mean()), "staleness/max": float(lag.max()),
            "staleness/token_mean": token_mean}


class StalenessMismatch(RuntimeError):
    """A resume whose ``staleness`` differs from the checkpoint's (its queue is for another lag)."""


def _tensor_bytes(data: StepData) -> int:
    """Bytes of the tensors of one queued :class:`StepData` (its rollout batch included)."""
    total = 0
    for obj in (data, data.batch):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _on_cpu(data: StepData) -> StepData:
    """``data`` with every tensor on the CPU (a checkpoint may be loaded onto the policy's device)."""
    def moved(obj: Any) -> dict[str, Any]:
        return {f.name: getattr(obj, f.name).cpu() for f in dataclasses.fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor)}

    return dataclasses.replace(data, batch=dataclasses.replace(data.batch, **moved(data.batch)), **moved(data))


def _steps(a: int, b: int) -> str:
    """'step 5 is' or 'steps 4-5 are'."""
    return f"step {a} is" if a == b else f"steps {a}-{b} are"


class LaggedRollouts:
    """The rollouts of each training step, sampled ``staleness`` steps earlier (module docstring).

    Args:
        collect: ``collect() -> StepData``: one step's rollouts and rewards with the current
            weights (:meth:`echotrain.train.collect.Collector.collect`).
        staleness: k >= 0; 0 calls ``collect`` at each step (the synchronous trainer).
        steps: the run's last step (the queue is filled k steps beyond it all the same; ``steps``
            only dates the note of a resumed queue that was not).
        behaviour_log_prob: ``fn(batch) -> (N, T) float32`` no-grad log-probs of the current
            weights; used right after generation (k > 0) when the generation function did not
            record ``rollout_log_prob`` itself. None: leave it unset.

    Raises:
        ValueError: ``staleness < 0``.
    """

    def __init__(self, collect: Callable[[], StepData], staleness: int, steps: int,
                 behaviour_log_prob: Callable[[RolloutBatch], torch.Tensor] | None = None):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.collect, self.staleness, self.steps = collect, int(staleness), int(steps)
        self.behaviour_log_prob = behaviour_log_prob
        #: (target step, its rollouts), oldest first; targets are consecutive
        self.queue: list[tuple[int, StepData]] = []
        #: the next step whose rollouts are to be generated
        self.next_target = 1
        #: set by :meth:`load_state_dict` when the checkpoint's queue is short (the lag restarts)
        self.resume_note: str | None = None

    def _generate(self, version: int) -> StepData:
        data = self.collect()
        data.rollout_version = torch.full((len(data),), version, dtype=torch.long)
        return data

    def rollouts_for(self, step: int) -> StepData:
        """The rollouts step ``step`` (1-based) trains on, with ``rollout_version`` set.

        k = 0: generated now (version ``step - 1``). k > 0: first generate, with the current
        weights (version ``step - 1``), every step up to ``step + k`` not generated yet (steps
        1 .. k + 1 at step 1, else step + k; past ``steps`` too), then return the queue's front. The returned
        ``time_generation`` / ``time_scoring`` are the seconds spent generating and scoring in
        this call (for the later steps), not those of the returned batch.

        Raises:
            RuntimeError: the queue does not start at ``step`` (steps called out of order).
        """
        version = step - 1
        if self.staleness == 0:
            return self._generate(version)
        self.next_target = max(self.next_target, step)
        t_gen = t_score = 0.0
        while self.next_target <= step + self.staleness:
            data = self._generate(version)
            t_gen, t_score = t_gen + data.time_generation, t_score + data.time_scoring
            if data.rollout_log_prob is None and data.batch.rollout_log_prob is not None:
                data.rollout_log_prob = data.batch.rollout_log_prob  # recorded inside generation
            if data.rollout_log_prob is None and self.behaviour_log_prob is not None:
                t0 = time.perf_counter()
                data.rollout_log_prob = self.behaviour_log_prob(data.batch)
                t_gen += time.perf_counter() - t0
            self.queue.append((self.next_target, data))
            self.next_target += 1
        target, data = self.queue.pop(0)
        if target != step:
            raise RuntimeError(f"rollout queue holds step {target}'s rollouts, expected step {step}'s")
        data.time_generation, data.time_scoring = t_gen, t_score
        return data

    def after_step(self, step: int) -> None:
        """Nothing: the queue is filled by :meth:`rollouts_for` (the async worker's counterpart
        publishes the weights here)."""

    def close(self) -> None:
        """Nothing to stop (no worker process)."""

    def step_metrics(self, step: int, data: StepData, step_seconds: float | None = None) -> dict[str, float]:
        """The :data:`STALENESS_METRICS` of step ``step`` trained on ``data`` (after its update, so
        ``old_log_prob`` is complete); ``{}`` when ``staleness == 0``. KL(behaviour || old) is
        ``rollout_corr/kl``, logged every step (:func:`echotrain.rl.correction.rollout_mismatch_metrics`)."""
        if self.staleness == 0:
            return {}
        out = staleness_summary(step, data)
        out["staleness/queue_depth"] = float(len(self.queue))
        out["staleness/queue_mb"] = sum(_tensor_bytes(d) for _, d in self.queue) / 2**20
        return out

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint stores: the lag, the queued batches and the next step to generate."""
        return {"staleness": self.staleness, "next_target": self.next_target, "queue": list(self.queue)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint without a queue, written with k = 0).

        Raises:
            StalenessMismatch: the checkpoint was written with another ``staleness``.
        """
        saved = int(state["staleness"]) if state else 0
        if saved != self.staleness:
            raise StalenessMismatch(
                f"--resume: the checkpoint was written with staleness={saved} and this run has "
                f"staleness={self.staleness}; resume with staleness={saved} (its queue of rollouts generated "
                "ahead belongs to that lag)")
        if state:
            self.queue = [(int(t), _on_cpu(d)) for t, d in state["queue"]]
            self.next_target = int(state["next_target"])
            first = self.next_target - len(self.queue)  # the first step this run trains
            if self.staleness and len(self.queue) < self.staleness and first <= self.steps:
                fresh = range(self.next_target, min(first + self.staleness - 1, self.steps) + 1)
                self.resume_note = (
                    f"staleness={self.staleness}: the checkpoint holds {len(self.queue)} of the {self.staleness} "
                    f"batches generated ahead (an echotrain that stopped generating at its last step wrote it); "
                    f"{_steps(fresh.start, fresh.stop - 1)} sampled by the weights of step {first} instead, "
                    f"less stale than in an uninterrupted run")
