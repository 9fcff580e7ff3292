"""Pure counting: matmul FLOPs of decoder-only transformer passes and bytes of decode steps.

Nothing here touches a model, a clock or a file: the functions take a :class:`TransformerShape`
and token counts and return Python ints, so every number can be checked by hand.

What is counted (the accounting of Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1, and of PaLM, Chowdhery et al. 2022, appendix B: a multiply-add is 2 FLOPs,
the forward of a token costs 2 x (weights it meets) plus the attention scores, the backward costs
twice the forward):

- per token and layer application, the matrices: ``2 * P_layer`` with
  ``P_layer = d*(H*dh) + 2*d*(Hkv*dh) + (H*dh)*d + m*d*d_ff`` (Q, K, V, output projection,
  and ``m`` = 3 MLP matrices for a gated / SwiGLU MLP (Llama), 2 for a GELU MLP (GPT-2));
- attention: ``4 * H * dh`` per (query, key) pair per layer application (``QK^T`` and ``AV``,
  2 FLOPs per multiply-add each). We count the causal pairs exactly: a token at position j
  (1-based) of a sequence attends to j positions, so n new tokens after c cached ones make
  ``n*c + n*(n+1)/2`` pairs (:func:`causal_pairs`). Kaplan / PaLM write ``n_ctx`` per token
  (the full square); ours is the causal half, which is the work a causal kernel must do.
- the output projection (LM head): ``2 * d * V`` per position whose logits are needed.
- a looped transformer (one block applied N times) has ``n_layers = L * N`` layer applications:
  every loop is a full pass through the block's matrices.
- left out: embeddings lookups, norms, activations, softmax, RoPE, the loss (elementwise work,
  under 1% of the matmuls for the models here), and activation recomputation under gradient
  checkpointing (model FLOPs, not hardware FLOPs, as in PaLM's MFU).

What a pass *needs* (so padding and repeated prompts show up as lost utilisation, not as work):
a group of G responses to one prompt of ``p`` tokens needs the prompt once (``p`` tokens, one
logit: the last prompt position predicts the first response token) and per response of ``r``
valid tokens its first ``r - 1`` tokens on top of the prompt (the last token predicts nothing)
with ``r - 1`` logits (:func:`group_forward_flops`); the first C tokens that every prompt of
the pass shares (a system prompt, a few-shot example: ``common_prefix``) are needed once per
pass, not once per prompt. Generation needs the same prefill, then
``max(r) - 1`` decode steps, each reading the weights once for the whole batch and, per row
still generating, its KV cache (:func:`decode_bytes`), and per row the FLOPs of its new token
(:func:`decode_flops`). A decode step is bound by the larger of bytes / bandwidth and FLOPs / GEMM
rate (:func:`decode_roofline_seconds`, step by step, as rows finish): with one weight read shared by a batch of b rows it does ~2b FLOPs per weight read, so
from b ~ (GEMM FLOP/s) / (2 x bandwidth in weights/s) rows on it is compute-bound (on a 2-core
AVX2 EPYC in float32, ~160 GFLOP/s against ~29 GB/s, b ~ 11: the default 64 rows are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class TransformerShape:
    """The dimensions of a decoder-only transformer that its FLOPs and decode bytes depend on.

    Attributes:
        n_layers: layer applications per token (a looped model: unique layers x loops).
        d_model: residual width d.
        n_heads: query heads H.
        n_kv_heads: key/value heads Hkv (H for multi-head, fewer for grouped-query attention).
        d_head: per-head width dh (``d_model / n_heads`` for most models).
        d_ff: MLP hidden width.
        vocab_size: V, the LM head's output width.
        gated_mlp: True for a gated MLP with 3 matrices (SwiGLU, Llama), False for 2 (GELU).

    Raises:
        ValueError: a dimension < 1 (names the field).
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    vocab_size: int
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerShape.{name} must be a positive integer, got {value!r}")

    @property
    def layer_matrix_params(self) -> int:
        """P_layer: weights in one layer application's matrices,
        ``d*H*dh + 2*d*Hkv*dh + H*dh*d + (3 if gated else 2)*d*d_ff``."""
        d, q, kv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return d * q + 2 * d * kv + q * d + (3 if self.gated_mlp else 2) * d * self.d_ff

    @property
    def decode_weights(self) -> int:
        """Weights a decode step reads: ``n_layers * P_layer + V * d`` (the LM head; the embedding
        lookup reads only the batch's rows and is left out; a looped block is read once per loop)."""
        return self.n_layers * self.layer_matrix_params + self.vocab_size * self.d_model

    @property
    def kv_width(self) -> int:
        """Cached numbers per token over all layer applications: ``2 * n_layers * Hkv * dh`` (K and V)."""
        return 2 * self.n_layers * self.n_kv_heads * self.d_head


