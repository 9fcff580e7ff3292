"""Packed shared-prefix forward: each distinct prompt once, its responses packed after it.

The G responses of a prompt group share the prompt. :func:`packed_log_probs` lays out one row
per distinct prompt::

    [left padding | prompt | response 1 | response 2 | ... | response G | right padding]

and runs it under a block-causal attention mask: prompt tokens attend causally to the prompt;
a response token attends to the prompt and causally to the earlier tokens of its *own*
response only; padding attends to itself alone (so that no softmax row is empty). Position ids
restart after the prompt for every response (``prompt_len + t``), so each response token sees
exactly the keys, values and positions it sees in its own padded sequence: the log-probs and
their gradients are those of G separate forwards, up to floating-point summation order. No
response padding is computed, the prompt runs once, and logits are formed only at the
positions that predict a response token (the last prompt token and the response tokens).

This is the same idea as the KV-cache path of
:func:`echotrain.runtime.rollout.forward_log_probs` (the prompt once, its cache expanded to
the G responses), with two differences that save compute: the responses are not padded to
the longest one (the default job's responses average ~17 of at most 32 tokens), and no cache
is expanded and concatenated. It needs a model that takes a custom 4-D attention mask: a
Hugging Face causal LM with ``sdpa`` or ``eager`` attention and full attention in every layer
(:func:`supports_packed_forward`).

Source: the shared-prefix layout of "Prefix Grouper: Efficient GRPO Training through
Shared-Prefix Forward" (Liu et al. 2025, arXiv 2506.05433), written here for packed
responses under a 4-D mask.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

#: attention implementations whose forward applies a custom 4-D mask as given
PACKED_ATTENTION = ("sdpa", "eager")


def accepts_keyword(model: Any, name: str) -> bool:
    """Whether ``model.forward`` takes keyword ``name`` explicitly. A peft model (LoRA) passes
    its keyword arguments through to the wrapped model, so that model's forward is inspected."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def distinct_prompts(prompt_ids: torch.Tensor,
                     prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct prompts of a batch: ``(ids (U, P), mask (U, P) int64, inverse (N,))``, rows
    equal in ids *and* mask (equal ids with another padding are another prompt: possible when the
    pad id is a real token, e.g. eos); ``inverse[i]`` is row i's prompt. Used by both shared-prefix
    layouts (this module's and the KV-cache one of :func:`echotrain.runtime.rollout.forward_log_probs`)."""
    P = prompt_ids.shape[1]
    uniq, inv = torch.unique(torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], 1), dim=0,
                             return_inverse=True)
    return uniq[:, :P], uniq[:, P:].long(), inv


