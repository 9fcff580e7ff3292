"""Loss aggregation (``loss_agg_mode``): from a per-token loss matrix to the scalar loss.

Every mode is a weighted sum ``loss = sum_i w_i * sum_t M_{i,t} l_{i,t}`` with one weight per
sequence (``agg_weights``); the modes differ only in the weights (docs/design/objectives.md §5):

=========================  ==========================================================
``token-mean``             w_i = 1 / N_tokens                     (DAPO)
``seq-mean-token-mean``    w_i = 1 / (|o_i| * N_seqs)             (GRPO original)
``seq-mean-token-sum``     w_i = 1 / N_seqs
``seq-mean-token-sum-norm`` w_i = 1 / (N_seqs * C)                 (Dr. GRPO, C a constant)
``token-sum``              w_i = 1                                 (verl's token-sum: the plain sum)
``balanced``               w_i = (k_g/G_g)/T+_g or (m_g/G_g)/T-_g, / N_groups  (Balanced Agg.)
=========================  ==========================================================

N_tokens counts valid tokens; N_seqs counts non-empty sequences (as verl does: an empty
response never adds a phantom token or sequence). Every normaliser is global to the optimizer
step: pass it explicitly (``num_tokens``, ``num_seqs``, ``balanced``) when the step is split into
micro-batches or ranks (see :mod:`echotrain.rl.stepwise`); by default it is computed from the
inputs, which are then taken to be the whole step. An all-masked input gives loss 0 with
finite (zero) gradients. A new mode is one weight function plus ``@register_agg_mode("name")``;
:data:`AGG_MODES` is a live view of the registered names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from echotrain.registry import Registry
from echotrain.rl.validation import (
    as_bool_mask,
    check_choice,
    check_finite,
    check_group_index,
    check_same_shape,
    check_tensor,
)

Number = Union[int, float, torch.Tensor]


@dataclass(frozen=True)
class AggInputs:
    """What an aggregation mode's weight function reads (the arguments of :func:`agg_weights`).

    ``mask`` is the bool ``(B, T)`` response mask and ``lengths`` its float64 ``(B,)`` row sums;
    the other fields are :func:`agg_loss`'s keyword arguments, unchecked.
    """

    mask: torch.Tensor
    lengths: torch.Tensor
    advantages: torch.Tensor | None
    group_index: torch.Tensor | None
    num_tokens: Number | None
    num_seqs: Number | None
    norm_constant: float | None
    balanced: "BalancedStats | None"
    ba_scope: str
    ba_count_zero_adv: bool


AggWeightsFn = Callable[[AggInputs], torch.Tensor]
#: ``loss_agg_mode`` name -> weight function ``fn(AggInputs) -> (B,) float64`` per-sequence weights.
AGG_MODE_REGISTRY: Registry[AggWeightsFn] = Registry("loss aggregation mode", "loss_agg_mode")
#: The registered ``loss_agg_mode`` names (a live view of :data:`AGG_MODE_REGISTRY`).
AGG_MODES = AGG_MODE_REGISTRY.names()


def register_agg_mode(name: str) -> Callable[[AggWeightsFn], AggWeightsFn]:
    """Decorator: register ``fn(AggInputs) -> w`` as ``loss_agg_mode=name``.

    ``w`` is the ``(B,)`` float64 per-sequence weight with ``loss = sum_i w_i sum_t M_{i,t}
    l_{i,t}``; it must be 0 for empty responses and must raise ``ValueError`` (naming the
    argument) when an input it needs is missing.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return AGG_MODE_REGISTRY.register(name)


