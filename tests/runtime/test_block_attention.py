"""A packed row's attention block by block (echotrain.runtime.block_attention) against one
masked call over the whole row, and the pieces it cuts a row into."""

from __future__ import annotations

import pytest
import torch

from echotrain.runtime import block_attention as ba
from echotrain.runtime import packing
from echotrain.runtime.packing import PAD, PREFIX, pack_layout, packed_log_probs

from tests.train.conftest import make_model, prefix_batch


def test_pieces_by_hand():
    """Row 0: prefix of 2, block 0 (3 columns), block 1 (2), padding (2); row 1: prefix, block 2
    (4 columns), no padding. Pieces tile each row; each block sees the prefix and itself."""
    block = torch.tensor([[PREFIX, PREFIX, 0, 0, 0, 1, 1, PAD, PAD],
                          [PREFIX, PREFIX, 2, 2, 2, 2, PAD, PAD, PAD]])
    block[1, 6:] = 2  # row 1: its block fills the row
    mask = torch.rand(2, 1, 9, 9) > 0.5
    pp = ba.blocks_of(block, 2, mask)
    assert pp.mask is mask and pp.used == 0 and len(pp.pieces) == 2
    spans = [[(p.start, p.stop, p.keys) for p in row] for row in pp.pieces]
    assert spans[0] == [(0, 2, ((0, 2),)), (2, 5, ((0, 2), (2, 5))), (5, 7, ((0, 2), (5, 7))),
                        (7, 9, ((0, 2), (7, 9)))]
    assert spans[1] == [(0, 2, ((0, 2),)), (2, 9, ((0, 2), (2, 9)))]
    p = pp.pieces[0][2]  # block 1 of row 0: queries 5-6, keys 0, 1, 5, 6
    assert torch.equal(p.mask, mask[0:1, :, 5:7][..., [0, 1, 5, 6]])
    assert all(q.row == r for r, row in enumerate(pp.pieces) for q in row)
    # no common prefix: each block sees itself only
    pp0 = ba.blocks_of(torch.tensor([[0, 0, 1, PAD]]), 0, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    assert [(p.start, p.stop, p.keys) for p in pp0.pieces[0]] == [(0, 2, ((0, 2),)), (2, 3, ((2, 3),)),
                                                                   (3, 4, ((3, 4),))]


def test_pieces_refuse_bad_input():
    with pytest.raises(ValueError, match="mask: expected shape"):
        ba.blocks_of(torch.zeros(1, 4, dtype=torch.long), 0, torch.ones(1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="not contiguous"):
        ba.blocks_of(torch.tensor([[0, 1, 0]]), 0, torch.ones(1, 1, 3, 3, dtype=torch.bool))


def _sdpa_entry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"], "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping


def _compare_modes(model, batch, monkeypatch, row_tokens=1024):
    """Run packed_log_probs with the whole-row mask and with the blocks; return both results and
    the PackedPieces of the blocks run (None when none were built)."""
    monkeypatch.setattr(packing, "PACKED_ROW_TOKENS", row_tokens)
    built = []
    real = packing.blocks_of
    monkeypatch.setattr(packing, "blocks_of", lambda *a: built.append(real(*a)) or built[-1])
    w = torch.randn(batch[3].shape, generator=torch.Generator().manual_seed(2))
    before = _sdpa_entry()
    out = {}
    for mode in ("mask", "blocks"):
        model.zero_grad()
        lp, ent = packed_log_probs(model, *batch, temperature=0.9, with_entropy=True, attention=mode)
        (lp * w * batch[3]).sum().backward()
        out[mode] = (lp.detach(), ent, {k: p.grad.clone() for k, p in model.named_parameters()
                                         if p.grad is not None})
        assert _sdpa_entry() == before  # the registry as it was
    m = batch[3].bool()
    torch.testing.assert_close(out["blocks"][0][m], out["mask"][0][m], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["blocks"][1][m], out["mask"][1][m], atol=1e-5, rtol=0)
    assert out["blocks"][2].keys() == out["mask"][2].keys() and out["mask"][2]
    for k, g in out["mask"][2].items():
        torch.testing.assert_close(out["blocks"][2][k], g, atol=1e-5, rtol=1e-4, msg=k)
    return built[0] if built else None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("row_tokens,shared_len", [(1024, 6), (12, 6), (1024, 0)])
def test_blocks_equal_the_whole_row_mask(tiny_tokenizer, attn, row_tokens, shared_len, monkeypatch):
    """Log-probs, entropies and every gradient with packed_attention=blocks equal those of the
    whole-row mask: one row, rows split by the cap (with padding), and prompts without a common
    prefix. With sdpa the pieces really run (once per layer, each piece one inner call of its
    query length); eager models keep the whole-row mask (no pieces built)."""
    model = make_model(tiny_tokenizer, seed=7)
    model.config._attn_implementation = attn
    batch = prefix_batch(len(tiny_tokenizer), seed=1, shared_len=shared_len)
    calls: list[int] = []
    real = ba.block_attention_forward

    def spy(module, query, *a, inner, **k):
        return real(module, query, *a, inner=lambda m, q, *x, **y: calls.append(q.shape[2]) or inner(m, q, *x, **y),
                    **k)
    monkeypatch.setattr(ba, "block_attention_forward", spy)
    pp = _compare_modes(model, batch, monkeypatch, row_tokens)
    if attn == "eager":
        assert pp is None and calls == []
        return
    layers = model.config.num_hidden_layers
    assert pp.used == layers
    assert calls == [p.stop - p.start for row in pp.pieces for p in row] * layers
    assert len(pp.pieces) == (3 if row_tokens == 12 else 1)


def test_blocks_through_lora(tiny_tokenizer, monkeypatch):
    """A peft (LoRA) model: the pieces reach the attention through peft's forward; the same
    log-probs and LoRA gradients as the whole-row mask."""
    peft = pytest.importorskip("peft")
    model = make_model(tiny_tokenizer, seed=9)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                       init_lora_weights=False))
    pp = _compare_modes(model, prefix_batch(len(tiny_tokenizer), seed=5), monkeypatch)
    assert pp.used == model.get_base_model().config.num_hidden_layers


