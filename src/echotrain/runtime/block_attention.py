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

How it reaches the model: :func:`block_attention_forward` is registered in transformers'
``AttentionInterface`` as :data:`BLOCK_ATTENTION`; :func:`blocks_of` builds the pieces from a
:class:`~echotrain.runtime.packing.PackLayout` and the mask; :func:`block_attention` switches the
model's attention implementation to it for one forward, which passes the pieces as the keyword
``packed_pieces`` (transformers hands a forward's extra keywords down to the attention function).
Each piece runs the model's own implementation (``sdpa`` or ``eager``) on its slices, so grouped
query heads, scaling and the mask's format are the model's. Not used under gradient checkpointing:
the backward's recomputation reads the attention implementation again, after the switch is undone
(:func:`echotrain.runtime.packing.packed_log_probs` then keeps the whole-row mask).

Source: ours (the block-sparse structure of Prefix Grouper's shared-prefix attention, arXiv
2506.05433, taken as separate dense calls per block instead of one masked call).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch

#: the name under which :func:`block_attention_forward` is registered in transformers' AttentionInterface
BLOCK_ATTENTION = "echotrain_packed_blocks"


@dataclass(frozen=True)
class Piece:
    """One attention call of a packed row.

    Attributes:
        row: the packed row (index into dim 0 of query / key / value).
        start, stop: the query columns ``[start, stop)``; a row's pieces tile ``[0, S)`` in order.
        keys: the key column ranges ``((a, b), ...)`` it attends, in column order.
        mask: (1, 1, stop - start, K) slice of the row's mask (its dtype and format, bool for
            ``sdpa``, additive float for ``eager``) at those queries and the K key columns.
    """

    row: int
    start: int
    stop: int
    keys: tuple[tuple[int, int], ...]
    mask: torch.Tensor


@dataclass(frozen=True)
class PackedPieces:
    """The pieces of every packed row and the attention implementation each runs.

    Attributes:
        pieces: per row, its :class:`Piece` list (tiling the row's columns in order).
        inner: the model's own attention implementation (``"sdpa"`` or ``"eager"``).
    """

    pieces: tuple[tuple[Piece, ...], ...]
    inner: str


def blocks_of(block: torch.Tensor, prefix_len: int, mask: torch.Tensor, inner: str) -> PackedPieces:
    """The pieces of packed rows: the common prefix, each prompt block, the padding.

    Args:
        block: (R, S) int64, :attr:`PackLayout.block <echotrain.runtime.packing.PackLayout>`: the
            prefix's columns first, then each block's columns contiguous, padding last.
        prefix_len: C, the prefix's columns ``[0, C)`` (0: no prefix).
        mask: (R, 1, S, S) the attention mask the forward gets (bool or additive float).
        inner: the model's attention implementation, ``"sdpa"`` or ``"eager"``.

    Returns:
        :class:`PackedPieces`; a block's (and the padding's) queries attend ``[0, C)`` and their
        own columns, the prefix's queries ``[0, C)``.

    Raises:
        ValueError: a block whose columns are not contiguous, or ``mask`` of another shape.
    """
    R, S = block.shape
    if mask.shape != (R, 1, S, S):
        raise ValueError(f"mask: expected shape {(R, 1, S, S)}, got {tuple(mask.shape)}")
    rows = []
    for r in range(R):
        ids = block[r].tolist()
        spans: list[tuple[int, int]] = [(0, prefix_len)] if prefix_len else []
        start = prefix_len
        for c in range(prefix_len + 1, S + 1):
            if c == S or ids[c] != ids[start]:
                spans.append((start, c))
                start = c
        if len({ids[a] for a, _ in spans[1 if prefix_len else 0:]}) != len(spans) - (1 if prefix_len else 0):
            raise ValueError("block: a block's columns are not contiguous in its row")
        pieces = []
        for a, b in spans:
            keys = ((a, b),) if a == 0 or not prefix_len else ((0, prefix_len), (a, b))
            cols = torch.cat([torch.arange(k0, k1, device=mask.device) for k0, k1 in keys])
            pieces.append(Piece(r, a, b, keys, mask[r:r + 1, :, a:b][..., cols]))
        rows.append(tuple(pieces))
    return PackedPieces(tuple(rows), inner)


def _inner_function(name: str, module: Any) -> Any:
    """The attention function the model runs for ``name``: transformers' ``sdpa``, or for
    ``eager`` the ``eager_attention_forward`` of the module's own modelling file (the default its
    attention falls back to)."""
    if name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as own
    return own


def block_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            packed_pieces: PackedPieces | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, one call per :class:`Piece`.

    Args:
        module: the attention module (its ``num_key_value_groups`` etc. are read by the inner
            function).
        query: (R, H, S, D); key, value: (R, H_kv, S, D) (after rotary embeddings).
        attention_mask: the whole rows' mask (used only without ``packed_pieces``).
        dropout, scaling: as transformers passes them.
        packed_pieces: from :func:`blocks_of`; None (a forward that did not pass it) runs
            ``sdpa`` on the whole rows.
        **kwargs: the forward's other keywords, handed to the inner function.

    Returns:
        ``(output (R, S, H, D), None)``, the layout transformers' functions return.
    """
    if packed_pieces is None:
        return _inner_function("sdpa", module)(module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    inner = _inner_function(packed_pieces.inner, module)
    rows = []
    for pieces in packed_pieces.pieces:
        outs = []
        for p in pieces:
            r = slice(p.row, p.row + 1)
            if len(p.keys) == 1:
                k, v = key[r, :, p.keys[0][0]:p.keys[0][1]], value[r, :, p.keys[0][0]:p.keys[0][1]]
            else:
                k = torch.cat([key[r, :, a:b] for a, b in p.keys], dim=2)
                v = torch.cat([value[r, :, a:b] for a, b in p.keys], dim=2)
            out, _ = inner(module, query[r, :, p.start:p.stop], k, v, p.mask, dropout=dropout, scaling=scaling,
                           **kwargs)
            outs.append(out)
        rows.append(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])
    return (torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]), None


def register() -> None:
    """Register :func:`block_attention_forward` (and ``sdpa``'s mask function, used only when a
    forward builds its own mask) under :data:`BLOCK_ATTENTION`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(BLOCK_ATTENTION, block_attention_forward)
    if BLOCK_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(BLOCK_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def block_attention(model: Any) -> Iterator[None]:
    """Within the block, ``model`` (or the model a peft model wraps) uses
    :func:`block_attention_forward`; its attention implementation is restored on exit, also
    after an exception. Not thread-safe: no other forward of ``model`` may run meanwhile."""
    register()
    get_base = getattr(model, "get_base_model", None)
    config = (get_base() if callable(get_base) else model).config
    before = config._attn_implementation
    config._attn_implementation = BLOCK_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