def response_sign(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sign of each response's advantage: ``sign(sum_t M A)`` as an int8 ``(B,)`` in {-1, 0, 1}.

    Outcome advantages are constant over a response's tokens; an empty response has sign 0.
    ``advantages`` may be ``(B,)`` or ``(B, T)``.
    """
    if advantages.dim() == 1:
        total = advantages * response_mask.any(-1)
    else:
        total = torch.where(response_mask, advantages, 0).sum(-1)
    return torch.sign(total.detach()).to(torch.int8)


@dataclass
class BalancedStats:
    """Per-group statistics of Balanced Aggregation (Zeng et al., arXiv 2605.04077).

    Every field is a float64 tensor of shape ``(n,)`` indexed by dense group id (row g = group
    id g). Fields are plain sums, so partial stats from micro-batches and ranks add up
    (:meth:`to_vector` / :meth:`from_vector` for one all-reduce).
    """

    num_responses: torch.Tensor  # every response of the group (defines which groups exist)
    group_size: torch.Tensor  # G: responses counted in G (all, or non-zero-advantage only)
    num_pos: torch.Tensor  # k: responses with A > 0
    num_neg: torch.Tensor  # m: responses with A < 0
    tokens_pos: torch.Tensor  # T+: valid tokens of the positive responses
    tokens_neg: torch.Tensor  # T-: valid tokens of the negative responses

    _FIELDS = ("num_responses", "group_size", "num_pos", "num_neg", "tokens_pos", "tokens_neg")

    def to_vector(self) -> torch.Tensor:
        """All fields stacked into one float64 ``(6 * n,)`` vector (for an all-reduce)."""
        return torch.cat([getattr(self, f) for f in self._FIELDS])

    @classmethod
    def from_vector(cls, v: torch.Tensor) -> "BalancedStats":
        """Inverse of :meth:`to_vector`."""
        return cls(*v.reshape(len(cls._FIELDS), -1).unbind(0))

    @property
    def num_groups(self) -> torch.Tensor:
        """Number of groups in the mean over groups: those with G > 0 (0-d float64).

        With ``count_zero_adv=True`` (G counts every response) that is every group with a
        response; with ``count_zero_adv=False`` a group whose advantages are all 0 has G = 0 and
        is left out of the mean too, so the loss equals BA on the batch with its zero-advantage
        responses removed (as DAPO's dynamic sampling would) -- docs/design/objectives.md §5.
        """
        return (self.group_size > 0).sum().to(torch.float64)

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token weights ``(c_pos, c_neg)``, each ``(n,)`` float64.

        c+_g = k_g / (G_g T+_g) / N_groups, c-_g = m_g / (G_g T-_g) / N_groups; 0 where the
        subset is empty (T = 0) or G = 0, so an empty subset contributes 0, never NaN.
        """
        n_groups = self.num_groups.clamp(min=1)
        g = self.group_size.clamp(min=1)
        c_pos = torch.where(self.tokens_pos > 0, self.num_pos / (g * self.tokens_pos.clamp(min=1)), 0.0)
        c_neg = torch.where(self.tokens_neg > 0, self.num_neg / (g * self.tokens_neg.clamp(min=1)), 0.0)
        return c_pos / n_groups, c_neg / n_groups


def balanced_stats(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    *,
    num_group_ids: int | None = None,
    count_zero_adv: bool = True,
) -> BalancedStats:
    """Sum the Balanced-Aggregation statistics of a (micro-)batch per group id.

    Args:
        advantages: ``(B, T)`` or ``(B,)`` float; only the sign per response is used.
        response_mask: ``(B, T)`` bool / 0-1.
        group_index: ``(B,)`` int, dense non-negative group ids (row of the result).
        num_group_ids: length n of the result (default ``max(group_index) + 1``); must exceed
            every id. Pass the step's value so partial stats line up across micro-batches.
        count_zero_adv: zero-advantage responses count in G (the design's default).

    Returns:
        :class:`BalancedStats` with ``(n,)`` float64 fields.

    Raises:
        ValueError: negative ids or ids >= ``num_group_ids``.
    """
    mask = as_bool_mask("response_mask", response_mask)
    check_group_index("group_index", group_index, mask.shape[0])
    n = int(group_index.max()) + 1 if num_group_ids is None and group_index.numel() else (num_group_ids or 0)
    if group_index.numel():
        if int(group_index.min()) < 0:
            raise ValueError("group_index must be non-negative dense group ids")
        if int(group_index.max()) >= n:
            raise ValueError(f"group_index max {int(group_index.max())} >= num_group_ids {n}")
    return _balanced_stats(response_sign(advantages, mask), mask.sum(-1), group_index.long(), n, count_zero_adv)


def _balanced_stats(sign: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor, n: int, count_zero_adv: bool) -> BalancedStats:
    """Per-group sums from per-response sign ``(B,)``, length ``(B,)`` and dense ids ``(B,)``."""
    pos, neg = (sign > 0).to(torch.float64), (sign < 0).to(torch.float64)
    ones = torch.ones_like(pos)
    counted = ones if count_zero_adv else (sign != 0).to(torch.float64)
    lengths = lengths.to(torch.float64)
    per_response = torch.stack([ones, counted, pos, neg, pos * lengths, neg * lengths], dim=1)  # (B, 6)
    sums = torch.zeros(n, 6, dtype=torch.float64, device=sign.device).index_add_(0, ids, per_response)
    return BalancedStats(*sums.t().contiguous().unbind(0))


def _positive_count(name: str, value: Number | None, default: torch.Tensor) -> torch.Tensor:
    """A normaliser as a float64 tensor; 0 stays 0 (callers clamp), negatives are errors."""
    if value is None:
        return default.to(torch.float64)
    v = torch.as_tensor(value, dtype=torch.float64, device=default.device)
    if v.numel() != 1 or not bool(torch.isfinite(v)) or float(v) < 0:
        raise ValueError(f"{name} must be a finite scalar >= 0, got {value!r}")
    return v.reshape(())


def agg_weights(
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    advantages: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    norm_constant: float | None = None,
    balanced: BalancedStats | None = None,
    ba_scope: str = "group",
    ba_count_zero_adv: bool = True,
) -> torch.Tensor:
    """Per-sequence weights w ``(B,)`` float64 with ``loss = sum_i w_i sum_t M_{i,t} l_{i,t}``.

    The per-token weight is ``w_i * M_{i,t}``.

    Args:
        response_mask: ``(B, T)`` bool or 0/1; True marks valid response tokens.
        loss_agg_mode: one of :data:`AGG_MODES`.
        advantages: ``(B, T)`` or ``(B,)``; needed by ``balanced`` (sign per response).
        group_index: ``(B,)`` int prompt-group ids; needed by ``balanced``.
        num_tokens: valid tokens in the whole optimizer step (default: this input's count).
        num_seqs: non-empty sequences in the whole step (default: this input's count).
        norm_constant: C of ``seq-mean-token-sum-norm`` (required by that mode).
        balanced: the step's :class:`BalancedStats` (then ``group_index`` must be the step's
            dense ids); default: computed from this input.
        ba_scope: "group" (per prompt group) or "batch" (one pooled group).
        ba_count_zero_adv: zero-advantage responses count in G.

    Raises:
        ValueError: unknown mode; ``seq-mean-token-sum-norm`` without ``norm_constant``;
            ``balanced`` without ``advantages`` / ``group_index``, or with advantages of the
            wrong shape or NaN/Inf at valid tokens; bad normalisers.
    """
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    mask = as_bool_mask("response_mask", response_mask)
    check_tensor("response_mask", mask, 2)
    lengths = mask.sum(-1).to(torch.float64)
    return AGG_MODE_REGISTRY[loss_agg_mode](
        AggInputs(mask, lengths, advantages, group_index, num_tokens, num_seqs, norm_constant, balanced, ba_scope,
                  ba_count_zero_adv)
    )


@register_agg_mode("token-mean")
def _token_mean(x: AggInputs) -> torch.Tensor:
    """w_i = 1 / N_tokens (DAPO)."""
    n_tok = _positive_count("num_tokens", x.num_tokens, x.lengths.sum())
    return (x.lengths > 0).to(torch.float64) / n_tok.clamp(min=1)


def _nonempty_and_num_seqs(x: AggInputs) -> tuple[torch.Tensor, torch.Tensor]:
    nonempty = (x.lengths > 0).to(torch.float64)
    return nonempty, _positive_count("num_seqs", x.num_seqs, nonempty.sum()).clamp(min=1)


@register_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(x: AggInputs) -> torch.Tensor:
    """w_i = 1 / (|o_i| N_seqs) (GRPO original)."""
    nonempty, n_seq = _nonempty_and_num_seqs(x)
    return nonempty / (x.lengths.clamp(min=1) * n_seq)


@register_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(x: AggInputs) -> torch.Tensor:
    """w_i = 1 / N_seqs."""
    nonempty, n_seq = _nonempty_and_num_seqs(x)
    return nonempty / n_seq


@register_agg_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(x: AggInputs) -> torch.Tensor:
    """w_i = 1 / (N_seqs C), C = ``norm_constant`` (Dr. GRPO)."""
    nonempty, n_seq = _nonempty_and_num_seqs(x)
    if x.norm_constant is None:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs norm_constant (e.g. the maximum response "
            "length); the padded width of the batch is never used"
        )
    if not float(x.norm_constant) > 0:
        raise ValueError(f"norm_constant must be > 0, got {x.norm_constant}")
    return nonempty / (n_seq * float(x.norm_constant))


@register_agg_mode("balanced")
def _balanced(x: AggInputs) -> torch.Tensor:
    """w_i = (k_g/G_g)/T+_g or (m_g/G_g)/T-_g by the sign of A_i, / N_groups (Balanced Aggregation)."""
    mask, lengths, advantages, group_index = x.mask, x.lengths, x.advantages, x.group_index
    if advantages is None or group_index is None:
        raise ValueError("loss_agg_mode='balanced' needs advantages and group_index")
    check_group_index("group_index", group_index, mask.shape[0])
    check_choice("ba_scope", x.ba_scope, ("group", "batch"))
    check_tensor("advantages", advantages, (1, 2))
    if tuple(advantages.shape) not in ((mask.shape[0],), tuple(mask.shape)):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected ({mask.shape[0]},) or {tuple(mask.shape)}"
        )
    # a NaN advantage would read as sign 0 (weight 0) without a word
    check_finite("advantages", advantages, mask if advantages.dim() == 2 else mask.any(-1))
    balanced = x.balanced
    if x.ba_scope == "batch":
        ids = torch.zeros_like(group_index, dtype=torch.long)
    elif balanced is None:
        ids = torch.unique(group_index, return_inverse=True)[1]
    else:
        ids = group_index.long()
    if mask.shape[0] == 0:
        return lengths
    sign = response_sign(advantages, mask)
    if balanced is None:
        balanced = _balanced_stats(sign, lengths, ids, int(ids.max()) + 1, x.ba_count_zero_adv)
    elif int(ids.min()) < 0 or int(ids.max()) >= balanced.num_responses.shape[0]:
        raise ValueError(
            f"group_index ids must lie in [0, {balanced.num_responses.shape[0]}) of the step's BalancedStats, "
            f"got [{int(ids.min())}, {int(ids.max())}]"
        )
    c_pos, c_neg = balanced.coefficients()
    w = torch.where(sign > 0, c_pos[ids], torch.where(sign < 0, c_neg[ids], 0.0))
    return w * (lengths > 0)


@register_agg_mode("token-sum")
def _token_sum(x: AggInputs) -> torch.Tensor:
    """w_i = 1: the plain sum over the step's valid tokens (verl's ``token-sum``).

    Exact under micro-batches and ranks with no step statistic at all: the sum of the micro-batch
    sums is the step's sum (each rank's loss is multiplied by ``dp_size`` as for every mode,
    because DDP averages gradients; verl does the same).
    """
    return (x.lengths > 0).to(torch.float64)



def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    **weight_args: Any,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into the scalar loss (docs/design/objectives.md §5).

    Args:
        loss_mat: ``(B, T)`` float per-token loss; masked positions are ignored (may hold
            anything finite or not; they get neither value nor gradient).
        response_mask: ``(B, T)`` bool or 0/1; True marks valid response tokens.
        loss_agg_mode: one of :data:`AGG_MODES`.
        dp_size: multiply the loss by this (DDP averages gradients over ranks; see stepwise).
        **weight_args: the keyword arguments of :func:`agg_weights` (``advantages``,
            ``group_index``, ``num_tokens``, ``num_seqs``, ``norm_constant``, ``balanced``,
            ``ba_scope``, ``ba_count_zero_adv``), with their defaults.

    Returns:
        0-d tensor in ``loss_mat``'s dtype.

    Raises:
        ValueError: unknown mode (lists valid ones), shape mismatch, NaN/Inf at valid
            positions, missing inputs of the mode.
        TypeError: an unknown keyword argument.
    """
    check_tensor("loss_mat", loss_mat, 2)
    mask = as_bool_mask("response_mask", response_mask)
    check_same_shape("loss_mat", loss_mat, response_mask=mask)
    check_finite("loss_mat", loss_mat, mask)
    return weighted_sum(loss_mat, mask, agg_weights(mask, loss_agg_mode, **weight_args)) * dp_size


def weighted_sum(loss_mat: torch.Tensor, mask: torch.Tensor, seq_weights: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i sum_t M_{i,t} l_{i,t}`` (no checks), in ``loss_mat``'s dtype.

    ``seq_weights`` ``(B,)``, or ``(B, T)`` per-token weights w_{i,t} (a rollout correction's
    weights times the aggregation weights: ``sum_{i,t} w_{i,t} M_{i,t} l_{i,t}``)."""
    if seq_weights.dim() == 2:
        return torch.where(mask, loss_mat * seq_weights.to(loss_mat.dtype), 0.0).sum()
    seq_sums = torch.where(mask, loss_mat, 0.0).sum(-1)
    return (seq_sums * seq_weights.to(loss_mat.dtype)).sum()
