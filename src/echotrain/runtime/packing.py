"""Packed shared-prefix forward: the prompts' common prefix and each distinct prompt once, the
responses packed after their prompt.

The G responses of a prompt group share the prompt, and the prompts of a batch often share a
prefix too (a system prompt, a few-shot exchange: 76 of the default task's ~88 prompt tokens).
:func:`pack_layout` lays a batch out in packed rows::

    [common prefix | prompt 1's rest | its responses | prompt 2's rest | its responses | ... | padding]

and :func:`packed_log_probs` runs them under a block mask: every token attends causally to the
common prefix; a prompt's own tokens and its responses attend to that prompt's rest; a
response token attends causally to the earlier tokens of its *own* response only; padding
attends to the prefix and padding (no softmax row is empty). Position ids are each token's
position in its own unpadded ``prompt + response``, so each response token sees exactly the
keys, values and positions of its own sequence: the log-probs and their gradients are those of
separate forwards, up to floating-point summation order. No padding inside a row is computed,
the common prefix runs once per row, every other prompt token once, a response's last token
not at all (a target only), and logits are formed only at the columns that predict a response
token. A row takes prompts (with their responses) while
it stays within :data:`PACKED_ROW_TOKENS` tokens: attention costs a row's length squared.

This is the same idea as the KV-cache path of :func:`echotrain.runtime.rollout.forward_log_probs`
(each distinct prompt once, its cache expanded to the G responses), with three differences that
save compute: the responses are not padded to the longest one (the default job's responses
average ~17 of at most 32 tokens), no cache is expanded and concatenated, and the common prefix
of different prompts runs once. It needs a model that takes a custom 4-D attention mask and a
boolean ``logits_to_keep``: a Hugging Face causal LM with ``sdpa`` or ``eager`` attention and
full attention in every layer (:func:`supports_packed_forward`).

Source: the shared-prefix layout of "Prefix Grouper: Efficient GRPO Training through
Shared-Prefix Forward" (Liu et al. 2025, arXiv 2506.05433), written here for packed responses
and a prefix common to several prompts under a 4-D mask.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from echotrain.runtime.block_attention import block_attention, blocks_of

#: attention implementations whose forward applies a custom 4-D mask as given
PACKED_ATTENTION = ("sdpa", "eager")
#: the values of the ``packed_attention`` setting: how a packed row's attention runs.
#: ``blocks``: one call per block against the keys it may see (:mod:`echotrain.runtime.block_attention`);
#: ``mask``: one call over the whole row under the block mask
PACKED_ATTENTION_MODES = ("blocks", "mask")


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
    layout of :func:`echotrain.runtime.rollout.forward_log_probs` (:func:`pack_layout` groups by
    the real tokens alone)."""
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
    if getattr(config, "_attn_implementation", None) not in PACKED_ATTENTION or has_window_attention(model):
        return False
    return accepts_keyword(model, "position_ids") and accepts_keyword(model, "logits_to_keep")


def has_window_attention(model: Any) -> bool:
    """Whether some layer of ``model`` attends within a window (sliding-window or another
    non-full attention): its window counts columns, not positions, so a layout with padding or
    other prompts between a token and its keys would change what it sees (:func:`packed_log_probs`
    and the common-prefix prefill of :func:`echotrain.runtime.rollout._prefill` do not apply)."""
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return True
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def is_prefix_mask(response_mask: torch.Tensor) -> bool:
    """Whether every row of ``response_mask`` (N, T) is ones then zeros (the layout
    :func:`packed_log_probs` needs; the rollouts' masks always are)."""
    lens = response_mask.sum(-1, keepdim=True)
    return bool(torch.equal(response_mask.bool(), torch.arange(response_mask.shape[1],
                                                               device=response_mask.device) < lens))


