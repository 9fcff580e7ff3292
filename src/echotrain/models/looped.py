"""A looped (weight-tied) decoder-only transformer with loop-aware residual scaling.

One block of ``L`` unique pre-norm layers is applied ``N`` times. Every residual branch (attention
and MLP, in every layer, in every loop) is scaled by one multiplier

    h <- h + eps * f_l(Norm(h)),    eps = lambda / (N * sqrt(L))           ("1/N", the default)

which is the residual scaling of Wang, Li, Zhang et al., "On the Residual Scaling of Looped
Transformers: Stability and Transferability" (arXiv 2606.18524): weight tying makes the N updates
of one layer correlated, so they add up like N (not sqrt(N)) and need 1/N; the L distinct layers
add up like independent terms and need 1/sqrt(L). The claimed consequence is that the best
learning rate depends on L but not on N. ``residual_scaling="1/sqrt(N)"`` (lambda / sqrt(N L), the
untied depth-scaling rule) and ``"none"`` (lambda) are there to run the paper's comparison.

The layers are Llama-style (RMSNorm, rotary positions, no biases) with a GPT-2 GELU MLP; read top
to bottom: config, attention, MLP, layer, model. The model speaks the small part of the Hugging
Face causal-LM interface that echotrain's trainer uses: ``model(input_ids, attention_mask=...)``
returns an object with ``.logits`` (B, T, V), and ``model.generate(...)`` samples with a KV cache
from left-padded prompts.

Choices of ours (the paper's abstract leaves them open), each a flag of :class:`LoopedConfig`:
lambda is one constant for all branches; weights use the plain N(0, 0.02) init without GPT-2's
extra 1/sqrt(2 * depth) on output projections (eps already carries the depth); input injection,
when on, adds ``eps * x0`` (the token embeddings) at the start of every loop after the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from echotrain.roofline.counts import TransformerShape

RESIDUAL_SCALINGS = ("1/N", "1/sqrt(N)", "none")

# One (key, value) pair per layer application: N * L entries, each (B, heads, T_past, d_head).
KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass
class LoopedConfig:
    """Configuration of :class:`LoopedTransformer`.

    Raises ``ValueError`` (from ``__post_init__``) naming the field when a value is invalid.
    """

    vocab_size: int = 256
    """Number of token ids (256 for byte-level text)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``, and ``d_model / n_heads`` must be even (RoPE)."""
    n_layers: int = 1
    """L: unique pre-norm layers in the looped block."""
    n_loops: int = 4
    """N: how many times the block is applied."""
    residual_scaling: str = "1/N"
    """Multiplier rule for every residual branch: "1/N" -> lambda / (N sqrt L) (Wang et al. 2026,
    recommended), "1/sqrt(N)" -> lambda / sqrt(N L) (untied depth scaling), "none" -> lambda."""
    lam: float = 1.0
    """lambda, the constant in front of the residual multiplier (ours: one value for all branches)."""
    input_injection: bool = False
    """Ours: add eps * x0 (token embeddings) at the start of each loop after the first."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    rope_base: float = 10000.0
    """Base of the rotary position frequencies (RoFormer, Su et al. 2021)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output projection (one tensor, as in GPT-2)."""
    init_std: float = 0.02
    """Std of the normal init of every linear and embedding weight (ours: no depth factor)."""
    pad_token_id: int | None = None
    """Default padding id for :meth:`LoopedTransformer.generate`."""
    eos_token_id: int | None = None
    """Default end-of-sequence id for :meth:`LoopedTransformer.generate`."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "n_loops", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads} with an even "
                "head size (rotary embeddings rotate pairs of channels)"
            )
        if self.residual_scaling not in RESIDUAL_SCALINGS:
            raise ValueError(f"residual_scaling={self.residual_scaling!r} is unknown; valid: {list(RESIDUAL_SCALINGS)}")
        if not (math.isfinite(self.lam) and self.lam > 0):
            raise ValueError(f"lam must be a finite positive number, got {self.lam!r}")
        if not (math.isfinite(self.init_std) and self.init_std > 0):
            raise ValueError(f"init_std must be a finite positive number, got {self.init_std!r}")


def residual_multiplier(rule: str, n_loops: int, n_layers: int, lam: float = 1.0) -> float:
    """The residual-branch multiplier eps for a block of ``n_layers`` looped ``n_loops`` times.

    "1/N": lambda / (N sqrt(L)) (Wang et al. 2026); "1/sqrt(N)": lambda / sqrt(N L); "none": lambda.

    Raises:
        ValueError: unknown ``rule`` (the message lists the valid ones) or non-positive counts.
    """
    if n_loops < 1 or n_layers < 1:
        raise ValueError(f"n_loops and n_layers must be >= 1, got n_loops={n_loops}, n_layers={n_layers}")
    if rule == "1/N":
        return lam / (n_loops * math.sqrt(n_layers))
    if rule == "1/sqrt(N)":
        return lam / math.sqrt(n_loops * n_layers)
    if rule == "none":
        return lam
    raise ValueError(f"residual_scaling={rule!r} is unknown; valid: {list(RESIDUAL_SCALINGS)}")


def rotary(position_ids: torch.Tensor, d_head: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (B, 1, T, d_head / 2) float32, for int (B, T) positions."""
    inv_freq = base ** (-torch.arange(0, d_head, 2, device=position_ids.device, dtype=torch.float32) / d_head)
    angles = position_ids[:, None, :, None].float() * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d_head/2) of ``x`` (B, H, T, d_head) by the position angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions and an optional KV cache."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos, sin, mask, past=None):
        """x (B, T, d) -> (B, T, d) and this application's (key, value), each (B, H, T_past + T, d_head).

        ``mask`` is a bool (B, 1, T, T_past + T) "may attend" mask, or None for plain causal.
        """
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if mask is None:  # no padding: plain causal (a single new token may see the whole cache)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None and T > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d)), (k, v)