def test_models_the_blocks_do_not_fit_compute_what_they_did(tiny_tokenizer, monkeypatch):
    """A model that branches on the name "sdpa" and changes the mask itself (Falcon) and one whose
    layers drop the forward's keywords (StableLM): the pieces never run (used == 0) and the
    results equal the whole-row mask's."""
    from transformers import FalconConfig, FalconForCausalLM, StableLmConfig, StableLmForCausalLM

    V = len(tiny_tokenizer)
    torch.manual_seed(0)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            alibi=False, new_decoder_architecture=False, multi_query=True,
                                            attn_implementation="sdpa"))
    stablelm = StableLmForCausalLM(StableLmConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  attn_implementation="sdpa"))
    for model in (falcon, stablelm):
        assert packing.supports_packed_forward(model)
        model.eval()
        pp = _compare_modes(model, prefix_batch(V, seed=6), monkeypatch)
        assert pp is not None and pp.used == 0, type(model).__name__


def test_attention_implementation_restored_after_an_error(tiny_model):
    """The wrapper leaves transformers' attention registry when the forward raises, and
    packed_log_probs refuses an unknown mode."""
    batch = prefix_batch(tiny_model.config.vocab_size)

    def boom(*a, **k):
        raise RuntimeError("boom")
    handle = tiny_model.model.layers[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            packed_log_probs(tiny_model, *batch)
    finally:
        handle.remove()
    assert tiny_model.config._attn_implementation == "sdpa"
    assert _sdpa_entry()[1] is False  # our wrapper left transformers' registry
    with pytest.raises(ValueError, match="attention must be one of"):
        packed_log_probs(tiny_model, *batch, attention="dense")


def test_without_pieces_it_is_sdpa(tiny_model):
    """A forward that passes no pieces while the wrapper is in place gets sdpa over the whole
    rows, bit for bit, and the registry holds the previous entry again afterwards."""
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = tiny_model(ids).logits
    before = _sdpa_entry()
    with ba.block_attention():
        assert _sdpa_entry()[0] is not before[0]
        got = tiny_model(ids).logits
    assert _sdpa_entry() == before
    assert torch.equal(got, ref)


def test_gradient_checkpointing_keeps_the_whole_row_mask(tiny_tokenizer, monkeypatch):
    """Under gradient checkpointing the packed forward does not switch (the backward's
    recomputation would run without the blocks); gradients equal the plain forward's."""
    from echotrain.runtime.rollout import forward_log_probs
    from echotrain.train.features import checkpointed_forward, enable_gradient_checkpointing

    model = make_model(tiny_tokenizer, seed=8)
    batch = prefix_batch(len(tiny_tokenizer), seed=3)
    switched = []
    monkeypatch.setattr(packing, "block_attention", lambda: switched.append(1) or ba.block_attention())
    model.zero_grad()
    lp, _ = forward_log_probs(model, *batch, share_prefix=False)
    (lp * batch[3]).sum().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        forward_log_probs(model, *batch)
    assert switched == [1]  # without checkpointing the packed forward switches to the blocks
    switched.clear()
    enable_gradient_checkpointing(model)
    model.zero_grad()
    with checkpointed_forward(model):
        lp, _ = forward_log_probs(model, *batch, kv_cache=False)
    (lp * batch[3]).sum().backward()
    assert switched == []
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], atol=1e-5, rtol=1e-4, msg=k)