def common_prefix_len(prompts: list[torch.Tensor]) -> int:
    """C: the leading tokens that every prompt shares, at most the shortest prompt's length - 1
    (each prompt keeps a token of its own: its last token's output predicts the first response
    token). The part that :func:`pack_layout`, the rollout prefill
    (:func:`echotrain.runtime.rollout._prefill`) and the FLOP counts
    (:mod:`echotrain.roofline.counts`) take once.

    Args:
        prompts: the prompts' real tokens, 1-D int64 tensors, each at least one token.

    Raises:
        ValueError: no prompts, or an empty one.
    """
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("prompts: need at least one prompt, each with at least one token")
    C = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        differ = (p[:C] != prompts[0][:C]).nonzero()
        if len(differ):
            C = int(differ[0])
    return C


def real_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[torch.Tensor]:
    """The real tokens of each row (ids where ``prompt_mask`` is 1): a list of N 1-D tensors."""
    return [row[m.bool()] for row, m in zip(prompt_ids, prompt_mask)]


def common_prefix_of(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """:func:`common_prefix_len` of a batch's (N, P) left-padded prompts; 0 for a batch without
    rows or with an empty prompt (the FLOP counts of :mod:`echotrain.train.utilisation`)."""
    prompts = real_prompts(prompt_ids, prompt_mask)
    return common_prefix_len(prompts) if prompts and min(len(p) for p in prompts) else 0


#: ``block`` of the common prefix's columns (every later prompt and response token may attend them)
PREFIX = -1
#: ``block`` / ``segment`` of padding columns (attended by padding alone)
PAD = -2
#: ``segment`` of prompt columns (the common prefix's and each prompt's rest)
PROMPT = -1
#: a packed row takes the next prompt's block only while it stays within this many tokens (or
#: holds no block yet): attention over a row costs its length squared, so long rows of prompts
#: that share little are split. Our choice (docs/design/architecture.md, the runtime/packing.py entry).
PACKED_ROW_TOKENS = 1024


@dataclass
class PackLayout:
    """Where every token of a batch sits in its packed rows (R rows of S columns).

    Attributes:
        input_ids, position: (R, S) int64: token ids (0 on padding) and position ids (each
            token's position in its own unpadded sequence ``prompt + response``).
        block: (R, S) int64: :data:`PREFIX` for the common prefix, ``u`` for the rest of
            distinct prompt ``u`` and its responses, :data:`PAD` for padding.
        segment: (R, S) int64: ``n`` on the input tokens of response ``n`` (all but its last),
            :data:`PROMPT` on prompt tokens, :data:`PAD` on padding.
        predictor: (M,) int64: for each of the M valid response tokens (the ones of ``response_mask`` in
            row-major order), the column whose output predicts it (the last prompt column for a
            response's first token, else the response's previous token).
        token_row: (M,) int64: the packed row of each valid response token.
        prefix_len: C, the tokens that every distinct prompt shares (at most its length - 1).
    """

    input_ids: torch.Tensor
    position: torch.Tensor
    block: torch.Tensor
    segment: torch.Tensor
    predictor: torch.Tensor
    token_row: torch.Tensor
    prefix_len: int

    def attention_mask(self) -> torch.Tensor:
        """(R, S, S) bool, True where query column i may attend key column j: causally, every
        token sees the common prefix; a prompt's tokens and responses see its own prompt tokens;
        a response token sees its own response; padding sees the prefix and padding."""
        S = self.block.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=self.block.device).tril()
        bq, bk = self.block[:, :, None], self.block[:, None, :]
        sq, sk = self.segment[:, :, None], self.segment[:, None, :]
        return causal & ((bk == PREFIX) | ((bk == bq) & ((sk == PROMPT) | (sk == sq))))


