"""Attention over a packed row block by block: each query block against only the keys it may see.

A packed row (:mod:`echotrain.runtime.packing`) is ``[common prefix | prompt 1's rest | its
responses | prompt 2's rest | ... | padding]`` under a block mask: a token of prompt u's block
attends to the common prefix and to block u, never to another prompt's block. One attention call
over the whole row (the model's ``sdpa`` with the (R, 1, S, S) mask) computes every query against
every key and masks most of the products away: with the default job's micro-batch (4 prompt
groups, S ~ 680 columns, a prefix of 76) about three quarters of its work. Here the row's
attention runs as one call per *piece*: the prefix's queries against the prefix, each block's
queries against ``prefix + block``, the padding's against ``prefix + padding``, each with its
slice of the same mask, and the outputs are concatenated along the row. The function is the
same (every query sees exactly the keys the mask allows); only floating-point summation order
differs.

How it reaches the model: for the packed forward only, :func:`block_attention` puts a wrapper
in front of the ``sdpa`` entry of transformers' ``ALL_ATTENTION_FUNCTIONS`` (the function every
attention module with ``sdpa`` looks up at each call) and the forward passes the pieces
(:func:`blocks_of`) as the keyword ``packed_pieces``, which transformers hands down to the
attention function. The wrapper, :func:`block_attention_forward`, runs the pieces only when it
gets them *and* the very mask tensor they were cut from; any other call (no pieces: a model
whose layers drop the forward's keywords; another mask: a model that changed it, e.g. added a
position bias) runs the original ``sdpa`` unchanged, so a model the blocks do not fit computes
what it computed before, only without the saving. The model's own configuration is not touched
(a model that branches on the name ``"sdpa"`` keeps its branch). ``eager`` models keep the
whole-row mask (their function is the modelling file's, not the registry's). Not used under
gradient checkpointing: the backward's recomputation runs after the wrapper is removed
(:func:`echotrain.runtime.packing.packed_log_probs` then keeps the whole-row mask).

Source: ours (the block-sparse structure of Prefix Grouper's shared-prefix attention, arXiv
2506.05433, taken as separate dense calls per block instead of one masked call).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass(frozen=True)
class Piece:
    """One attention call of a packed row.

    Attributes:
        row: the packed row (index into dim 0 of query / key / value).
        start, stop: the query columns ``[start, stop)``; a row's pieces tile ``[0, S)`` in order.
        keys: the key column ranges ``((a, b), ...)`` it attends, in column order.
        mask: (1, 1, stop - start, K) slice of the row's mask (its dtype and format: bool for
            ``sdpa``) at those queries and the K key columns.
    """

    row: int
    start: int
    stop: int
    keys: tuple[tuple[int, int], ...]
    mask: torch.Tensor


@dataclass
class PackedPieces:
    """The pieces of every packed row, the mask they were cut from, and how often they ran.

    Attributes:
        pieces: per row, its :class:`Piece` list (tiling the row's columns in order).
        mask: the (R, 1, S, S) mask the forward gets: the pieces run only for this very tensor.
        used: attention calls that ran the pieces (one per layer when the model takes them);
            counted by :func:`block_attention_forward`.
    """

    pieces: tuple[tuple[Piece, ...], ...]
    mask: torch.Tensor
    used: int = 0


def blocks_of(block: torch.Tensor, prefix_len: int, mask: torch.Tensor) -> PackedPieces:
    """The pieces of packed rows: the common prefix, each prompt block, the padding.

    Args:
        block: (R, S) int64, :attr:`PackLayout.block <echotrain.runtime.packing.PackLayout>`: the
            prefix's columns first, then each block's columns contiguous, padding last.
        prefix_len: C, the prefix's columns ``[0, C)`` (0: no prefix).
        mask: (R, 1, S, S) the attention mask the forward gets (bool or additive float).

    Returns:
        :class:`PackedPieces`; a block's (and the padding's) queries attend ``[0, C)`` and their
        own columns, the prefix's queries ``[0, C)``.

    Raises:
        ValueError: a block whose columns are not contiguous, or ``mask`` of another shape.
    """
    R, S = block.shape
    if mask.shape != (R, 1, S, S):
        raise ValueError(f"mask: expected shape {(R, 1, S, S)}, got {tuple(mask.shape)}")
    C = prefix_len
    rows = []
    for r in range(R):
        # the runs of equal block ids after the prefix: each prompt block, then the padding
        ids, counts = torch.unique_consecutive(block[r, C:].cpu(), return_counts=True)
        if len(set(ids.tolist())) != len(ids):
            raise ValueError("block: a block's columns are not contiguous in its row")
        bounds = (C + torch.cat([counts.new_zeros(1), counts.cumsum(0)])).tolist()
        spans = ([(0, C)] if C else []) + list(zip(bounds[:-1], bounds[1:]))
        pieces = []
        for a, b in spans:
            keys = ((a, b),) if a == 0 or not C else ((0, C), (a, b))
            sub = torch.cat([mask[r:r + 1, :, a:b, k0:k1] for k0, k1 in keys], dim=-1)
            pieces.append(Piece(r, a, b, keys, sub))
        rows.append(tuple(pieces))
    return PackedPieces(tuple(rows), mask)


def block_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, *args: Any, packed_pieces: PackedPieces | None = None,
                            inner: Callable[..., Any], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function interface: one ``inner`` call per :class:`Piece`, or
    ``inner`` itself.

    Args:
        module: the attention module (read by ``inner``: grouped query heads etc.).
        query: (R, H, S, D); key, value: (R, H_kv, S, D) (after rotary embeddings).
        attention_mask: the mask the model passes; the pieces run only when it is
            ``packed_pieces.mask`` itself.
        *args, **kwargs: what transformers passes (dropout, scaling, ...), handed to ``inner``.
        packed_pieces: from :func:`blocks_of`, or None.
        inner: the attention function wrapped (transformers' ``sdpa_attention_forward``).

    Returns:
        ``(output (R, S, H, D), None)`` from the pieces, else whatever ``inner`` returns.
    """
    if packed_pieces is None or attention_mask is not packed_pieces.mask:
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    packed_pieces.used += 1
    rows = []
    for pieces in packed_pieces.pieces:
        outs = []
        for p in pieces:
            r = slice(p.row, p.row + 1)
            k = torch.cat([key[r, :, a:b] for a, b in p.keys], dim=2)
            v = torch.cat([value[r, :, a:b] for a, b in p.keys], dim=2)
            outs.append(inner(module, query[r, :, p.start:p.stop], k, v, p.mask, *args, **kwargs)[0])
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0), None


@contextlib.contextmanager
def block_attention() -> Iterator[None]:
    """Within the block, the ``sdpa`` entry of transformers' ``ALL_ATTENTION_FUNCTIONS`` is
    :func:`block_attention_forward` around the previous entry; restored on exit, also after an
    exception. Calls without pieces (every other model and forward meanwhile) run the previous
    entry unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = functools.partial(block_attention_forward, inner=previous)
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