def _pieces_and_qkv():
    block = torch.tensor([[PREFIX, PREFIX, 0, 0, 0, 1, 1, PAD, PAD],
                          [PREFIX, PREFIX, 2, 2, 2, 2, 2, 2, PAD]])
    allowed = ba.blocks_of(block, 2, torch.zeros(2, 1, 9, 9, dtype=torch.bool))
    mask = torch.zeros(2, 1, 9, 9, dtype=torch.bool)
    for r, row in enumerate(allowed.pieces):  # causal within the keys each piece may see
        for p in row:
            for q in range(p.start, p.stop):
                for a, b in p.keys:
                    mask[r, 0, q, a:min(b, q + 1)] = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g) for _ in range(3))
    return ba.blocks_of(block, 2, mask), mask, q, k, v


def test_forward_by_pieces_equals_one_sdpa_call_every_row():
    """block_attention_forward with transformers' sdpa as inner equals one sdpa call over the
    whole rows with the whole mask, at every column (padding included), in both rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pp, mask, q, k, v = _pieces_and_qkv()
    module = torch.nn.Module()
    module.is_causal = False
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.3)
    out, weights = ba.block_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.3, packed_pieces=pp,
                                              inner=sdpa_attention_forward)
    assert weights is None and pp.used == 1 and out.shape == ref.shape == (2, 9, 2, 4)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    # positional arguments (dropout, scaling) reach every piece's call too
    out, _ = ba.block_attention_forward(module, q, k, v, mask, 0.0, 0.3, packed_pieces=pp,
                                        inner=sdpa_attention_forward)
    assert pp.used == 2
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_another_mask_runs_the_inner_function_once():
    """The pieces run only for the very mask they were cut from: an equal copy of it (a model
    that rebuilt or changed its mask) gets one inner call over the whole row, unchanged."""
    pp, mask, q, k, v = _pieces_and_qkv()
    calls = []

    def inner(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2], attention_mask, args, kwargs))
        return "whole row", "weights"

    other = mask.clone()
    assert ba.block_attention_forward(None, q, k, v, other, 0.0, packed_pieces=pp, inner=inner,
                                      scaling=0.5) == ("whole row", "weights")
    assert pp.used == 0 and len(calls) == 1
    assert calls[0][:2] == (9, 9) and calls[0][2] is other and calls[0][3:] == ((0.0,), {"scaling": 0.5})
    assert ba.block_attention_forward(None, q, k, v, mask, packed_pieces=None, inner=inner)[0] == "whole row"
    assert pp.used == 0 and len(calls) == 2


def test_block_attention_restores_a_registered_sdpa_entry():
    """A program that registered its own sdpa function gets it back (still registered) after
    the block; without one the default entry is restored."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def custom(*args, **kwargs):
        raise AssertionError("not called")

    ALL_ATTENTION_FUNCTIONS["sdpa"] = custom
    try:
        with ba.block_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"].keywords["inner"] is custom
        assert _sdpa_entry() == (custom, True)
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert _sdpa_entry()[1] is False