def pack_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                response_mask: torch.Tensor, *, row_tokens: int | None = None) -> PackLayout:
    """Lay a batch out in packed rows: ``[common prefix | prompt 1's rest | its responses |
    prompt 2's rest | its responses | ... | padding]``, each response without its last token
    (a target only: its output predicts nothing).

    Args:
        prompt_ids, prompt_mask: (N, P) int64, left-padded, each row at least one prompt token;
            rows with the same prompt tokens share one block.
        response_ids, response_mask: (N, T) int64, ``response_mask`` a prefix mask.
        row_tokens: a row takes another block while it stays within this length (None:
            :data:`PACKED_ROW_TOKENS`).

    Returns:
        :class:`PackLayout` on ``prompt_ids``' device.
    """
    device = prompt_ids.device  # built on the CPU (small tensors, Python loops), moved once
    prompt_ids, prompt_mask, response_ids = prompt_ids.cpu(), prompt_mask.cpu(), response_ids.cpu()
    row_tokens = PACKED_ROW_TOKENS if row_tokens is None else row_tokens
    lens = response_mask.long().sum(-1).tolist()
    block_of: dict[tuple, int] = {}  # distinct prompt tokens -> block, in order of first appearance
    inv = [block_of.setdefault(tuple(r.tolist()), len(block_of)) for r in real_prompts(prompt_ids, prompt_mask)]
    prompts = [torch.tensor(k, dtype=torch.long) for k in block_of]
    members: list[list[int]] = [[] for _ in prompts]
    for n, u in enumerate(inv):
        members[u].append(n)
    C = common_prefix_len(prompts)
    # a response's last token is a target only (its output predicts nothing): not an input column
    size = [len(p) - C + sum(max(lens[n] - 1, 0) for n in members[u]) for u, p in enumerate(prompts)]
    rows: list[list[int]] = [[]]
    filled = C
    for u in range(len(prompts)):
        if rows[-1] and filled + size[u] > row_tokens:
            rows.append([])
            filled = C
        rows[-1].append(u)
        filled += size[u]
    R, S = len(rows), max(C + sum(size[u] for u in row) for row in rows)
    input_ids = torch.zeros(R, S, dtype=torch.long)
    position = torch.zeros(R, S, dtype=torch.long)
    block = torch.full((R, S), PAD, dtype=torch.long)
    segment = torch.full((R, S), PAD, dtype=torch.long)
    predictor = [torch.zeros(0, dtype=torch.long)] * len(lens)  # per response, in row order
    token_row = [torch.zeros(0, dtype=torch.long)] * len(lens)
    for r, row in enumerate(rows):
        input_ids[r, :C], position[r, :C] = prompts[row[0]][:C], torch.arange(C)
        block[r, :C], segment[r, :C] = PREFIX, PROMPT
        c = C
        for u in row:
            rest = prompts[u][C:]
            c2 = c + len(rest)
            input_ids[r, c:c2], position[r, c:c2] = rest, torch.arange(C, len(prompts[u]))
            block[r, c:c2], segment[r, c:c2] = u, PROMPT
            last_prompt, c = c2 - 1, c2
            for n in members[u]:
                L = lens[n]
                k = max(L - 1, 0)  # input columns: every token but the last
                input_ids[r, c:c + k] = response_ids[n, :k]
                position[r, c:c + k] = torch.arange(len(prompts[u]), len(prompts[u]) + k)
                block[r, c:c + k], segment[r, c:c + k] = u, n
                predictor[n] = torch.cat([torch.tensor([last_prompt]), torch.arange(c, c + k)])[:L]
                token_row[n] = torch.full((L,), r)
                c += k
    # concatenated in response order = the row-major order of response_mask's ones
    return PackLayout(*(t.to(device) for t in (input_ids, position, block, segment, torch.cat(predictor),
                                               torch.cat(token_row))), C)


