"""FLOP and byte counts of :mod:`echotrain.roofline.counts` against hand arithmetic and against
torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``)."""

from __future__ import annotations

import pytest
import torch

from echotrain.roofline import (TransformerShape, batch_forward_flops, causal_pairs, decode_bytes, decode_flops,
                                decode_roofline_seconds, forward_flops,
                                group_forward_flops, shape_of, train_flops)

# n_layers=2, d=8, H=2, Hkv=1, dh=4, d_ff=16, V=10, gated (3 MLP matrices)
TINY = TransformerShape(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_head=4, d_ff=16, vocab_size=10)


def test_layer_params_by_hand():
    # Q: 8*(2*4)=64, K and V: 2*8*(1*4)=64, O: (2*4)*8=64, MLP: 3*8*16=384 -> 576
    assert TINY.layer_matrix_params == 576
    # decode step: 2 layers x 576 + LM head 10*8 = 1232 weights; K,V cache: 2*2*1*4 = 16 numbers per token
    assert TINY.decode_weights == 1232
    assert TINY.kv_width == 16
    assert causal_pairs(3) == 6 and causal_pairs(2, 3) == 9 and causal_pairs(0, 5) == 0


def test_group_forward_flops_by_hand():
    """One prompt of p=3 tokens and two responses of r=2 and r=3 valid tokens."""
    # prompt: 3 tokens, 3*4/2 = 6 causal pairs, 1 logit
    #   2*3*2*576 = 6912  +  4*2*2*4*6 = 384  +  2*1*8*10 = 160  -> 7456
    # response r=2: its first token on top of the prompt: 1 token, 1*3 + 1 = 4 pairs, 1 logit
    #   2*1*2*576 = 2304  +  4*2*2*4*4 = 256  +  160            -> 2720
    # response r=3: 2 tokens, 2*3 + 2*3/2 = 9 pairs, 2 logits
    #   2*2*2*576 = 4608  +  4*2*2*4*9 = 576  +  2*2*8*10 = 320 -> 5504
    hand = 7456 + 2720 + 5504
    assert hand == 15680
    assert group_forward_flops(TINY, 3, [2, 3]) == hand
    # forward + backward = 3x
    assert train_flops(hand) == 47040
    # two groups in one batch: the same group twice, rows interleaved, is twice the count
    assert batch_forward_flops(TINY, [3, 3, 3, 3], [2, 2, 3, 3], [0, 1, 0, 1]) == 2 * hand


def test_common_prefix_is_counted_once_by_hand():
    """Two prompts of p=3 sharing C=2 tokens: the prefix's forward once, not twice."""
    from echotrain.roofline import prefill_flops, shared_prefix_saving

    # the prefix: 2 tokens, 3 causal pairs, no logit: 2*2*2*576 = 4608 + 4*2*2*4*3 = 192 -> 4800
    assert shared_prefix_saving(TINY, 2, [3, 3]) == 4800
    assert shared_prefix_saving(TINY, 2, [3, 3, 4]) == 2 * 4800  # K prompts: K - 1 saved
    assert shared_prefix_saving(TINY, 0, [3, 3]) == shared_prefix_saving(TINY, 2, [3]) == 0
    # prefilling both: 2 x 7456 (the prompt of test_group_forward_flops_by_hand) less the prefix once
    assert prefill_flops(TINY, [3, 3]) == 2 * 7456
    assert prefill_flops(TINY, [3, 3], common_prefix=2) == 2 * 7456 - 4800
    # a batch of the two groups: the same saving
    assert batch_forward_flops(TINY, [3, 3, 3, 3], [2, 2, 3, 3], [0, 1, 0, 1], common_prefix=2) == 2 * 15680 - 4800
    # the prefix must leave every prompt a token of its own
    with pytest.raises(ValueError, match="common_prefix"):
        prefill_flops(TINY, [3, 2], common_prefix=2)
    with pytest.raises(ValueError, match="common_prefix"):
        shared_prefix_saving(TINY, -1, [3, 3])