def supports_packed_forward(model: Any) -> bool:
    """Whether :func:`packed_log_probs` can run ``model``: a Hugging Face model (or a peft model
    around one) with ``sdpa``/``eager`` attention, no sliding-window or other non-full attention
    layer (a custom mask would replace the window), and ``position_ids`` and
    ``logits_to_keep`` arguments."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in PACKED_ATTENTION:
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    return accepts_keyword(model, "position_ids") and accepts_keyword(model, "logits_to_keep")


def is_prefix_mask(response_mask: torch.Tensor) -> bool:
    """Whether every row of ``response_mask`` (N, T) is ones then zeros (the layout
    :func:`packed_log_probs` needs; the rollouts' masks always are)."""
    lens = response_mask.sum(-1, keepdim=True)
    return bool(torch.equal(response_mask.bool(), torch.arange(response_mask.shape[1],
                                                               device=response_mask.device) < lens))


def packed_log_probs(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     response_mask: torch.Tensor, *, temperature: float = 1.0,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens, each distinct prompt run once with its responses packed.

    Args:
        model: a model for which :func:`supports_packed_forward` holds.
        prompt_ids, prompt_mask: (N, P) int64, left-padded; rows with equal ids and mask share
            one packed row (:func:`distinct_prompts`).
        response_ids: (N, T) int64; response_mask: (N, T), 1 then 0 in every row
            (:func:`is_prefix_mask`).
        temperature: logits are divided by it before the log-softmax.
        with_entropy: also return the entropy of each position's distribution (no grad).

    Returns:
        ``(log_prob, entropy)``: (N, T) float32 on the model's device, 0 off ``response_mask``
        (``log_prob`` differentiable when grad is enabled); ``entropy`` (N, T) float32 or None.

    Raises:
        ValueError: mismatched shapes, or a ``response_mask`` that is not a prefix mask.
    """
    if response_ids.shape != response_mask.shape or prompt_ids.shape != prompt_mask.shape \
            or len(prompt_ids) != len(response_ids):
        raise ValueError(f"shape mismatch: prompt {tuple(prompt_ids.shape)} vs mask {tuple(prompt_mask.shape)}, "
                         f"response {tuple(response_ids.shape)} vs mask {tuple(response_mask.shape)}")
    if not is_prefix_mask(response_mask):
        raise ValueError("response_mask: each row must be ones then zeros to be packed")
    device = prompt_ids.device
    N, T = response_ids.shape
    P = prompt_ids.shape[1]
    uniq, p_mask, inv = distinct_prompts(prompt_ids, prompt_mask)  # one packed row each
    U = len(uniq)
    lens = response_mask.sum(-1).long()
    # offset of each response inside its packed row: exclusive cumsum over the rows of its prompt
    order = torch.argsort(inv, stable=True)
    excl = torch.cumsum(lens[order], 0) - lens[order]
    group_start = torch.zeros(U, dtype=torch.long, device=device).scatter_reduce_(
        0, inv[order], excl, reduce="amin", include_self=False)
    offset = torch.empty_like(lens)
    offset[order] = excl - group_start[inv[order]]
    width = max(1, int(torch.zeros(U, dtype=torch.long, device=device).index_add_(0, inv, lens).max()))

    valid = response_mask.bool()
    t_idx = torch.arange(T, device=device).expand(N, T)
    col = (offset[:, None] + t_idx)[valid]  # packed column of every valid response token
    row = inv[:, None].expand(N, T)[valid]
    packed_ids = torch.zeros(U, width, dtype=response_ids.dtype, device=device)
    packed_ids[row, col] = response_ids[valid]
    seg = torch.full((U, width), -1, dtype=torch.long, device=device)  # response id of each column
    seg[row, col] = torch.arange(N, device=device)[:, None].expand(N, T)[valid]
    pos_in_resp = torch.zeros(U, width, dtype=torch.long, device=device)
    pos_in_resp[row, col] = t_idx[valid]

    p_len = p_mask.sum(-1, keepdim=True)
    input_ids = torch.cat([uniq, packed_ids], dim=1)
    position_ids = torch.cat([(p_mask.cumsum(-1) - 1).clamp(min=0), p_len + pos_in_resp], dim=1)

    S = P + width
    seg_full = torch.cat([torch.full((U, P), -2, dtype=torch.long, device=device), seg], dim=1)
    key_ok = torch.cat([p_mask.bool(), seg >= 0], dim=1)
    is_prompt = torch.arange(S, device=device) < P
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    allowed = causal & key_ok[:, None, :] & key_ok[:, :, None] \
        & ((seg_full[:, :, None] == seg_full[:, None, :]) | is_prompt[None, None, :])
    allowed |= torch.eye(S, dtype=torch.bool, device=device)  # padding: itself only (no empty softmax row)
    mask = allowed[:, None]
    if model.config._attn_implementation == "eager":  # additive float mask
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)

    # logits at columns P-1 .. P+width-2: index 0 predicts every response's first token
    extra = {"use_cache": False} if accepts_keyword(model, "use_cache") else {}  # no cache of the packed row
    logits = model(input_ids, attention_mask=mask, position_ids=position_ids,
                   logits_to_keep=width + 1, **extra).logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    pos = torch.where(t_idx == 0, 0, offset[:, None] + t_idx)  # (N, T) index into the kept logits
    r_inv = inv[:, None].expand(N, T)
    log_prob = torch.zeros(N, T, dtype=torch.float32, device=device)
    log_prob = log_prob.masked_scatter(valid, logp_all[r_inv[valid], pos[valid], response_ids[valid]])
    entropy = None
    if with_entropy:
        with torch.no_grad():
            lp = logp_all.detach()
            ent_all = -(lp.exp() * lp).sum(-1)  # (U, width)
            entropy = torch.zeros(N, T, dtype=torch.float32, device=device)
            entropy[valid] = ent_all[r_inv[valid], pos[valid]]
    return log_prob, entropy