class MLP(nn.Module):
    """Two-layer GELU MLP, d -> mlp_ratio * d -> d."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=False)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d)."""
        return self.proj(F.gelu(self.fc(x)))


class Layer(nn.Module):
    """One pre-norm layer; both residual branches are scaled by ``eps``."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.norm_attn = nn.RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = nn.RMSNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, h, eps, cos, sin, mask, past=None):
        """h (B, T, d) -> (h + eps * attn(Norm h) then + eps * mlp(Norm h), this application's (k, v))."""
        a, kv = self.attn(self.norm_attn(h), cos, sin, mask, past)
        h = h + eps * a
        h = h + eps * self.mlp(self.norm_mlp(h))
        return h, kv


class LoopedOutput(NamedTuple):
    """What :meth:`LoopedTransformer.forward` returns (field names as in Hugging Face outputs)."""

    logits: torch.Tensor
    """(B, T, vocab_size) float, next-token logits."""
    loss: torch.Tensor | None = None
    """Scalar mean next-token cross-entropy (nats) over labels != -100, when labels are given."""
    past_key_values: KVCache | None = None
    """The KV cache (N * L pairs) when ``use_cache=True``."""
    hidden_states: tuple[torch.Tensor, ...] | None = None
    """(N + 1) tensors (B, T, d): the embeddings, then the residual stream after each loop."""


class LoopedTransformer(nn.Module):
    """Decoder-only transformer whose block of L layers is applied N times with shared weights.

    Source: Wang, Li, Zhang et al., arXiv 2606.18524 (eps = lambda / (N sqrt L)). The shared block
    is ``self.layers`` (L modules); looping calls the same modules N times, so every tied weight is
    one ``nn.Parameter`` whose gradient autograd accumulates over the N applications.
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layers))
        self.norm_out = nn.RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.eps = residual_multiplier(config.residual_scaling, config.n_loops, config.n_layers, config.lam)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)

    @property
    def device(self) -> torch.device:
        """Device of the parameters (as on Hugging Face models)."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters (as on Hugging Face models)."""
        return self.embed.weight.dtype

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> LoopedOutput:
        """Next-token logits for ``input_ids`` (B, T) int64.

        Args:
            attention_mask: (B, T_past + T) 0/1, 0 on padding (left or right). Positions count
                only the real tokens, so a left-padded prompt gets the same logits as unpadded.
            past_key_values: the cache returned by a previous call with ``use_cache=True``.
            labels: (B, T) int64 targets aligned with ``input_ids`` (shifted inside, as in
                Hugging Face); -100 is ignored.

        Raises:
            ValueError: wrong shapes, ids out of range, or a cache of the wrong length.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        cfg = self.config
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}), got [{int(input_ids.min())}, {int(input_ids.max())}]")
        n_past = 0
        if past_key_values is not None:
            if len(past_key_values) != cfg.n_loops * cfg.n_layers:
                raise ValueError(
                    f"past_key_values has {len(past_key_values)} entries; expected n_loops * n_layers = "
                    f"{cfg.n_loops * cfg.n_layers}"
                )
            n_past = past_key_values[0][0].shape[2]
        if attention_mask is not None and attention_mask.shape != (B, n_past + T):
            raise ValueError(f"attention_mask must be (B, T_past + T) = {(B, n_past + T)}, got {tuple(attention_mask.shape)}")

        if attention_mask is None:
            position_ids = torch.arange(n_past, n_past + T, device=input_ids.device).expand(B, T)
            mask = None
        else:
            keep = attention_mask.bool()
            position_ids = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, n_past:]
            q_index = torch.arange(n_past, n_past + T, device=input_ids.device)[:, None]
            k_index = torch.arange(n_past + T, device=input_ids.device)[None, :]
            # causal & not padding; a padded query still sees itself, so no row is empty (NaN).
            mask = ((k_index <= q_index) & keep[:, None, None, :]) | (k_index == q_index)
        cos, sin = rotary(position_ids, cfg.d_model // cfg.n_heads, cfg.rope_base)

        x0 = self.embed(input_ids)
        h = x0
        hidden_states = [h]
        new_cache = []
        for n in range(cfg.n_loops):
            if cfg.input_injection and n > 0:
                h = h + self.eps * x0
            for l, layer in enumerate(self.layers):
                past = None if past_key_values is None else past_key_values[n * cfg.n_layers + l]
                h, kv = layer(h, self.eps, cos, sin, mask, past)
                if use_cache:
                    new_cache.append(kv)
            hidden_states.append(h)
        logits = self.lm_head(self.norm_out(h))

        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, cfg.vocab_size).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return LoopedOutput(
            logits=logits,
            loss=loss,
            past_key_values=tuple(new_cache) if use_cache else None,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
        )

    # ------------------------------------------------------ parameters and cost

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of unique parameters (a tied tensor counts once, whatever N is).

        ``non_embedding=True`` leaves out the token embedding (and the output projection when it
        is tied to it), the usual convention for scaling laws.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer parameter groups: matrices (dim >= 2) decay, norms' gains do not.

        ``nn.Module.parameters()`` yields a shared tensor once, so each tied weight (the looped
        block, the tied embedding / output projection) sits in exactly one group and is decayed
        once per step.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def configure_optimizers(
        self, learning_rate: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), optimizer: str = "adamw"
    ) -> torch.optim.Optimizer:
        """An optimizer from ``echotrain.optim.registry`` over :meth:`param_groups`."""
        from echotrain.optim.registry import build_optimizer, optimizer_spec

        kwargs = {"lr": learning_rate}
        if "betas" in optimizer_spec(optimizer).takes:
            kwargs["betas"] = betas
        return build_optimizer(optimizer, self.param_groups(weight_decay), **kwargs)

    def flops_per_token(self, seq_len: int, training: bool = True) -> int:
        """Matmul FLOPs per token for sequences of ``seq_len``, counting all N block applications.

        Forward: N * sum_l (2 * P_l + 4 * seq_len * d) + 2 * d * V, where P_l is the number of
        weights in layer l's matrices and 4 * seq_len * d is QK^T plus AV over the full context
        (the convention of Kaplan et al. 2020 and PaLM's appendix B, which ignore causal savings;
        the run's utilisation figures count the causal pairs instead). Training counts the
        backward pass as twice the forward: 3x. Norms, GELU and softmax are left out. The count
        is :func:`echotrain.roofline.counts.forward_flops` of one token with ``seq_len`` (query,
        key) pairs and one logit, for this model's shape (:meth:`transformer_shape`).
        """
        from echotrain.roofline.counts import forward_flops, train_flops

        forward = forward_flops(self.transformer_shape(), 1, seq_len, 1)  # one token attending to seq_len keys
        return train_flops(forward) if training else forward

    def transformer_shape(self) -> "TransformerShape":
        """The dimensions the FLOP and decode-byte counts of :mod:`echotrain.roofline.counts` read:
        ``n_layers x n_loops`` layer applications, GELU MLP (2 matrices), multi-head attention."""
        from echotrain.roofline.counts import TransformerShape

        c = self.config
        return TransformerShape(n_layers=c.n_layers * c.n_loops, d_model=c.d_model, n_heads=c.n_heads,
                                n_kv_heads=c.n_heads, d_head=c.d_model // c.n_heads, d_ff=c.mlp_ratio * c.d_model,
                                vocab_size=c.vocab_size, gated_mlp=False)

    # -------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue left-padded prompts; returns (B, T_prompt + T_new) int64 ids.

        Like Hugging Face's ``generate``: sequences that produced an EOS are padded with
        ``pad_token_id`` afterwards, and decoding stops early once all have finished
        (so T_new <= max_new_tokens). ``use_cache=False`` recomputes the full prefix every step
        (the reference the KV cache is tested against).

        Raises:
            ValueError: non-positive ``temperature`` while sampling, bad ``top_p`` / ``top_k``.
        """
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos_ids = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), device=input_ids.device)
        pad = self.config.pad_token_id if pad_token_id is None else pad_token_id
        pad = pad if pad is not None else (eos_ids[0].item() if len(eos_ids) else 0)

        B = input_ids.shape[0]
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        ids = input_ids
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        out = self(ids, attention_mask=mask, use_cache=use_cache)
        for step in range(max_new_tokens):
            logits = out.logits[:, -1, :].float()
            if do_sample:
                next_id = torch.multinomial(_filter(logits / temperature, top_k, top_p).softmax(-1), 1, generator=generator)[:, 0]
            else:
                next_id = logits.argmax(-1)
            next_id = torch.where(finished, torch.full_like(next_id, pad), next_id)
            ids = torch.cat([ids, next_id[:, None]], dim=1)
            mask = torch.cat([mask, (~finished).long()[:, None]], dim=1)
            finished |= torch.isin(next_id, eos_ids)
            if finished.all() or step == max_new_tokens - 1:
                break
            if use_cache:
                out = self(next_id[:, None], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            else:
                out = self(ids, attention_mask=mask)
        return ids


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits (B, V) outside the top-k / nucleus (Holtzman et al. 2020) to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits
