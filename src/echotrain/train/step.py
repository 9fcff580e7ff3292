"""The data of one training step, as the trainer fills it stage by stage.

:func:`echotrain.train.collect.Collector.collect` returns a :class:`StepData` with the rollouts
and their scores; the trainer then sets the loss mask, the advantages and the log-probs, and
:mod:`echotrain.train.update` reads it (row-wise views of it per mini- and micro-batch). All
tensors are on the CPU, rows in the order of ``batch``; ``N`` is the number of kept sequences
and ``T`` the padded response length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from echotrain.runtime.rollout import RolloutBatch, concat_rollouts


@dataclasses.dataclass
class StepData:
    """One step's sequences and everything computed about them.

    Attributes (set by collect and score):
        batch: the kept rollouts; after :meth:`concat` ``group_index`` holds dense ids
            ``0 .. n_groups - 1`` (step-wide prompt groups).
        rewards: (N,) float32, after DAPO overlong shaping when the trainer applies it.
        correct: (N,) float32 0/1 correctness from the scorer.
        format_ok: (N,) bool, the completion had the expected answer format.
        examples: the N task examples (one per sequence, repeated over a group).
        texts: the N decoded completions (episodes, ``env``: the whole trajectory after the
            prompt, model and environment tokens, special tokens kept; the reward scored the last
            model turn).
        rounds: rollout rounds this step drew (> 1 only with dynamic sampling).
        zero_variance_frac: share of the drawn prompt groups whose correctness did not vary.
        time_generation, time_scoring: wall seconds spent in ``generate`` and in scoring.
        reward_timeouts, reward_exceptions: completions whose reward call timed out / raised.
        reward_baselines: (N,) float32 reward of one greedy rollout of each sequence's prompt
            (repeated over its group), scored like the sampled ones; only for the estimators that
            need one (``remax``), else None. Its generation counts in ``time_generation``.

    Attributes (set by the trainer before the update; None until then):
        response_mask: (N, T) float32 loss mask (``batch.response_mask``, minus truncated
            responses with overlong filtering).
        seq_advantages: (N,) float32 group-relative advantage of each sequence.
        advantages: (N, T) float32, ``seq_advantages`` broadcast over ``response_mask``.
        old_log_prob: (N, T) float32 log-probs of the learner's weights at the step's start (the
            proximal policy; the rollout policy itself when ``staleness=0``).
        entropy: (N, T) float32 token entropy of those weights.
        ref_log_prob: (N, T) float32 reference-policy log-probs, None without a KL term.
        teacher_top_values, teacher_top_indices: (N, T, k) float32 / int64 the distillation
            teacher's top-k log-probs and token ids (``distill_top_k > 0``), else None
            (train/distill.py).

    Attributes (set with the rollouts, by :class:`echotrain.train.lag.LaggedRollouts`):
        rollout_version: (N,) int64 version of the weights that sampled each rollout: the number
            of training steps they had completed (the learner at step t has version t - 1; with
            ``staleness=k`` the rollouts of step t have version ``max(t - 1 - k, 0)``).
        rollout_log_prob: (N, T) float32 log-probs of the sampled tokens under the model that
            generated them, recorded inside generation (``batch.rollout_log_prob``:
            ``log_softmax(logits / temperature)`` over the full vocabulary, the distribution
            ``old_log_prob`` is computed from), 0 off the response positions; the behaviour
            policy of ``rollout_correction`` and the train/inference mismatch metrics.
    """

    batch: RolloutBatch
    rewards: torch.Tensor
    correct: torch.Tensor
    format_ok: torch.Tensor
    examples: list[Any]
    texts: list[str]
    rounds: int = 1
    zero_variance_frac: float = 0.0
    time_generation: float = 0.0
    time_scoring: float = 0.0
    reward_timeouts: int = 0
    reward_exceptions: int = 0
    reward_baselines: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    seq_advantages: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_log_prob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    teacher_top_values: torch.Tensor | None = None
    teacher_top_indices: torch.Tensor | None = None
    rollout_version: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def n_groups(self) -> int:
        """Number of prompt groups (``group_index`` is dense after :meth:`concat`)."""
        return int(self.batch.group_index.max()) + 1

    def select(self, idx: torch.Tensor) -> "StepData":
        """Rows ``idx`` (1-d int64) of the rollout fields (a new object; the others are kept)."""
        rows = idx.tolist()
        per_row = {k: getattr(self, k)[idx] for k in ("rollout_version", "rollout_log_prob", "reward_baselines")
                   if getattr(self, k) is not None}
        return dataclasses.replace(self, batch=self.batch.select(idx), rewards=self.rewards[idx],
                                   correct=self.correct[idx], format_ok=self.format_ok[idx],
                                   examples=[self.examples[i] for i in rows], texts=[self.texts[i] for i in rows],
                                   **per_row)

    @staticmethod
    def concat(parts: Sequence["StepData"], pad_id: int) -> "StepData":
        """The rollout fields of ``parts`` one after the other, group ids made dense (the
        step-wise statistics need small ids naming the step's groups)."""
        batch = concat_rollouts([p.batch for p in parts], pad_id)
        _, batch.group_index = torch.unique(batch.group_index, return_inverse=True)
        return StepData(batch=batch, rewards=torch.cat([p.rewards for p in parts]),
                        correct=torch.cat([p.correct for p in parts]),
                        format_ok=torch.cat([p.format_ok for p in parts]),
                        examples=[e for p in parts for e in p.examples], texts=[t for p in parts for t in p.texts],
                        reward_baselines=(torch.cat([p.reward_baselines for p in parts])
                                          if parts and all(p.reward_baselines is not None for p in parts) else None))