def packed_log_probs(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     response_mask: torch.Tensor, *, temperature: float = 1.0,
                     with_entropy: bool = False, attention: str = "blocks",
                     entropy_grad: bool = False, full: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens: the prompts' common prefix once per packed row, each
    distinct prompt's rest once, its responses packed after it.

    Args:
        model: a model for which :func:`supports_packed_forward` holds.
        prompt_ids, prompt_mask: (N, P) int64, left-padded, at least one prompt token a row;
            rows with the same prompt tokens (ids where the mask is 1) share one block.
        response_ids: (N, T) int64; response_mask: (N, T), 1 then 0 in every row
            (:func:`is_prefix_mask`).
        temperature: logits are divided by it before the log-softmax.
        with_entropy: also return the entropy of each position's distribution (no grad, unless
            ``entropy_grad``: then differentiable, for an entropy term of the loss).
        attention: one of :data:`PACKED_ATTENTION_MODES`: ``blocks`` runs each row's attention
            block by block (:mod:`echotrain.runtime.block_attention`) for ``sdpa`` models; the
            whole-row ``mask`` for ``eager`` ones and for a with-grad forward under gradient
            checkpointing (whose recomputation would not see the blocks).

        full: return the whole log-softmax ``(N, T, V)`` (0 off ``response_mask``) in place of
            ``log_prob``, and no entropy (on-policy distillation, docs/design/objectives.md §12).

    Returns:
        ``(log_prob, entropy)``: (N, T) float32 on the model's device, 0 off ``response_mask``
        (``log_prob`` differentiable when grad is enabled); ``entropy`` (N, T) float32 or None.

    Raises:
        ValueError: mismatched shapes, a ``response_mask`` that is not a prefix mask, a row
            without prompt tokens, or an unknown ``attention``.
    """
    if attention not in PACKED_ATTENTION_MODES:
        raise ValueError(f"attention must be one of {PACKED_ATTENTION_MODES}, got {attention!r}")
    if response_ids.shape != response_mask.shape or prompt_ids.shape != prompt_mask.shape \
            or len(prompt_ids) != len(response_ids):
        raise ValueError(f"shape mismatch: prompt {tuple(prompt_ids.shape)} vs mask {tuple(prompt_mask.shape)}, "
                         f"response {tuple(response_ids.shape)} vs mask {tuple(response_mask.shape)}")
    if not is_prefix_mask(response_mask):
        raise ValueError("response_mask: each row must be ones then zeros to be packed")
    if not bool(prompt_mask.bool().any(-1).all()):
        raise ValueError("prompt_mask: every row needs at least one prompt token to be packed")
    device = prompt_ids.device
    N, T = response_ids.shape
    layout = pack_layout(prompt_ids, prompt_mask, response_ids, response_mask)
    R, S = layout.input_ids.shape
    mask = layout.attention_mask()[:, None]
    if model.config._attn_implementation == "eager":  # additive float mask
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    # logits only at the columns that predict a response token: (K, V) in row-major column order
    keep = torch.zeros(R, S, dtype=torch.bool, device=device)
    keep[layout.token_row, layout.predictor] = True
    if not keep.any():
        keep[0, -1] = True  # no response token: one column, so that the forward has an output
    where = (keep.flatten().long().cumsum(0) - 1)[layout.token_row * S + layout.predictor]  # (M,) into the K kept
    extra: dict[str, Any] = {"use_cache": False} if accepts_keyword(model, "use_cache") else {}  # no cache
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing is None:
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    # under checkpointing the with-grad forward is recomputed in the backward, without the blocks
    recomputed = checkpointing and base.training and torch.is_grad_enabled()
    switch = contextlib.nullcontext()
    if attention == "blocks" and model.config._attn_implementation == "sdpa" and not recomputed:
        extra["packed_pieces"] = blocks_of(layout.block, layout.prefix_len, mask)
        switch = block_attention()
    with switch:
        logits = model(layout.input_ids, attention_mask=mask, position_ids=layout.position,
                       logits_to_keep=keep, **extra).logits.float()
    logits = logits.reshape(-1, logits.shape[-1])
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # (K, V)
    valid = response_mask.bool()
    if full:  # every position's distribution, (N, T, V), 0 off response_mask
        out = torch.zeros(N, T, logp_all.shape[-1], dtype=torch.float32, device=device)
        return out.masked_scatter(valid.unsqueeze(-1), logp_all[where]), None
    log_prob = torch.zeros(N, T, dtype=torch.float32, device=device)
    log_prob = log_prob.masked_scatter(valid, logp_all[where, response_ids[valid]])
    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            lp = logp_all if entropy_grad else logp_all.detach()
            entropy = torch.zeros(N, T, dtype=torch.float32, device=device)
            entropy = entropy.masked_scatter(valid, (-(lp.exp() * lp).sum(-1))[where])
    return log_prob, entropy
