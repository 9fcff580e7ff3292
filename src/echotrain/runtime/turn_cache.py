"""Per-row KV caches kept between the turns of multi-turn episodes (docs/design/environments.md §3).

A model turn of an episode ends at its end-of-turn token; the environment then replies, and the
next turn continues the same trajectory. Running the whole trajectory through the model again
each turn repeats the prefill of everything said so far. Instead the decode loop
(:func:`~echotrain.runtime.decode.sample_tokens` with ``return_cache=True``) hands back, for each
row as it finishes, that row's keys and values over its attended positions only (padding
dropped): a :data:`RowCache`. The next turn stacks the live episodes' row caches into one batch
(:func:`stack_row_caches`), right-aligned with zero padding on the left that the attention mask
hides, and prefills only the ids not yet in the cache (the end-of-turn token and the
environment's ids).

Positions stay exact: the decode loop's position ids count attended positions only, and a row
cache holds exactly those, in order, so a key cached at position p is read again at position p.

Only plain caches (every layer a full-length key/value pair: transformers' ``DynamicCache`` of
``DynamicLayer`` s) are kept; :func:`layers_of` returns None for anything else (sliding-window,
quantised, offloaded, recurrent caches) and the episode falls back to running the trajectory
again (the reasons are listed in docs/design/environments.md §3).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RowCache", "cached_length", "layers_of", "row_cache", "stack_row_caches"]

#: One row's cache: per layer ``(keys, values)``, each (1, heads, L, head_dim), L = the row's
#: attended positions in order.
RowCache = list[tuple[torch.Tensor, torch.Tensor]]


def cached_length(row: RowCache) -> int:
    """The number of positions a :data:`RowCache` holds."""
    return int(row[0][0].shape[2])


def layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per-layer ``(keys, values)`` (N, heads, S, head_dim) of a plain cache, or None when
    ``cache`` is not one (a layer of another kind, e.g. sliding-window: not kept between turns)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not len(layers):
        return None
    out = []
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer" or getattr(layer, "keys", None) is None:
            return None
        out.append((layer.keys, layer.values))
    return out


def row_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], row: int, attended: torch.Tensor) -> RowCache:
    """Row ``row``'s keys and values at the positions where ``attended`` (S,) is nonzero, as a
    :data:`RowCache` of copies (the batch cache may be edited in place afterwards)."""
    keep = attended.bool().nonzero().squeeze(1)
    return [(k[row:row + 1].index_select(2, keep).clone(), v[row:row + 1].index_select(2, keep).clone())
            for k, v in layers]


def stack_row_caches(rows: list[RowCache]) -> tuple[Any, torch.Tensor]:
    """One batch cache from per-row caches of different lengths, right-aligned.

    Args:
        rows: n :data:`RowCache` s with the same layers, heads and head_dim; lengths L_r >= 1.

    Returns:
        ``(cache, mask)``: a ``transformers.DynamicCache`` whose layers are (n, heads, max L_r,
        head_dim), row r's L_r positions at the right and zeros before them; ``mask`` (n, max L_r)
        int64, 1 on those positions.

    Raises:
        ValueError: no rows, or rows with different numbers of layers.
    """
    from transformers import DynamicCache

    if not rows:
        raise ValueError("rows is empty")
    n_layers = len(rows[0])
    if any(len(r) != n_layers for r in rows):
        raise ValueError("row caches have different numbers of layers")
    lengths = [cached_length(r) for r in rows]
    width = max(lengths)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
    cache = DynamicCache()
    for layer in range(n_layers):
        k0, v0 = rows[0][layer]
        keys = k0.new_zeros(len(rows), k0.shape[1], width, k0.shape[3])
        values = v0.new_zeros(len(rows), v0.shape[1], width, v0.shape[3])
        for i, r in enumerate(rows):
            keys[i, :, width - lengths[i]:] = r[layer][0][0]
            values[i, :, width - lengths[i]:] = r[layer][1][0]
        cache.update(keys, values, layer)
    return cache, mask
