"""On-policy distillation's divergence: the student samples, a teacher scores every position of
the student's responses, and the loss is a per-token divergence between the two next-token
distributions. Pure tensor math; docs/design/objectives.md §12.

Sources: GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models", arXiv 2306.13649,
Eq. 1: the generalised Jensen-Shannon divergence) and Thinking Machines' "On-Policy Distillation"
(2025: the per-token reverse KL on the student's own samples). ``beta`` has TRL's meaning
(``trl.trainer.distillation_trainer`` / ``GKDTrainer.generalized_jsd_loss``, TRL 1.x):
``beta=0`` is the forward KL(teacher || student), ``beta=1`` the reverse KL(student || teacher),
anything between the generalised JSD with mixture M = (1 - beta) S + beta T:
``beta KL(T || M) + (1 - beta) KL(S || M)``.
"""

from __future__ import annotations

import torch

from echotrain.rl.validation import check_tensor


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, 0 * log 0 = 0 (zero-probability entries of p add nothing)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def generalized_jsd(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position divergence between the student's and the teacher's next-token distributions.

    Args:
        student_log_prob: ``(..., V)`` float log-softmax of the student (with grad for the loss).
        teacher_log_prob: ``(..., V)`` float log-softmax of the teacher (no grad needed), same shape.
        beta: TRL's ``beta`` in [0, 1]: 0 = KL(teacher || student) (forward), 1 = KL(student ||
            teacher) (reverse, on-policy distillation's default), between: the generalised JSD of
            GKD Eq. 1 with mixture ``(1 - beta) S + beta T`` (TRL's weighting).

    Returns:
        ``(...)`` float divergences (nats), >= 0 up to rounding; differentiable through the student.

    Raises:
        ValueError: ``beta`` outside [0, 1], or the shapes differ / are not at least 1-D.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_log_prob.shape != teacher_log_prob.shape or student_log_prob.dim() < 1:
        raise ValueError(f"student_log_prob has shape {tuple(student_log_prob.shape)}, teacher_log_prob "
                         f"{tuple(teacher_log_prob.shape)}: they must match, (..., V)")
    t = teacher_log_prob.to(student_log_prob.dtype)
    if beta == 0.0:
        return _kl(t, student_log_prob)
    if beta == 1.0:
        return _kl(student_log_prob, t)
    b = torch.tensor(beta, dtype=student_log_prob.dtype, device=student_log_prob.device)
    mixture = torch.logsumexp(torch.stack([student_log_prob + torch.log1p(-b), t + torch.log(b)]), dim=0)
    return beta * _kl(t, mixture) + (1.0 - beta) * _kl(student_log_prob, mixture)


def teacher_top_k(teacher_log_prob: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely tokens at each position: what the top-k variant stores.

    Args:
        teacher_log_prob: ``(..., V)`` float log-softmax of the teacher.
        k: 1 <= k <= V.

    Returns:
        ``(values, indices)``: ``(..., k)`` log-probs (full-vocabulary normalisation, descending) and
        ``(..., k)`` int64 token ids.

    Raises:
        ValueError: ``k`` outside [1, V].
    """
    V = teacher_log_prob.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"top-k needs 1 <= k <= vocabulary size {V}, got k={k}")
    return torch.topk(teacher_log_prob, k, dim=-1)


def top_k_divergence(student_log_prob: torch.Tensor, teacher_values: torch.Tensor, teacher_indices: torch.Tensor,
                     beta: float) -> torch.Tensor:
    """:func:`generalized_jsd` restricted to the teacher's top-k tokens (memory: the teacher pass
    keeps ``(..., k)`` numbers per position instead of ``(..., V)``).

    Our choice (a documented approximation; TRL has no loss-side top-k): both distributions are
    renormalised over the teacher's k tokens (a log-softmax of the gathered log-probs), then the
    divergence of those two k-point distributions is taken. With k = V it is the exact divergence;
    the student's mass outside the teacher's top-k gets no gradient.

    Args:
        student_log_prob: ``(..., V)`` float log-softmax of the student (with grad).
        teacher_values: ``(..., k)`` float teacher log-probs of its top-k tokens (:func:`teacher_top_k`).
        teacher_indices: ``(..., k)`` int64 token ids of those tokens.
        beta: as in :func:`generalized_jsd`.

    Returns:
        ``(...)`` float divergences (nats).

    Raises:
        ValueError: shape mismatch, or ``beta`` outside [0, 1].
    """
    if teacher_values.shape != teacher_indices.shape or teacher_values.shape[:-1] != student_log_prob.shape[:-1]:
        raise ValueError(f"teacher_values {tuple(teacher_values.shape)} / teacher_indices "
                         f"{tuple(teacher_indices.shape)} must be (..., k) over student_log_prob "
                         f"{tuple(student_log_prob.shape)}'s leading dims")
    s = torch.log_softmax(torch.gather(student_log_prob, -1, teacher_indices), dim=-1)
    t = torch.log_softmax(teacher_values.to(student_log_prob.dtype), dim=-1)
    return generalized_jsd(s, t, beta)


def distill_token_divergence(student_log_prob: torch.Tensor, *, beta: float,
                             teacher_log_prob: torch.Tensor | None = None,
                             teacher_values: torch.Tensor | None = None,
                             teacher_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The distillation term's per-token matrix ``(b, T)``: the exact divergence from the teacher's
    full log-softmax, or the top-k one from its stored top-k (exactly one of the two given).

    Args:
        student_log_prob: ``(b, T, V)`` float log-softmax of the student at the response positions.
        teacher_log_prob: ``(b, T, V)`` the teacher's (exact variant).
        teacher_values, teacher_indices: ``(b, T, k)`` the teacher's top-k (``distill_top_k > 0``).

    Returns:
        ``(b, T)`` float; the caller masks and aggregates it
        (:func:`echotrain.rl.stepwise.step_agg_loss`).

    Raises:
        ValueError: neither or both teacher forms, or bad shapes.
    """
    check_tensor("student_log_prob", student_log_prob, 3)
    if (teacher_log_prob is None) == (teacher_values is None):
        raise ValueError("give exactly one of teacher_log_prob (full vocabulary) or teacher_values/teacher_indices (top-k)")
    if teacher_log_prob is not None:
        return generalized_jsd(student_log_prob, teacher_log_prob, beta)
    if teacher_indices is None:
        raise ValueError("teacher_values needs teacher_indices")
    return top_k_divergence(student_log_prob, teacher_values, teacher_indices, beta)