def causal_pairs(n_new: int, n_past: int = 0) -> int:
    """(query, key) pairs when ``n_new`` tokens attend causally after ``n_past`` cached ones:
    ``n_new * n_past + n_new * (n_new + 1) / 2`` (token j of the new ones sees ``n_past + j``)."""
    if n_new < 0 or n_past < 0:
        raise ValueError(f"n_new and n_past must be >= 0, got n_new={n_new}, n_past={n_past}")
    return n_new * n_past + n_new * (n_new + 1) // 2


def forward_flops(shape: TransformerShape, n_tokens: int, attn_pairs: int, n_logits: int) -> int:
    """Forward FLOPs of ``n_tokens`` tokens making ``attn_pairs`` causal (query, key) pairs, with
    logits at ``n_logits`` positions:

        2 * n_tokens * n_layers * P_layer  +  4 * n_layers * H * dh * attn_pairs  +  2 * n_logits * d * V

    Raises:
        ValueError: a negative count.
    """
    if min(n_tokens, attn_pairs, n_logits) < 0:
        raise ValueError(f"counts must be >= 0, got n_tokens={n_tokens}, attn_pairs={attn_pairs}, "
                         f"n_logits={n_logits}")
    s = shape
    return (2 * n_tokens * s.n_layers * s.layer_matrix_params
            + 4 * s.n_layers * s.n_heads * s.d_head * attn_pairs
            + 2 * n_logits * s.d_model * s.vocab_size)


def prefill_flops(shape: TransformerShape, prompt_lens: Sequence[int], common_prefix: int = 0) -> int:
    """Forward FLOPs of prefilling each distinct prompt once: per prompt of ``p`` tokens
    ``forward_flops(p tokens, causal_pairs(p), 1 logit)``, less the ``common_prefix`` tokens that
    all prompts share computed once instead of once per prompt (:func:`shared_prefix_saving`).

    Raises:
        ValueError: ``common_prefix`` < 0 or not below every prompt's length.
    """
    total = sum(forward_flops(shape, p, causal_pairs(p), 1) for p in prompt_lens)
    return total - shared_prefix_saving(shape, common_prefix, [int(p) for p in prompt_lens])


def shared_prefix_saving(shape: TransformerShape, common_prefix: int, prompt_lens: Sequence[int]) -> int:
    """FLOPs not needed when K prompts that share their first C = ``common_prefix`` tokens compute
    them once: ``(K - 1) * forward_flops(C, causal_pairs(C), 0)``. Exact: a prompt's rest attends
    to the C shared keys as before (``causal_pairs(p) = causal_pairs(C) + causal_pairs(p - C, C)``).

    Raises:
        ValueError: ``common_prefix`` < 0 or not below every prompt's length.
    """
    if common_prefix < 0 or (common_prefix and min(prompt_lens, default=0) <= common_prefix):
        raise ValueError(f"common_prefix must be >= 0 and below every prompt's length, got {common_prefix} "
                         f"for prompt lengths {list(prompt_lens)}")
    if not common_prefix or len(prompt_lens) < 2:
        return 0
    return (len(prompt_lens) - 1) * forward_flops(shape, common_prefix, causal_pairs(common_prefix), 0)


def group_forward_flops(shape: TransformerShape, prompt_len: int, response_lens: Sequence[int]) -> int:
    """Forward FLOPs that the log-probs of one prompt group need: the prompt once
    (:func:`prefill_flops`), then per response of ``r`` valid tokens its first ``r - 1`` tokens on
    top of the prompt: ``forward_flops(r - 1, causal_pairs(r - 1, p), r - 1 logits)``. The group
    gets ``sum(r)`` log-probs. A with-grad forward plus backward is 3x this (:func:`train_flops`)."""
    total = prefill_flops(shape, [prompt_len])
    for r in response_lens:
        n = max(int(r) - 1, 0)
        total += forward_flops(shape, n, causal_pairs(n, prompt_len), n)
    return total


def batch_forward_flops(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int],
                        group_index: Sequence[int], common_prefix: int = 0) -> int:
    """:func:`group_forward_flops` summed over the groups of a batch of rows, less the groups'
    ``common_prefix`` computed once (:func:`shared_prefix_saving`).

    Args:
        prompt_lens: (N,) real prompt tokens per row (rows of a group share the prompt).
        response_lens: (N,) valid response tokens per row.
        group_index: (N,) the group of each row; rows with the same id share the prompt.
        common_prefix: the first tokens every group's prompt shares
            (:func:`echotrain.runtime.packing.common_prefix_len`; 0: none).

    Raises:
        ValueError: the three sequences differ in length; a ``common_prefix`` as in
            :func:`shared_prefix_saving`.
    """
    if not len(prompt_lens) == len(response_lens) == len(group_index):
        raise ValueError(f"prompt_lens, response_lens and group_index must have one entry per row, got "
                         f"{len(prompt_lens)}, {len(response_lens)}, {len(group_index)}")
    groups: dict[int, tuple[int, list[int]]] = {}
    for p, r, g in zip(prompt_lens, response_lens, group_index):
        groups.setdefault(int(g), (int(p), []))[1].append(int(r))
    return (sum(group_forward_flops(shape, p, rs) for p, rs in groups.values())
            - shared_prefix_saving(shape, common_prefix, [p for p, _ in groups.values()]))


