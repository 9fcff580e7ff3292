"""On-policy distillation's teacher in the trainer (docs/design/objectives.md §12): loaded from a
model id, a path or a run directory (:func:`echotrain.runtime.loading.load_for_eval`), checked
to share the student's tokenizer, and run without gradient:

- ``distill_top_k > 0``: once per step in the log-prob phase, its top-k log-probs and token ids
  ``(N, T, k)`` stored in :class:`~echotrain.train.step.StepData` (``teacher_top_values`` /
  ``teacher_top_indices``);
- ``distill_top_k = 0`` (full vocabulary): per micro-batch inside the update, its ``(b, T, V)``
  log-softmax recomputed and dropped after the micro-batch's term (storing ``(N, T, V)`` floats
  for the step, 49152 columns for SmolLM2, would dominate the step's memory).

The time and the bytes of its outputs are the step's ``time/teacher`` and ``memory/teacher_mb``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from echotrain.errors import ConfigError
from echotrain.metrics import declare_metric
from echotrain.runtime.precision import autocast
from echotrain.runtime.rollout import RolloutBatch, response_log_softmax
from echotrain.rl.distill import teacher_top_k

DISTILL_KL = declare_metric(
    "distill/kl", reduce="token_mean", unit="nats per token", when="teacher set (objective=distill or distill_coeff > 0)",
    help="mean per-token distillation divergence of the policy being updated to the teacher over the loss's tokens "
         "(distill_beta=1: the reverse KL, student to teacher; over the teacher's top-k with distill_top_k > 0)",
    label="divergence to teacher", panel="Distillation")
TIME_TEACHER = declare_metric(
    "time/teacher", reduce="step", unit="seconds", when="teacher set", volatile=True,
    help="wall seconds of the teacher's no-grad forwards in the step (top-k: the log-prob phase; full vocabulary: "
         "inside the update, per micro-batch)")
MEMORY_TEACHER = declare_metric(
    "memory/teacher_mb", reduce="step", unit="MiB", when="teacher set", volatile=True,
    help="MiB of teacher outputs held at once: the step's stored top-k log-probs and ids, or (full vocabulary) the "
         "largest micro-batch's (b, T, V) float32 log-softmax; the teacher's weights not included")

#: the string whose round trip through both tokenizers must give the same ids
TOKENIZER_PROBE = "Distil 12 + 30 = 42.\n<answer>42</answer> éß"


def distill_coeff_now(cfg: Any) -> float:
    """The distillation term's coefficient: 1 under ``objective=distill``, else ``distill_coeff``
    (0 = no term)."""
    return 1.0 if cfg.objective == "distill" else float(cfg.distill_coeff)


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The model's output width (``config.vocab_size``, else the lm head's rows, else ``len(tokenizer)``)."""
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if v is None and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        v = model.get_output_embeddings().weight.shape[0]
    return int(v if v is not None else len(tokenizer))


def check_same_tokenizer(student: tuple[Any, Any], teacher: tuple[Any, Any], student_name: str,
                         teacher_name: str) -> None:
    """Refuse a teacher whose next-token distributions are not over the student's vocabulary.

    Checks: the models' output widths are equal, and :data:`TOKENIZER_PROBE` encodes to the same
    ids under both tokenizers and decodes back to the same text.

    Args:
        student, teacher: ``(model, tokenizer)`` pairs.
        student_name, teacher_name: how the error names them (the ``model`` / ``teacher`` values).

    Raises:
        ConfigError: naming both models and what differs.
    """
    (s_model, s_tok), (t_model, t_tok) = student, teacher
    vs, vt = vocab_size(s_model, s_tok), vocab_size(t_model, t_tok)
    if vs != vt:
        raise ConfigError(f"teacher={teacher_name!r} has a vocabulary of {vt} tokens, model={student_name!r} of {vs}: "
                          "distillation needs the same tokenizer")
    ids_s = s_tok.encode(TOKENIZER_PROBE, add_special_tokens=False)
    ids_t = t_tok.encode(TOKENIZER_PROBE, add_special_tokens=False)
    if list(ids_s) != list(ids_t) or s_tok.decode(ids_s) != t_tok.decode(ids_t):
        raise ConfigError(f"teacher={teacher_name!r} and model={student_name!r} tokenize {TOKENIZER_PROBE!r} "
                          "differently: distillation needs the same tokenizer")


