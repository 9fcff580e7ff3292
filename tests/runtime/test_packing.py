"""The packed shared-prefix forward (echotrain.runtime.packing) against one forward per sequence."""

from __future__ import annotations

import pytest
import torch

from echotrain.runtime.packing import is_prefix_mask, packed_log_probs, supports_packed_forward
from echotrain.runtime.rollout import forward_log_probs

from tests.train.conftest import make_model, prefix_batch


def _batch(vocab: int, seed: int = 0):
    """3 prompts (lengths 5, 3, 7; left-padded to 9 with 2 extra all-padding columns) x rows
    3, 2, 3 (rows of one prompt adjacent or not), responses of lengths 1-6 right-padded to 8."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 3, 7)]
    which = [0, 1, 0, 2, 2, 1, 0, 2]  # rows of a prompt need not be adjacent
    lens = [4, 1, 6, 2, 5, 3, 1, 6]
    P, T = 9, 8
    p_ids = torch.zeros(len(which), P, dtype=torch.long)
    p_mask = torch.zeros(len(which), P, dtype=torch.long)
    r_ids = torch.zeros(len(which), T, dtype=torch.long)
    r_mask = torch.zeros(len(which), T)
    for i, (w, n) in enumerate(zip(which, lens)):
        p = prompts[w]
        p_ids[i, P - len(p):], p_mask[i, P - len(p):] = p, 1
        r_ids[i, :n], r_mask[i, :n] = torch.randint(3, vocab, (n,), generator=g), 1
    return p_ids, p_mask, r_ids, r_mask


def _one_by_one(model, p_ids, p_mask, r_ids, r_mask, temperature):
    """Reference: each row alone, unpadded, through the plain forward (no sharing at all)."""
    lps, ents = [], []
    for i in range(len(p_ids)):
        pk, rk = p_mask[i].bool(), r_mask[i].bool()
        lp, ent = forward_log_probs(model, p_ids[i:i + 1, pk], p_mask[i:i + 1, pk], r_ids[i:i + 1, rk],
                                    r_mask[i:i + 1, rk], temperature=temperature, with_entropy=True,
                                    share_prefix=False)
        lps.append(torch.nn.functional.pad(lp[0], (0, r_ids.shape[1] - int(rk.sum()))))
        ents.append(torch.nn.functional.pad(ent[0], (0, r_ids.shape[1] - int(rk.sum()))))
    return torch.stack(lps), torch.stack(ents)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_separate_forwards_values_and_gradients(tiny_tokenizer, attn):
    """Log-probs, entropies and every parameter gradient of the packed layout equal those of
    one forward per sequence (no padding, no sharing), for sdpa and eager attention."""
    model = make_model(tiny_tokenizer, seed=3)
    model.config._attn_implementation = attn
    assert supports_packed_forward(model)
    batch = _batch(len(tiny_tokenizer))
    r_mask = batch[3]
    w = torch.randn(r_mask.shape, generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    ref_lp, ref_ent = _one_by_one(model, *batch, temperature=1.3)
    (ref_lp * w * r_mask).sum().backward()
    ref_g = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = packed_log_probs(model, *batch, temperature=1.3, with_entropy=True)
    (lp * w * r_mask).sum().backward()
    m = r_mask.bool()
    torch.testing.assert_close(lp[m], ref_lp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-5, rtol=0)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    assert lp.requires_grad and not ent.requires_grad
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_g[k], atol=1e-5, rtol=1e-4, msg=k)


def test_forward_log_probs_layouts_agree(tiny_tokenizer):
    """forward_log_probs: packed (the default), KV cache (pack=False) and plain (share_prefix=False)
    give the same log-probs; the packed path is taken (a spy counts the model's calls: one)."""
    model = make_model(tiny_tokenizer, seed=4)
    batch = _batch(len(tiny_tokenizer), seed=2)
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["attention_mask"].dim()),
                                           with_kwargs=True)
    out = {}
    for name, kw in {"packed": {}, "kv": {"pack": False}, "plain": {"share_prefix": False}}.items():
        calls.clear()
        with torch.no_grad():
            out[name] = forward_log_probs(model, *batch, with_entropy=True, **kw)
        out[name + "_calls"] = list(calls)
    hook.remove()
    assert out["packed_calls"] == [4] and out["kv_calls"] == [2, 2] and out["plain_calls"] == [2]
    m = batch[3].bool()
    for name in ("kv", "plain"):
        torch.testing.assert_close(out["packed"][0][m], out[name][0][m], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["packed"][1][m], out[name][1][m], atol=1e-5, rtol=0)