def train_flops(forward: int) -> int:
    """FLOPs of a with-grad forward plus its backward: ``3 * forward`` (the backward computes the
    gradients of the activations and of the weights, 2x the forward; Kaplan et al. 2020, 2.1)."""
    return 3 * forward


def decode_bytes(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int],
                 *, param_bytes: int, kv_bytes: int) -> int:
    """Bytes the decode steps of one ``generate`` call must read (the prefill excluded).

    The prefill's logits give each row its first token, so the call makes ``S = max(r) - 1``
    decode steps. Each reads the weights once for the whole batch, ``decode_weights * param_bytes``,
    and, per row still generating (step s = 1..r_i - 1 of row i), the KV cache of its
    ``p_i + s`` positions, ``kv_width * kv_bytes`` bytes each:

        S * decode_weights * param_bytes
        + kv_width * kv_bytes * sum_i [ (r_i - 1) * p_i + (r_i - 1) * r_i / 2 ]

    Args:
        prompt_lens, response_lens: (N,) real prompt tokens and valid response tokens per row.
        param_bytes: bytes per stored weight (4 for float32); kv_bytes: per cached number.

    Raises:
        ValueError: the sequences differ in length, or a byte size < 1.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens and response_lens differ in length: {len(prompt_lens)} vs {len(response_lens)}")
    if param_bytes < 1 or kv_bytes < 1:
        raise ValueError(f"param_bytes and kv_bytes must be >= 1, got {param_bytes}, {kv_bytes}")
    if not len(response_lens):
        return 0
    steps = max(max(int(r) for r in response_lens) - 1, 0)
    kv_positions = 0
    for p, r in zip(prompt_lens, response_lens):
        n = max(int(r) - 1, 0)
        kv_positions += n * int(p) + n * (n + 1) // 2
    return steps * shape.decode_weights * param_bytes + shape.kv_width * kv_bytes * kv_positions


def decode_flops(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
    """Forward FLOPs of the decode steps of one ``generate`` call (the prefill excluded): per row
    of ``p`` prompt and ``r`` valid response tokens, its first ``r - 1`` tokens one at a time on top
    of the cache, ``forward_flops(r - 1, causal_pairs(r - 1, p), r - 1 logits)`` (the same work as
    the response part of :func:`group_forward_flops`).

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens and response_lens differ in length: {len(prompt_lens)} vs {len(response_lens)}")
    total = 0
    for p, r in zip(prompt_lens, response_lens):
        n = max(int(r) - 1, 0)
        total += forward_flops(shape, n, causal_pairs(n, int(p)), n)
    return total


def decode_roofline_seconds(shape: TransformerShape, prompt_lens: Sequence[int], response_lens: Sequence[int], *,
                            param_bytes: int, kv_bytes: int, gemm_flops_per_s: float,
                            mem_bytes_per_s: float) -> float:
    """Roofline time of the decode steps of one ``generate`` call: per step s = 1..max(r) - 1, with
    A_s the rows still generating (r_i - 1 >= s),

        max( (decode_weights * param_bytes + kv_width * kv_bytes * sum_{i in A_s} (p_i + s)) / mem_bytes_per_s,
             sum_{i in A_s} forward_flops(1 token, p_i + s pairs, 1 logit) / gemm_flops_per_s )

    summed over the steps. Over all steps the two numerators add up to :func:`decode_bytes` and
    :func:`decode_flops`; taking the larger per step (not of the sums) lets a call be compute-bound
    while many rows generate and bandwidth-bound once most have finished.

    Raises:
        ValueError: the sequences differ in length, a byte size < 1 or a peak <= 0.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens and response_lens differ in length: {len(prompt_lens)} vs {len(response_lens)}")
    if param_bytes < 1 or kv_bytes < 1:
        raise ValueError(f"param_bytes and kv_bytes must be >= 1, got {param_bytes}, {kv_bytes}")
    if not (gemm_flops_per_s > 0 and mem_bytes_per_s > 0):
        raise ValueError(f"peaks must be > 0, got gemm_flops_per_s={gemm_flops_per_s}, "
                         f"mem_bytes_per_s={mem_bytes_per_s}")
    rows = [(int(p), max(int(r) - 1, 0)) for p, r in zip(prompt_lens, response_lens)]
    steps = max((n for _, n in rows), default=0)
    weights = shape.decode_weights * param_bytes
    total = 0.0
    for s in range(1, steps + 1):
        contexts = [p + s for p, n in rows if n >= s]
        nbytes = weights + shape.kv_width * kv_bytes * sum(contexts)
        flops = sum(forward_flops(shape, 1, c, 1) for c in contexts)
        total += max(nbytes / mem_bytes_per_s, flops / gemm_flops_per_s)
    return total