class Teacher:
    """The frozen teacher of a run: its no-grad passes, timed, and what they hold.

    Args:
        cfg: the run's :class:`~echotrain.train.config.TrainConfig` (``teacher``, ``model``,
            ``temperature``, ``distill_top_k``, ``micro_batch_size``).
        student, student_tokenizer: the policy and its tokenizer (for the tokenizer check).
        device: the policy's device (the teacher goes there).
        autocast_dtype: the run's autocast dtype (the teacher's forwards run under it too), or None.

    Raises:
        ConfigError: a different tokenizer (:func:`check_same_tokenizer`).
        FileNotFoundError: a run directory without a final model or checkpoint.
    """

    def __init__(self, cfg: Any, student: Any, student_tokenizer: Any, device: torch.device,
                 autocast_dtype: torch.dtype | None = None):
        from echotrain.runtime.loading import load_for_eval

        self.cfg, self.autocast_dtype = cfg, autocast_dtype
        model, tokenizer, self.description = load_for_eval(cfg.teacher, device=str(device))
        check_same_tokenizer((student, student_tokenizer), (model, tokenizer), cfg.model, cfg.teacher)
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.seconds, self.bytes = 0.0, 0
        #: what the update reads (:func:`echotrain.train.update.update_mini_batch`'s ``distill``)
        self.coeff, self.beta, self.objective = distill_coeff_now(cfg), float(cfg.distill_beta), cfg.objective

    def student_log_softmax(self, model: Any, batch: RolloutBatch) -> torch.Tensor:
        """The policy's ``(b, T, V)`` float32 log-softmax at ``batch``'s response positions, with
        grad when grad is enabled (the update's forward under distillation), its activations
        recomputed in the backward under ``gradient_checkpointing`` (as the update's own forward)."""
        checkpointing = contextlib.nullcontext()
        if self.cfg.gradient_checkpointing and torch.is_grad_enabled():
            from echotrain.train.features import checkpointed_forward

            checkpointing = checkpointed_forward(model)
        with checkpointing, autocast(model, self.autocast_dtype):
            return response_log_softmax(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                        batch.attended_mask, temperature=self.cfg.temperature,
                                        pack=self.cfg.pack_responses, packed_attention=self.cfg.packed_attention)

    @torch.no_grad()
    def log_softmax(self, batch: RolloutBatch) -> torch.Tensor:
        """The teacher's ``(b, T, V)`` float32 log-softmax at ``batch``'s response positions
        (sampling temperature), on the teacher's device; timed into ``time/teacher``."""
        t0 = time.perf_counter()
        with autocast(self.model, self.autocast_dtype):
            out = response_log_softmax(self.model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                       batch.attended_mask, temperature=self.cfg.temperature,
                                        pack=self.cfg.pack_responses, packed_attention=self.cfg.packed_attention)
        self.seconds += time.perf_counter() - t0
        self.bytes = max(self.bytes, out.numel() * out.element_size())
        return out

    @torch.no_grad()
    def top_k(self, batch: RolloutBatch, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-``distill_top_k`` log-probs and ids ``(N, T, k)`` (float32, int64, on
        CPU) for all of ``batch``'s rows, in micro-batches; timed into ``time/teacher``."""
        values, indices = [], []
        for idx in torch.arange(len(batch)).split(micro_batch_size):
            v, i = teacher_top_k(self.log_softmax(batch.select(idx)), self.cfg.distill_top_k)
            values.append(v.cpu())
            indices.append(i.cpu())
        v, i = torch.cat(values), torch.cat(indices)
        self.bytes = v.numel() * v.element_size() + i.numel() * i.element_size()
        return v, i

    def step_metrics(self) -> dict[str, float]:
        """This step's ``time/teacher`` and ``memory/teacher_mb``; resets the counters."""
        out = {TIME_TEACHER.name: self.seconds, MEMORY_TEACHER.name: self.bytes / 2**20}
        self.seconds, self.bytes = 0.0, 0
        return out