def test_packed_under_gradient_checkpointing_matches(tiny_tokenizer):
    """With gradient checkpointing (no KV cache) the packed layout still shares the prompt and
    gives the gradients of the plain forward."""
    from echotrain.train.features import checkpointed_forward, enable_gradient_checkpointing

    model = make_model(tiny_tokenizer, seed=5)
    batch = _batch(len(tiny_tokenizer), seed=3)
    grads = []
    for ckpt, kw in ((False, {"share_prefix": False}), (True, {"kv_cache": False})):
        if ckpt:
            enable_gradient_checkpointing(model)
        model.zero_grad()
        with checkpointed_forward(model) if ckpt else torch.enable_grad():
            lp, _ = forward_log_probs(model, *batch, **kw)
        (lp * batch[3]).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4, msg=k)


def test_supports_packed_forward_refuses_what_a_custom_mask_would_change(tiny_tokenizer):
    model = make_model(tiny_tokenizer)
    assert supports_packed_forward(model)
    model.config._attn_implementation = "flash_attention_2"  # ignores a 4-D mask
    assert not supports_packed_forward(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert not supports_packed_forward(model)
    model.config.layer_types = None
    model.config.sliding_window = 16
    assert not supports_packed_forward(model)
    model.config.use_sliding_window = False  # Qwen2's switch: the window is not applied
    assert supports_packed_forward(model)
    assert not supports_packed_forward(torch.nn.Linear(2, 2))


def test_prefix_mask_check_and_errors(tiny_tokenizer):
    assert is_prefix_mask(torch.tensor([[1., 1, 0], [0, 0, 0], [1, 1, 1]]))
    assert not is_prefix_mask(torch.tensor([[1., 0, 1]]))
    model = make_model(tiny_tokenizer)
    p_ids, p_mask, r_ids, r_mask = _batch(len(tiny_tokenizer))
    holed = r_mask.clone()
    holed[0, 0] = 0
    with pytest.raises(ValueError, match="response_mask"):
        packed_log_probs(model, p_ids, p_mask, r_ids, holed)
    with pytest.raises(ValueError, match="shape mismatch"):
        packed_log_probs(model, p_ids, p_mask, r_ids[:, :3], r_mask)
    # forward_log_probs falls back to the KV-cache layout for a holed mask, with the same values
    with torch.no_grad():
        a, _ = forward_log_probs(model, p_ids, p_mask, r_ids, holed)
        b, _ = forward_log_probs(model, p_ids, p_mask, r_ids, holed, pack=False)
    torch.testing.assert_close(a, b)


def test_equal_prompt_ids_with_other_padding_are_other_prompts(tiny_model):
    """Rows whose prompt ids are equal but whose masks differ (the pad id is a real token) are
    grouped apart, in the packed and the KV-cache layout alike: each equals its own plain forward."""
    from echotrain.runtime.rollout import forward_log_probs

    prompt = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6]])
    p_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    response = torch.tensor([[7, 8], [7, 8]])
    r_mask = torch.ones_like(response)
    with torch.no_grad():
        plain, _ = forward_log_probs(tiny_model, prompt, p_mask, response, r_mask, share_prefix=False)
        packed, _ = forward_log_probs(tiny_model, prompt, p_mask, response, r_mask, pack=True)
        cached, _ = forward_log_probs(tiny_model, prompt, p_mask, response, r_mask, pack=False)
    assert not torch.allclose(plain[0], plain[1])  # the padding matters
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-5)


