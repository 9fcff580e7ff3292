"""The :class:`~echotrain.roofline.counts.TransformerShape` of a loaded model, read from its config.

Known: Hugging Face Llama-style causal LMs (``model_type`` in :data:`LLAMA_STYLE`: SmolLM2 is
``llama``; gated SiLU MLP, grouped-query attention) and echotrain's own
:class:`~echotrain.models.LoopedTransformer` (the testbed; ``n_layers x n_loops`` layer
applications, GELU MLP, multi-head attention). Anything else raises
:class:`UnsupportedModel`, whose message the trainer writes to run_info.json instead of the
utilisation figures.
"""

from __future__ import annotations

from typing import Any

from echotrain.roofline.counts import TransformerShape

#: Hugging Face ``model_type`` values whose blocks are Llama's (attention Q/K/V/O, gated MLP of 3
#: matrices); biases, where a family has them (Qwen2's Q/K/V), are left out of the count.
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The model's architecture is not one whose FLOPs :func:`shape_of` knows how to count."""


def shape_of(model: Any) -> TransformerShape:
    """The shape of ``model`` (a peft wrapper is looked through to its base model): the model's own
    ``transformer_shape()`` where it has one (echotrain's looped transformer), else read from a
    Llama-style Hugging Face config.

    Raises:
        UnsupportedModel: not a Llama-style HF model nor a looped transformer (names what it is).
    """
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    own = getattr(base, "transformer_shape", None)
    if callable(own):  # echotrain's LoopedTransformer states its own shape
        return own()
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_STYLE:
        raise UnsupportedModel(f"no FLOP count for {type(base).__name__} (model_type={model_type!r}); known: "
                               f"{', '.join(LLAMA_STYLE)} and echotrain's LoopedTransformer")
    n_heads = int(config.num_attention_heads)
    d_head = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return TransformerShape(n_layers=int(config.num_hidden_layers), d_model=int(config.hidden_size),
                            n_heads=n_heads,
                            n_kv_heads=int(getattr(config, "num_key_value_heads", None) or n_heads),
                            d_head=int(d_head), d_ff=int(config.intermediate_size),
                            vocab_size=int(config.vocab_size), gated_mlp=True)