@pytest.mark.parametrize("attention", ["blocks", "mask"])
def test_common_prefix_count_matches_the_packed_forward_flops(attention):
    """The count of a packed micro-batch (two prompts sharing a prefix, one row) equals torch's
    FLOP counter on the packed forward up to the attention, which runs more query-key pairs than
    are needed (counted separately here): with the whole-row mask the kernel's full square, with
    the block attention each piece's queries x keys (prefix 3 x 3, block 1: 4 x (3 + 4), block 2:
    3 x (3 + 3)). The matrices and logits are exactly what the layout runs (the prefix once, each
    prompt's rest once, each response but its last token)."""
    from torch.utils.flop_counter import FlopCounterMode

    from echotrain.runtime.packing import pack_layout, packed_log_probs

    model = _tiny_llama()
    if attention == "blocks":  # the blocks run for sdpa models (eager ones keep the whole-row mask)
        model.config._attn_implementation = "sdpa"
    shape = shape_of(model)
    p_ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 7]])
    p_mask = torch.ones_like(p_ids)
    r_ids = torch.tensor([[8, 9, 10], [11, 12, 0], [13, 0, 0]])
    r_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    layout = pack_layout(p_ids, p_mask, r_ids, r_mask)
    # prefix 3 | rest 4 5 | 8 9 | rest 6 7 | 11 (responses without their last token)
    assert layout.prefix_len == 3 and layout.input_ids.shape == (1, 3 + 2 + 2 + 2 + 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # sdpa's math backend runs its products as matmuls, which the counter sees (it has no formula
    # for the CPU flash kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        packed_log_probs(model, p_ids, p_mask, r_ids, r_mask, attention=attention)
    counted = batch_forward_flops(shape, [5, 5, 5], [3, 2, 1], [0, 1, 1], common_prefix=3)
    tokens, logits = 10, 5  # the row's columns; logits at the 5 distinct predicting columns (a prompt's last: once)
    S = layout.input_ids.shape[1]
    run_pairs = S * S if attention == "mask" else 3 * 3 + 4 * 7 + 3 * 6
    attention_run = 4 * shape.n_layers * shape.n_heads * shape.d_head * run_pairs
    matrices = 2 * tokens * shape.n_layers * shape.layer_matrix_params + 2 * logits * shape.d_model * shape.vocab_size
    assert fc.get_total_flops() == pytest.approx(matrices + attention_run, rel=0.001)
    # the count differs from what ran only in the attention: the needed causal pairs, not the square
    pairs = causal_pairs(5) + causal_pairs(2, 5) + causal_pairs(2, 3) + causal_pairs(1, 5) + causal_pairs(0, 5)
    assert counted == matrices + 4 * shape.n_layers * shape.n_heads * shape.d_head * pairs


def test_decode_bytes_by_hand():
    """Rows with p=3 and r=2, r=3 valid tokens, float32 weights and cache."""
    # steps = max(r) - 1 = 2, each reads 1232 weights x 4 bytes: 9856
    # KV positions: row 1 (1 step): 1*3 + 1 = 4; row 2 (2 steps): 2*3 + 3 = 9; 13 x 16 numbers x 4 bytes = 832
    assert decode_bytes(TINY, [3, 3], [2, 3], param_bytes=4, kv_bytes=4) == 9856 + 832
    # a bf16 cache halves the KV part only
    assert decode_bytes(TINY, [3, 3], [2, 3], param_bytes=4, kv_bytes=2) == 9856 + 416
    assert decode_bytes(TINY, [], [], param_bytes=4, kv_bytes=4) == 0
    # decode FLOPs: the responses' part of the group count, 2720 + 5504 (the prompt is the prefill's)
    assert decode_flops(TINY, [3, 3], [2, 3]) == 2720 + 5504 == group_forward_flops(TINY, 3, [2, 3]) - 7456


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="d_ff"):
        TransformerShape(n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, d_head=4, d_ff=0, vocab_size=10)
    with pytest.raises(ValueError, match="one entry per row"):
        batch_forward_flops(TINY, [3], [2, 3], [0, 0])
    with pytest.raises(ValueError, match="n_tokens"):
        forward_flops(TINY, -1, 0, 0)
    with pytest.raises(ValueError, match="param_bytes"):
        decode_bytes(TINY, [3], [2], param_bytes=0, kv_bytes=4)


def _tiny_llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tie, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def test_llama_shape_and_decode_weights_match_the_parameters():
    model = _tiny_llama(tie=True)
    shape = shape_of(model)
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.d_head, shape.d_ff,
            shape.vocab_size, shape.gated_mlp) == (2, 32, 4, 2, 8, 64, 40, True)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    # tied: every matrix (and the embedding = LM head) is read once per decode step
    assert shape.decode_weights == sum(p.numel() for p in model.parameters()) - norms