def test_pack_layout_by_hand():
    """Two prompts sharing [5, 6] (one left-padded), three responses: the common prefix once,
    each prompt's rest, its responses after it; positions, blocks, segments and predictors as
    counted by hand; the attention mask of the second prompt's response."""
    from echotrain.runtime.packing import PAD, PREFIX, pack_layout

    p_ids = torch.tensor([[5, 6, 7], [0, 5, 6], [5, 6, 7]])
    p_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1]])
    r_ids = torch.tensor([[11, 12], [13, 0], [14, 15]])
    r_mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    L = pack_layout(p_ids, p_mask, r_ids, r_mask)
    # prompts [5,6,7] (rows 0, 2) and [5,6] (row 1): C = min length - 1 = 1 (each keeps a token)
    assert L.prefix_len == 1
    # columns: 5 | 6 7 11 14 | 6 (a response's last token is a target only: 12, 13 and 15 are not inputs)
    assert L.input_ids.tolist() == [[5, 6, 7, 11, 14, 6]]
    assert L.position.tolist() == [[0, 1, 2, 3, 3, 1]]
    assert L.block.tolist() == [[PREFIX, 0, 0, 0, 0, 1]]
    assert L.segment.tolist() == [[PREFIX, -1, -1, 0, 2, -1]]
    # row 0's tokens 11, 12 predicted by columns 2 (the prompt's last) and 3; row 1's 13 by 5; row 2's 14, 15 by 2, 4
    assert L.predictor.tolist() == [2, 3, 5, 2, 4]
    assert L.token_row.tolist() == [0, 0, 0, 0, 0]
    mask = L.attention_mask()[0]
    assert mask[5].nonzero().squeeze(1).tolist() == [0, 5]  # the second prompt's 6 sees the prefix and itself
    assert mask[4].nonzero().squeeze(1).tolist() == [0, 1, 2, 4]  # 14: prefix, its prompt, not row 0's response
    # a row cap of 5 tokens puts the second prompt in a row of its own, behind its own copy of the prefix
    L2 = pack_layout(p_ids, p_mask, r_ids, r_mask, row_tokens=5)
    assert L2.input_ids.tolist() == [[5, 6, 7, 11, 14], [5, 6, 0, 0, 0]]
    assert L2.block[1].tolist() == [PREFIX, 1, PAD, PAD, PAD]
    assert L2.predictor.tolist() == [2, 3, 1, 2, 4] and L2.token_row.tolist() == [0, 0, 1, 0, 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("row_tokens", [1024, 12])
def test_common_prefix_packing_equals_separate_forwards(tiny_tokenizer, row_tokens, attn, monkeypatch):
    """Prompts sharing a 6-token prefix (a system prompt), in one packed row or split over rows
    (row_tokens=12), sdpa and eager attention: log-probs, entropies and gradients equal those of
    one forward per sequence."""
    from echotrain.runtime import packing

    model = make_model(tiny_tokenizer, seed=6)
    model.config._attn_implementation = attn
    p_ids, p_mask, r_ids, r_mask = prefix_batch(len(tiny_tokenizer), seed=4, shared_len=6)
    g = torch.Generator().manual_seed(4)
    layout = packing.pack_layout(p_ids, p_mask, r_ids, r_mask, row_tokens=row_tokens)
    assert layout.prefix_len == 6 and len(layout.input_ids) == (1 if row_tokens == 1024 else 3)
    monkeypatch.setattr(packing, "PACKED_ROW_TOKENS", row_tokens)
    w = torch.randn(r_mask.shape, generator=g)
    model.zero_grad()
    ref_lp, ref_ent = _one_by_one(model, p_ids, p_mask, r_ids, r_mask, temperature=0.7)
    (ref_lp * w * r_mask).sum().backward()
    ref_g = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = packing.packed_log_probs(model, p_ids, p_mask, r_ids, r_mask, temperature=0.7, with_entropy=True)
    (lp * w * r_mask).sum().backward()
    m = r_mask.bool()
    torch.testing.assert_close(lp[m], ref_lp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-5, rtol=0)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_g[k], atol=1e-5, rtol=1e-4, msg=k)


def test_packing_refuses_a_row_without_prompt_tokens(tiny_model):
    p_ids, p_mask = torch.tensor([[0, 5], [0, 0]]), torch.tensor([[0, 1], [0, 0]])
    r = torch.tensor([[7, 8], [7, 8]])
    with pytest.raises(ValueError, match="prompt_mask: every row"):
        packed_log_probs(tiny_model, p_ids, p_mask, r, torch.ones_like(r))


def test_packing_with_no_response_token(tiny_model):
    """All responses empty: zeros, no error (the forward keeps one column)."""
    p_ids, p_mask = torch.tensor([[4, 5], [4, 6]]), torch.ones(2, 2, dtype=torch.long)
    r = torch.zeros(2, 3, dtype=torch.long)
    lp, ent = packed_log_probs(tiny_model, p_ids, p_mask, r, torch.zeros(2, 3), with_entropy=True)
    assert lp.shape == (2, 3) and (lp == 0).all() and (ent == 0).all()
