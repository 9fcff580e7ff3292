"""Small trainer options that TRL / verl users expect: gradient checkpointing, a chat template
override, and which completions go to samples.jsonl.

Kept apart from the trainer loop; each function is one option.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["checkpointed_forward", "enable_gradient_checkpointing", "prepare_policy", "sparse_tied_embedding_grad",
           "spread_sample_rows", "tied_trainable_embedding"]


def prepare_policy(model: Any, tokenizer: Any, cfg: Any, device: torch.device, dist: Any) -> tuple[Any, Any]:
    """The trainer's policy from a loaded ``model`` / ``tokenizer`` and the run config ``cfg``:
    moved to ``device``, wrapped with LoRA adapters when ``cfg.lora_r > 0``, rank 0's weights
    broadcast to every rank (``dist``: :class:`echotrain.train.dist.DistContext`), in eval mode
    (no dropout: the ECHO pre-pass and the with-grad pass must compute the same function),
    the tied input embedding's gradient made sparse (``sparse_embedding_grad``), gradient
    checkpointing and the chat-template override applied when configured.

    Raises:
        ValueError: ``gradient_checkpointing`` on a model without support for it.
    """
    from echotrain.runtime.chat_template import read_chat_template
    from echotrain.runtime.lora import apply_lora

    model = model.to(device)
    if cfg.lora_r > 0:
        model = apply_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                           target_modules=cfg.lora_target_modules)
    dist.broadcast_params(model)  # every rank starts from rank 0's weights (and adapters)
    model.eval()
    if cfg.sparse_embedding_grad:
        sparse_tied_embedding_grad(model)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.chat_template:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    return model, tokenizer


def sparse_tied_embedding_grad(model: Any) -> bool:
    """Make the backward of ``model``'s input embedding (``get_input_embeddings()``, an
    ``nn.Embedding``) sparse, rows of the looked-up tokens only, when its weight is trainable and
    tied to the output layer (``get_output_embeddings().weight`` is the same tensor; SmolLM2 and
    the small Qwen2.5 models). The dense backward allocates a (vocab, hidden) zero tensor, scatters
    the rows into it and adds it to the output layer's gradient of the same weight, every
    micro-batch (for SmolLM2's 49,152 x 576: 0.80x of the forward + backward time on one thread of
    a loaded 2-core CPU, within noise on two quiet threads: docs/benchmarks.md, "Three passes fewer
    in the update"; so ``sparse_embedding_grad`` is off by default). With the weight tied, autograd
    sums the sparse part into the output layer's dense gradient, so ``.grad`` stays dense (what
    the optimizers and ``clip_grad_norm_`` take) and equal up to float summation order. An untied
    embedding would leave a sparse ``.grad`` that AdamW refuses, so it is left as it is, as is a
    frozen one (LoRA). Returns whether the embedding was changed."""
    emb = tied_trainable_embedding(model)
    if emb is None:
        return False
    emb.sparse = True
    return True


def tied_trainable_embedding(model: Any) -> torch.nn.Embedding | None:
    """``model``'s input embedding when it is an ``nn.Embedding`` whose weight is trainable and is
    the output layer's weight (the case :func:`sparse_tied_embedding_grad` changes), else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, out = get_in(), get_out()
    if not isinstance(emb, torch.nn.Embedding) or getattr(out, "weight", None) is not emb.weight:
        return None
    return emb if emb.weight.requires_grad else None


def enable_gradient_checkpointing(model: Any) -> None:
    """Turn on transformers' gradient checkpointing (non-reentrant) on ``model``.

    transformers only recomputes activations in ``train()`` mode, so the trainer runs its
    with-grad forward inside :func:`checkpointed_forward`, which switches to train mode with
    every dropout module kept in eval mode (the policy must stay dropout-free: the ECHO pre-pass
    and the with-grad pass must compute the same function). transformers turns the KV cache off
    under checkpointing, so that pass shares prompt prefixes only through the packed layout
    (``pack_responses``; :mod:`echotrain.runtime.packing`), not through an expanded cache.

    Raises:
        ValueError: the model does not support gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing=true: {type(model).__name__} does not support gradient checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if float(getattr(model.config, key, 0.0) or 0.0) > 0:
            setattr(model.config, key, 0.0)


@contextlib.contextmanager
def checkpointed_forward(model: Any) -> Iterator[None]:
    """Train mode for checkpointing, with every ``nn.Dropout`` left in eval mode; restores eval."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.eval()
    try:
        yield
    finally:
        model.eval()


def spread_sample_rows(group_index: torch.Tensor, n: int) -> list[int]:
    """Up to ``n`` row indices taken round-robin over prompt groups: the first completion of
    each group in order, then the second of each, ... so samples.jsonl shows several prompts.

    Args:
        group_index: (N,) int64 group id of each row.
        n: how many rows.
    """
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index.tolist()):
        groups.setdefault(int(g), []).append(i)
    out: list[int] = []
    depth = 0
    while len(out) < n and any(depth < len(v) for v in groups.values()):
        for rows in groups.values():
            if depth < len(rows) and len(out) < n:
                out.append(rows[depth])
        depth += 1
    return out