def test_llama_forward_backward_match_torch_flop_counter():
    """Full sequences (B rows of n tokens, logits everywhere, eager attention: two batched
    matmuls over the full n x n score matrix, so the pairs are B * n * n). FlopCounterMode
    counts matmuls exactly; we allow 1% for ops it might add in other torch versions."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _tiny_llama()
    B, n = 3, 7
    x = torch.randint(0, 40, (B, n))
    ours = forward_flops(shape_of(model), B * n, B * n * n, B * n)
    with FlopCounterMode(display=False) as fwd:
        model(x)
    with FlopCounterMode(display=False) as both:
        model(x).logits.sum().backward()
    assert fwd.get_total_flops() == pytest.approx(ours, rel=0.01)
    assert both.get_total_flops() == pytest.approx(train_flops(ours), rel=0.01)


def test_looped_model_counts_every_loop():
    """The testbed's architecture: a block of L=1 layer applied N=3 times is 3 layer applications.
    FlopCounterMode has no formula for the CPU attention kernel (scaled_dot_product_attention), so
    the comparison is of the matrices (our count with 0 attention pairs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from echotrain.models.looped import LoopedConfig, LoopedTransformer

    torch.manual_seed(0)
    model = LoopedTransformer(LoopedConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1, n_loops=3))
    shape = shape_of(model)
    assert (shape.n_layers, shape.d_ff, shape.n_kv_heads, shape.gated_mlp) == (3, 64, 2, False)
    # per application: QKV 16*48 + O 16*16 + MLP 2*16*64 = 3072 weights
    assert shape.layer_matrix_params == 3072
    B, n = 3, 7
    x = torch.randint(0, 50, (B, n))
    with FlopCounterMode(display=False) as fwd:
        model(x)
    assert fwd.get_total_flops() == forward_flops(shape, B * n, 0, B * n)
    # = 2*21*3*3072 + 2*21*16*50 (loops counted: 3x the block)
    assert fwd.get_total_flops() == 387072 + 33600


def test_unknown_architecture_is_refused_with_its_name():
    from echotrain.roofline import UnsupportedModel

    class Odd(torch.nn.Module):
        config = type("C", (), {"model_type": "mamba"})()

    with pytest.raises(UnsupportedModel, match="mamba"):
        shape_of(Odd())


def test_decode_roofline_takes_the_larger_bound_step_by_step():
    """Rows p=3, r=2 and r=3: step 1 has both rows, step 2 only the second.
    step 1: bytes 1232*4 + 16*4*(4 + 4) = 5440; FLOPs 2 x (2*2*576 + 4*2*2*4*4 + 2*8*10) = 2 x 2720 = 5440
    step 2: bytes 1232*4 + 16*4*5 = 5248;       FLOPs 2*2*576 + 4*2*2*4*5 + 160 = 2784"""
    def roof(flops_per_s, bytes_per_s):
        return decode_roofline_seconds(TINY, [3, 3], [2, 3], param_bytes=4, kv_bytes=4,
                                       gemm_flops_per_s=flops_per_s, mem_bytes_per_s=bytes_per_s)

    assert 5440 + 5440 + 5248 + 2784 == decode_bytes(TINY, [3, 3], [2, 3], param_bytes=4, kv_bytes=4) \
        + decode_flops(TINY, [3, 3], [2, 3])
    assert roof(1e4, 1e3) == pytest.approx((5440 + 5248) / 1e3)  # bandwidth-bound at both steps
    assert roof(1e2, 1e3) == pytest.approx((5440 + 2784) / 1e2)  # compute-bound at both
    # GEMM 800 FLOP/s: step 1 compute-bound (6.8 s > 5.44 s), step 2 bandwidth-bound (5.248 s > 3.48 s);
    # more than either total alone (10.688 s of bytes, 10.28 s of FLOPs)
    assert roof(800, 1e3) == pytest.approx(5440 / 800 + 5248 / 1e3)
    with pytest.raises(ValueError, match="peaks"):
        roof(0, 1e3)


def test_measuring_the_gemm_peak_leaves_the_global_rng_alone():
    """The first run on a machine measures the peaks, later ones read the cache: both must see
    the same RNG stream, or the same seed would give different runs."""
    import torch

    from echotrain.roofline.peaks import measure_gemm

    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    measure_gemm(torch.float32, torch.device("cpu"), n=32, repeats=1, seconds=0.0)
    assert torch.equal(torch.rand(4), expected)
