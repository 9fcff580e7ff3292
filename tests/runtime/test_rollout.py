"""Response masks and log-probs of response tokens."""

from __future__ import annotations

import pytest
import torch

from echotrain.runtime.rollout import concat_rollouts, forward_log_probs, generate_rollouts, response_mask_from_ids

EOS, PAD = 2, 0


def test_mask_eos_produced_pad_differs_from_eos():
    ids = torch.tensor([[5, 6, EOS, PAD, PAD],
                        [5, EOS, PAD, PAD, PAD]])
    mask, trunc = response_mask_from_ids(ids, EOS, PAD)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert trunc.tolist() == [False, False]


def test_mask_pad_equals_eos_counts_first_eos_once():
    ids = torch.tensor([[5, 6, EOS, EOS, EOS],
                        [EOS, EOS, EOS, EOS, EOS]])
    mask, trunc = response_mask_from_ids(ids, EOS, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert trunc.tolist() == [False, False]


def test_mask_without_eos_excludes_trailing_padding_only():
    # row 0 hit max_new_tokens (no EOS, no padding); row 1 has no EOS but was right-padded when
    # batches of different widths were concatenated; row 2 sampled the pad id mid-response.
    ids = torch.tensor([[5, 6, 7, 8, 9],
                        [5, 6, 7, PAD, PAD],
                        [5, PAD, 7, EOS, PAD]])
    mask, trunc = response_mask_from_ids(ids, EOS, PAD)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert trunc.tolist() == [True, True, False]


def test_mask_several_eos_ids_and_tokens_after_eos_excluded():
    ids = torch.tensor([[5, 11, 6, 2, 7], [5, 6, 2, 11, 7]])
    mask, trunc = response_mask_from_ids(ids, [2, 11], PAD)
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert not trunc.any()


def test_generated_masks_exclude_padding(tiny_model, tiny_tokenizer):
    torch.manual_seed(3)
    prompts = [[{"role": "user", "content": "say 1"}], [{"role": "user", "content": "say 12345"}]]
    b = generate_rollouts(tiny_model, tiny_tokenizer, prompts, 6, max_new_tokens=12, temperature=1.5)
    assert b.response_ids.shape[0] == 12 and b.group_index.tolist() == [0] * 6 + [1] * 6
    eos = tiny_tokenizer.eos_token_id
    for ids, m, tr in zip(b.response_ids, b.response_mask, b.truncated):
        n = int(m.sum())
        assert m[:n].eq(1).all() and m[n:].eq(0).all()  # a prefix
        if tr:
            assert eos not in ids[:n].tolist()
        else:
            assert ids[n - 1] == eos and eos not in ids[: n - 1].tolist()
    # concatenating batches of different widths pads with mask 0 and keeps group ids
    torch.manual_seed(4)
    b2 = generate_rollouts(tiny_model, tiny_tokenizer, prompts[:1], 2, max_new_tokens=3, temperature=1.0,
                           group_offset=2)
    cat = concat_rollouts([b, b2], tiny_tokenizer.pad_token_id)
    assert cat.response_mask[12:, 3:].eq(0).all()
    assert cat.group_index.tolist()[-2:] == [2, 2]
    assert torch.equal(cat.response_mask.sum(-1), torch.cat([b.response_length, b2.response_length]))


def test_log_probs_match_generate_scores_with_left_padding(tiny_model, tiny_tokenizer):
    """forward_log_probs (positions skipping left padding, logits / temperature) reproduces the
    distribution generate() sampled from, so on-policy ratios are exactly 1."""
    prompts = [[{"role": "user", "content": "say 1"}], [{"role": "user", "content": "say 123456"}]]
    temp = 0.8
    torch.manual_seed(0)
    b = generate_rollouts(tiny_model, tiny_tokenizer, prompts, 2, max_new_tokens=6, temperature=temp,
                         sampler="multinomial")  # generate's draws
    assert b.prompt_mask[:2].eq(0).any()  # the short prompt is left-padded
    torch.manual_seed(0)
    texts = [tiny_tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts for _ in range(2)]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = tiny_model.generate(**enc, max_new_tokens=6, do_sample=True, temperature=temp, top_k=None,
                              pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=[tiny_tokenizer.eos_token_id],
                              output_scores=True, return_dict_in_generate=True)
    ref = torch.stack(out.scores, 1).log_softmax(-1)
    resp = out.sequences[:, enc["input_ids"].shape[1]:]
    assert torch.equal(resp, b.response_ids[:, : resp.shape[1]])
    ref_lp = ref.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    lp, ent = forward_log_probs(tiny_model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                                temperature=temp, with_entropy=True)
    m = b.response_mask[:, : resp.shape[1]].bool()
    torch.testing.assert_close(lp[:, : resp.shape[1]][m], ref_lp[m], atol=1e-5, rtol=0)
    # entropy from the same logits: -sum p log p of the tempered distribution
    ref_ent = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(ent[:, : resp.shape[1]][m], ref_ent[m], atol=1e-5, rtol=0)
    assert lp.requires_grad and not ent.requires_grad


def test_shared_prefix_and_trimming_are_exact(tiny_model, tiny_tokenizer):
    """Running each distinct prompt once (KV cache expanded to its G responses) and trimming
    all-padding columns gives the same log-probs and the same parameter gradient as one full
    forward of every prompt + response."""
    prompts = [[{"role": "user", "content": "say 7"}], [{"role": "user", "content": "say 1234"}]]
    torch.manual_seed(5)
    b = generate_rollouts(tiny_model, tiny_tokenizer, prompts, 3, max_new_tokens=10, temperature=1.3)
    # widen with extra padding on both sides, as concatenated batches have
    pad = tiny_tokenizer.pad_token_id
    p_ids = torch.nn.functional.pad(b.prompt_ids, (2, 0), value=pad)
    p_mask = torch.nn.functional.pad(b.prompt_mask, (2, 0), value=0)
    r_ids = torch.nn.functional.pad(b.response_ids, (0, 3), value=pad)
    r_mask = torch.nn.functional.pad(b.response_mask, (0, 3), value=0)
    w = torch.randn(r_ids.shape)
    results = []
    for share in (False, True):
        tiny_model.zero_grad()
        lp, ent = forward_log_probs(tiny_model, p_ids, p_mask, r_ids, r_mask, temperature=1.3, with_entropy=True,
                                    share_prefix=share)
        (lp * w * r_mask).sum().backward()
        grads = {k: p.grad.clone() for k, p in tiny_model.named_parameters()}
        results.append((lp.detach(), ent, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    m = r_mask.bool()
    assert lp0.shape == lp1.shape == r_ids.shape
    torch.testing.assert_close(lp1[m], lp0[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1[m], ent0[m], atol=1e-5, rtol=0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4)


def test_shared_prefill_generation_matches_plain(tiny_model, tiny_tokenizer):
    prompts = [[{"role": "user", "content": "say 7"}], [{"role": "user", "content": "say 1234"}]]
    outs = []
    for share in (False, True):
        torch.manual_seed(11)
        outs.append(generate_rollouts(tiny_model, tiny_tokenizer, prompts, 4, max_new_tokens=10, temperature=1.0,
                                      share_prefix=share))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].response_mask, outs[1].response_mask)


def _matrix_weights(model) -> int:
    """How many weight matrices a forward multiplies by (the embedding, tied to the lm_head, counted
    once with it below)."""
    return sum(1 for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)


def _weight_casts(model, fn):
    """Run ``fn()`` and count the casts of the model's parameters (``aten._to_copy`` or, in inference
    mode, ``aten.to`` of a tensor sharing a parameter's storage): autocast casts a weight to
    bfloat16 where a matmul reads it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ptrs = {p.data_ptr() for p in model.parameters()}
    casts = (torch.ops.aten._to_copy, torch.ops.aten.to)
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in casts and args[0].data_ptr() in ptrs:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return count[0], out


@pytest.mark.parametrize("decode_loop", ["echotrain", "generate"])
def test_generation_under_autocast_casts_each_weight_once(tiny_model, tiny_tokenizer, decode_loop):
    """Under CPU bfloat16 autocast, generation casts each weight once per call, not once per forward:
    autocast caches its casts of parameters, but not inside ``torch.inference_mode`` (which generation
    used before: every decode step then re-cast the whole model, ~1/3 of a bfloat16 step of SmolLM2)."""
    n_weights = _matrix_weights(tiny_model)

    def gen(max_new):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate_rollouts(tiny_model, tiny_tokenizer, ["ab", "cde"], 2, max_new_tokens=max_new,
                                     decode_loop=decode_loop)

    casts, batch = _weight_casts(tiny_model, lambda: gen(8))
    assert batch.response_ids.shape[1] > 2  # several decode forwards ran
    assert 0 < casts <= n_weights + 1  # (+1: the tied lm_head / embedding)
    with torch.inference_mode():  # the old way, for contrast: a cast per weight per forward
        casts_im, _ = _weight_casts(tiny_model, lambda: gen(8))
    assert casts_im > 2 * n_weights


#: a turn's left-padded inputs for the episode tests below
TURN_IDS, TURN_ATTN = torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])


@pytest.mark.parametrize("decode_loop", ["echotrain", "generate"])
def test_an_episode_turn_under_autocast_casts_each_weight_once(tiny_model, tiny_tokenizer, decode_loop):
    """The same for a multi-turn episode's turn (``echotrain.runtime.episodes._sample``)."""
    from echotrain.runtime.episodes import _sample

    n_weights = _matrix_weights(tiny_model)
    ids, attn = TURN_IDS, TURN_ATTN

    def turn():
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _sample(tiny_model, ids, attn, max_new_tokens=8, eos=[], pad_id=0, temperature=1.0, top_p=1.0,
                           top_k=0, decode_loop=decode_loop, sampler="inverse_cdf")

    casts, out = _weight_casts(tiny_model, turn)
    assert out.tokens.shape == (2, 8) and 0 < casts <= n_weights + 1


@pytest.mark.parametrize("decode_loop", ["echotrain", "generate"])
def test_generation_forwards_run_without_grad(tiny_model, tiny_tokenizer, decode_loop):
    """Every forward of generation (prefill, decode, an episode's turn) runs with grad off, and what
    comes back holds no graph (not just: the casts are cached, which grad-on would also pass)."""
    seen = []
    h = tiny_model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_grad_enabled()))
    try:
        b = generate_rollouts(tiny_model, tiny_tokenizer, ["ab", "cde"], 2, max_new_tokens=4, decode_loop=decode_loop)
        n = len(seen)
        from echotrain.runtime.episodes import _sample

        t = _sample(tiny_model, TURN_IDS, TURN_ATTN,
                    max_new_tokens=4, eos=[], pad_id=0, temperature=1.0, top_p=1.0, top_k=0, decode_loop=decode_loop,
                    sampler="inverse_cdf", keep_cache=decode_loop == "echotrain")
    finally:
        h.remove()
    assert n > 0 and len(seen) > n and not any(seen)
    assert b.rollout_log_prob is not None and not b.rollout_log_prob.requires_grad
    assert not t.log_prob.requires_grad
    for rc in t.row_caches or []:
        assert not any(x.requires_grad for kv in rc for x in kv)
