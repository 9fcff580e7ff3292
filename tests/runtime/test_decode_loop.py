"""echotrain's decode loop (echotrain.runtime.decode): rows leave the batch at EOS; with
``sampler="multinomial"`` the tokens are the ones transformers' ``generate`` draws from the same
RNG state, with ``sampler="inverse_cdf"`` (the default) they follow the same distribution.

The reference is ``generate`` itself on a tiny randomly initialised Llama whose lm_head is biased
towards EOS, so that rows finish at different steps and the loop really drops some."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.runtime import rollout as R
from echotrain.runtime.decode import CDF_BLOCK, distribution_stats, inverse_cdf_sample, sample_tokens

TEXTS = ["abc", "hello world", "x", "12 34 56 7"]
G = 4
MAX_NEW = 20


@pytest.fixture(scope="module")
def policy():
    from tests.train.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=0)
    with torch.no_grad():  # rows end at different steps: some after 1-3 tokens, some run to MAX_NEW
        model.lm_head.weight[tok.eos_token_id].mul_(3.0)
    model.eval()
    return model, tok


def _inputs(tok, texts=TEXTS):
    return R.encode_prompts(tok, [t for t in texts for _ in range(G)], tok.pad_token_id)


def _hf(model, tok, ids, attn, seed, shared, **kw):
    torch.manual_seed(seed)
    hk = dict(attention_mask=attn, max_new_tokens=MAX_NEW, pad_token_id=tok.pad_token_id,
              eos_token_id=[tok.eos_token_id], use_cache=True, do_sample=kw.get("do_sample", True))
    if hk["do_sample"]:
        hk.update(temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 1.0), top_k=kw.get("top_k") or None)
    else:
        hk.update(temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        if shared:
            hk["past_key_values"], ids, hk["attention_mask"] = R._prefill(model, ids[::G], attn[::G], G)
        with R.RolloutLogProbRecorder(model, kw.get("temperature", 1.0)) as rec:
            out = model.generate(ids, **hk)[:, ids.shape[1]:]
        return out, rec.finish(out), rec.entropy(out)


def _ours(model, tok, ids, attn, seed, shared, **kw):
    kw.setdefault("sampler", "multinomial")
    torch.manual_seed(seed)
    with torch.inference_mode():
        pkv = None
        if shared:
            pkv, ids, attn = R._prefill(model, ids[::G], attn[::G], G)
        return sample_tokens(model, ids, attn, max_new_tokens=MAX_NEW, eos_token_ids=[tok.eos_token_id],
                             pad_token_id=tok.pad_token_id, past_key_values=pkv, **kw)


CASES = [dict(do_sample=False), dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(top_p=0.8),
         dict(temperature=1.3, top_k=7, top_p=0.9)]


#: prompts sharing a long prefix (a system prompt): the prefill computes it once
SHARED_TEXTS = ["Answer briefly, then stop. abc", "Answer briefly, then stop. hello world",
                "Answer briefly, then stop. x", "Answer briefly, then stop. 12 34 56 7"]


@pytest.mark.parametrize("texts", [TEXTS, SHARED_TEXTS], ids=["distinct", "common_prefix"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_same_tokens_and_log_probs_as_generate(policy, kw, shared, texts):
    """Greedy and every sampling warper, with and without the shared-prompt cache (of prompts
    with and without a common prefix): token ids identical to ``generate``'s from the same seed
    (the RNG is consumed the same way), and the recorded log-probs / entropies those of the
    in-generate recorder, up to float rounding."""
    model, tok = policy
    ids, attn = _inputs(tok, texts)
    for seed in (3, 11):
        ref, ref_lp, ref_ent = _hf(model, tok, ids, attn, seed, shared, **kw)
        got = _ours(model, tok, ids, attn, seed, shared, **kw)
        assert torch.equal(got.tokens, ref)
        valid = R.response_mask_from_ids(ref, [tok.eos_token_id], tok.pad_token_id)[0].bool()
        lengths = valid.sum(1)
        if kw.get("do_sample", True) and texts is TEXTS:  # the case really has rows ending at different steps
            assert int(lengths.min()) < MAX_NEW // 2 and int(lengths.max()) == MAX_NEW
        torch.testing.assert_close(got.log_prob[valid], ref_lp[valid], rtol=0, atol=1e-5)
        torch.testing.assert_close(got.entropy[valid], ref_ent[valid], rtol=0, atol=1e-5)
        assert (got.log_prob[~valid] == 0).all() and (got.entropy[~valid] == 0).all()
        # the RNG state after the loop is the one generate leaves (later draws of the run agree)
        after = torch.rand(4)
        _hf(model, tok, ids, attn, seed, shared, **kw)
        assert torch.equal(after, torch.rand(4))


def test_finished_rows_leave_the_batch(policy):
    """The forward calls shrink as rows emit EOS: the rows computed over all steps equal the sum
    of the response lengths (each row is computed until its EOS, not until the last row's)."""
    model, tok = policy
    ids, attn = _inputs(tok)
    sizes: list[int] = []
    h = model.register_forward_pre_hook(lambda m, a, k: sizes.append(int(k["input_ids"].shape[0])), with_kwargs=True)
    try:
        got = _ours(model, tok, ids, attn, 3, False)
    finally:
        h.remove()
    lengths = R.response_mask_from_ids(got.tokens, [tok.eos_token_id], tok.pad_token_id)[0].sum(1)
    assert sizes[0] == len(ids) and sizes == sorted(sizes, reverse=True) and sizes[-1] < len(ids)
    assert len(sizes) == got.tokens.shape[1] == int(lengths.max())
    assert sum(sizes) == int(lengths.sum())


def test_no_eos_runs_every_row_to_max_new_tokens(policy):
    model, tok = policy
    ids, attn = _inputs(tok)
    torch.manual_seed(0)
    with torch.inference_mode():
        got = sample_tokens(model, ids, attn, max_new_tokens=7, eos_token_ids=[], pad_token_id=tok.pad_token_id,
                            record_log_prob=False)
    assert got.tokens.shape == (len(ids), 7) and got.log_prob is None and got.entropy is None


@pytest.mark.parametrize("bad, match", [(dict(max_new_tokens=0), "max_new_tokens"),
                                        (dict(temperature=0.0), "temperature"),
                                        (dict(attention_mask=torch.ones(2, 3, dtype=torch.long)), "attention_mask")])
def test_bad_arguments_name_themselves(policy, bad, match):
    model, tok = policy
    ids, attn = _inputs(tok)
    kw = dict(max_new_tokens=4, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    kw.update({k: v for k, v in bad.items() if k != "attention_mask"})
    with pytest.raises(ValueError, match=match):
        sample_tokens(model, ids, bad.get("attention_mask", attn), **kw)


def test_generate_rollouts_either_loop_gives_the_same_batch(policy):
    """``generate_rollouts(decode_loop=...)``: the whole RolloutBatch (ids, masks, truncation,
    recorded log-probs) agrees between echotrain's loop and ``generate``; a bad name is refused."""
    model, tok = policy
    out = {}
    for loop in ("generate", "echotrain"):
        torch.manual_seed(4)
        out[loop] = R.generate_rollouts(model, tok, TEXTS, G, max_new_tokens=MAX_NEW, temperature=0.9,
                                        decode_loop=loop, sampler="multinomial")
    a, b = out["generate"], out["echotrain"]
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert bool(a.truncated.any()) and not bool(a.truncated.all())
    torch.testing.assert_close(b.rollout_log_prob, a.rollout_log_prob, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.rollout_entropy, a.rollout_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.rollout_sum_pi_squared, a.rollout_sum_pi_squared, rtol=0, atol=1e-6)
    assert float(a.rollout_sum_pi_squared.abs().sum()) > 0
    with pytest.raises(ValueError, match="decode_loop"):
        R.generate_rollouts(model, tok, TEXTS, G, max_new_tokens=4, decode_loop="vllm")
    with pytest.raises(ValueError, match="sampler"):
        R.generate_rollouts(model, tok, TEXTS, G, max_new_tokens=4, sampler="gumbel")


def test_inverse_cdf_sample_frequencies_and_zeros():
    """Empirical frequencies of 200,000 draws per row match the (unnormalised) probabilities
    within 5 standard errors; a probability-0 entry is never drawn, also at the ends of the row."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
                          [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    torch.manual_seed(0)
    n = 200_000
    draws = inverse_cdf_sample(probs.repeat_interleave(n, 0)).view(3, n)
    p = probs / probs.sum(-1, keepdim=True)
    freq = torch.stack([torch.bincount(r, minlength=6) for r in draws]).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
    assert (freq[p == 0] == 0).all()


def test_inverse_cdf_sample_top_of_the_unit_interval(monkeypatch):
    """u just below 1 picks the last token of positive probability, never a trailing zero."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((2, 1), 1 - 2**-53, dtype=torch.float64))
    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert inverse_cdf_sample(probs).tolist() == [1, 3]


def test_inverse_cdf_sample_bottom_of_the_unit_interval_and_bad_rows(monkeypatch):
    """u = 0 picks the first token of positive probability, never a leading zero; a row with a
    NaN/Inf entry or no positive probability raises (as torch.multinomial does)."""
    probs = torch.tensor([[0.0, 0.0, 0.7, 0.3]])
    with monkeypatch.context() as m:
        m.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, 1, dtype=torch.float64))
        assert inverse_cdf_sample(probs).tolist() == [2]
    for bad in ([float("nan"), 0.5, 0.5], [0.0, 0.0, 0.0], [float("inf"), 1.0, 0.0]):
        with pytest.raises(ValueError, match="probs: a row has a NaN/Inf entry or no positive probability"):
            inverse_cdf_sample(torch.tensor([bad]))


def test_inverse_cdf_sample_keeps_small_probabilities_of_a_large_vocabulary(monkeypatch):
    """A float32 cumulative sum would absorb 1e-8 entries after a 1.0 (so that 1% of the mass could
    never be drawn); the float64 one finds the token that u = 0.995 points at in that tail."""
    probs = torch.full((1, 1_000_001), 1e-8)
    probs[0, 0] = 1.0
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1, 1), 0.995, dtype=torch.float64))
    # u * total = 0.995 * 1.01 = 1.00495: 0.00495 of tail mass, i.e. the 495,000th tail entry
    assert abs(int(inverse_cdf_sample(probs)) - 495_000) <= 2


def test_inverse_cdf_sample_rows_are_independent():
    """Two rows of the same distribution draw independently: equal in half of the draws for a fair
    coin (a uniform shared or stratified across rows would make them always equal or never)."""
    torch.manual_seed(0)
    draws = inverse_cdf_sample(torch.full((2 * 20_000, 2), 0.5)).view(20_000, 2)
    same = (draws[:, 0] == draws[:, 1]).double().mean()
    assert abs(float(same) - 0.5) < 5 * (0.25 / 20_000) ** 0.5


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_inverse_cdf_first_tokens_follow_the_model(policy, kw):
    """sampler=inverse_cdf: the first tokens of 6,000 rows of one prompt follow the warped
    softmax of the model's logits (every token's frequency within 5 standard errors; nothing
    outside the top k drawn), and the recorded log-probs are those tokens' log-probs."""
    model, tok = policy
    n = 6000
    ids, attn = R.encode_prompts(tok, ["hello world"] * n, tok.pad_token_id)
    torch.manual_seed(2)
    with torch.inference_mode():
        got = sample_tokens(model, ids, attn, max_new_tokens=1, eos_token_ids=[], pad_token_id=tok.pad_token_id,
                            sampler="inverse_cdf", **kw)
        logits = model(ids[:1], attention_mask=attn[:1]).logits[0, -1].float().clone() / kw["temperature"]
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(got.log_prob[:, 0], lp[got.tokens[:, 0]], rtol=0, atol=1e-5)
    if kw.get("top_k"):
        logits = logits.masked_fill(logits < logits.topk(kw["top_k"]).values[-1], float("-inf"))
    p = torch.softmax(logits, -1).double()
    freq = torch.bincount(got.tokens[:, 0], minlength=len(p)).double() / n
    assert (freq[p == 0] == 0).all()
    # each token expected >= 20 times on its own, the rarer ones pooled into one bin
    big = p * n >= 20
    bins_p, bins_f = torch.cat([p[big], p[~big].sum()[None]]), torch.cat([freq[big], freq[~big].sum()[None]])
    assert int(big.sum()) >= 3
    assert ((bins_f - bins_p).abs() <= 5 * (bins_p * (1 - bins_p) / n).sqrt() + 1e-12).all(), (bins_f, bins_p)


def test_prefill_computes_the_common_prefix_once(policy):
    """_prefill of prompts sharing a prefix: one forward of the prefix (one row), one of the
    prompts' rests but their last token, in the layout [prefix | padding | rest]; the decode from
    that cache gives the tokens and log-probs of decoding the left-padded prompts from scratch."""
    model, tok = policy
    ids, attn = _inputs(tok, SHARED_TEXTS)
    calls = []
    h = model.register_forward_pre_hook(lambda m, a, k: calls.append(tuple((a[0] if a else k["input_ids"]).shape)), with_kwargs=True)
    try:
        with torch.inference_mode():
            cache, p_ids, p_attn = R._prefill(model, ids[::G], attn[::G], G)
    finally:
        h.remove()
    real = [r[m.bool()].tolist() for r, m in zip(ids[::G], attn[::G])]
    C = next(i for i in range(min(map(len, real))) if len({r[i] for r in real}) > 1)
    W = max(len(r) for r in real) - C
    assert C >= 10 and calls == [(1, C), (len(SHARED_TEXTS), W - 1)]
    assert p_ids.shape == (len(ids), C + W) and torch.equal(p_attn.sum(1), attn.sum(1))
    for row, r in zip(p_ids[::G], real):
        assert row[:C].tolist() == r[:C] and row[-(len(r) - C):].tolist() == r[C:]
    with torch.inference_mode():
        torch.manual_seed(5)
        ref = sample_tokens(model, ids, attn, max_new_tokens=MAX_NEW, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id, sampler="multinomial")
        torch.manual_seed(5)
        got = sample_tokens(model, p_ids, p_attn, max_new_tokens=MAX_NEW, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id, past_key_values=cache, sampler="multinomial")
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.log_prob, ref.log_prob, rtol=0, atol=1e-5)


def test_prefill_of_one_token_prompts_or_nothing_shared(policy):
    """Nothing to share (no common prefix and G = 1) or nothing to prefill (one-token prompts):
    no cache, the prompts as given."""
    model, tok = policy
    ids = torch.tensor([[5, 6], [7, 8]])
    attn = torch.ones_like(ids)
    with torch.inference_mode():
        assert R._prefill(model, ids, attn, 1) == (None, ids, attn)
        one = torch.tensor([[0, 5], [0, 7]]), torch.tensor([[0, 1], [0, 1]])
        assert R._prefill(model, *one, 4) == (None, *one)


def test_prefill_of_a_sliding_window_model_keeps_the_left_padded_layout(policy):
    """A model whose attention window counts columns (Mistral's sliding window) gets no
    common-prefix layout (padding between the prefix and a prompt's rest would push keys out of
    its window): the prefill is the left-padded one, and decoding from it equals decoding the
    prompts from scratch, with a window shorter than the prompts."""
    from transformers import MistralConfig, MistralForCausalLM

    from echotrain.runtime.packing import has_window_attention

    _, tok = policy
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        max_position_embeddings=256, attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).eval()
    assert has_window_attention(model)
    ids, attn = _inputs(tok, SHARED_TEXTS)
    with torch.inference_mode():
        cache, p_ids, p_attn = R._prefill(model, ids[::G], attn[::G], G)
        assert torch.equal(p_ids, ids) and torch.equal(p_attn, attn)  # left-padded, as given
        kw = dict(max_new_tokens=6, eos_token_ids=[], pad_token_id=tok.pad_token_id, do_sample=False)
        ref = sample_tokens(model, ids, attn, **kw)
        got = sample_tokens(model, p_ids, p_attn, past_key_values=cache, **kw)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.log_prob, ref.log_prob, rtol=0, atol=1e-5)


def _one_level_inverse_cdf(probs: torch.Tensor, u01: torch.Tensor) -> torch.Tensor:
    """The reference inversion: one float64 cumulative sum over the whole row."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u01 * cdf[:, -1:], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("V", [49_152, 3 * CDF_BLOCK + 37, 5])
def test_inverse_cdf_sample_two_levels_equal_one_cumulative_sum(monkeypatch, V):
    """The block search draws the token that one float64 cumulative sum over the row would for the same u
    (64 rows, 30% of the entries 0, a vocabulary that is or is not a multiple of the block, or smaller than one)."""
    g = torch.Generator().manual_seed(V)
    probs = torch.rand(64, V, generator=g) ** 4
    probs[torch.rand(64, V, generator=g) < 0.3] = 0.0
    probs[:, 0] += 1e-3  # every row has some mass
    for _ in range(5):
        u01 = torch.rand(64, 1, dtype=torch.float64, generator=g)
        monkeypatch.setattr(torch, "rand", lambda *a, u01=u01, **k: u01.clone())
        got = inverse_cdf_sample(probs)
        assert got.dtype == torch.int64 and got.shape == (64,)
        assert torch.equal(got, _one_level_inverse_cdf(probs, u01))
        assert bool((probs[torch.arange(64), got] > 0).all())


def test_inverse_cdf_sample_just_below_every_block_boundary_draws_a_positive_token(monkeypatch):
    """u just below each block's cumulative mass: the block's own cumulative sum (another summation order than
    the block sums') may end below u by rounding; the draw is then the block's last positive entry, never a
    zero that follows it. Sparse rows (half the entries 0, many blocks ending in zeros), every boundary."""
    g = torch.Generator().manual_seed(7)
    V = 12 * CDF_BLOCK
    probs = torch.rand(16, V, generator=g) ** 12
    probs[torch.rand(16, V, generator=g) < 0.5] = 0.0
    coarse = probs.view(16, 12, CDF_BLOCK).sum(-1, dtype=torch.float64).cumsum(-1)
    for b in range(12):
        u = torch.nextafter(coarse[:, b: b + 1], torch.zeros(1, dtype=torch.float64))
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: u / coarse[:, -1:])
        got = inverse_cdf_sample(probs)
        assert bool((probs[torch.arange(16), got] > 0).all()), b


def test_inverse_cdf_sample_first_positive_token_and_the_top_of_the_row(monkeypatch):
    """u = 0 with the mass in the third block only draws that block's first positive entry (the block search
    is ``right=True``: a block of zero mass is passed over); u at the row's total (defensive: torch.rand < 1)
    draws the last positive entry, never the zeros that follow it; ``_last_positive`` on plain rows."""
    from echotrain.runtime.decode import _last_positive

    V = 4 * CDF_BLOCK + 10
    probs = torch.zeros(2, V)
    probs[:, 2 * CDF_BLOCK + 5: 2 * CDF_BLOCK + 9] = 1.0
    probs[1, CDF_BLOCK + 1] = 0.5
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(2, 1, dtype=torch.float64))
    assert inverse_cdf_sample(probs).tolist() == [2 * CDF_BLOCK + 5, CDF_BLOCK + 1]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(2, 1, dtype=torch.float64))
    assert inverse_cdf_sample(probs).tolist() == [2 * CDF_BLOCK + 8, 2 * CDF_BLOCK + 8]
    assert _last_positive(torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])).tolist() == [1, 0, 3]


def test_warpers_that_write_into_their_input_leave_the_recorded_log_probs_alone(policy, monkeypatch):
    """The logits are copied for the warpers: a warper that halves the scores in place draws the same tokens
    and records the same (unwarped) log-probs as one that returns a new tensor."""
    from transformers import LogitsProcessorList

    from echotrain.runtime import decode

    model, tok = policy
    ids, attn = R.encode_prompts(tok, ["hello world", "abc"], tok.pad_token_id)
    out = []
    for warper in (lambda i, s: s.div_(2.0), lambda i, s: s / 2.0):
        monkeypatch.setattr(decode, "_warpers", lambda *a, w=warper: LogitsProcessorList([w]))
        torch.manual_seed(3)
        with torch.inference_mode():
            out.append(sample_tokens(model, ids, attn, max_new_tokens=5, eos_token_ids=[], pad_token_id=tok.pad_token_id))
    assert torch.equal(out[0].tokens, out[1].tokens)
    torch.testing.assert_close(out[0].log_prob, out[1].log_prob, rtol=0, atol=0)
    torch.testing.assert_close(out[0].entropy, out[1].entropy, rtol=0, atol=0)


def test_distribution_stats_closed_form():
    """Entropy and sum of squared probabilities of known distributions: uniform over 4 (ln 4, 1/4), a point
    mass (0, 1), and [0.5, 0.25, 0.25] (1.5 ln 2, 0.375), from their log-softmax; the log-probs of -inf of
    the zero entries add 0 (0 log 0), not NaN; a NaN in a row stays NaN (a diverged policy is not hidden)."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0]])
    ent, sq = distribution_stats(torch.log_softmax(probs.log(), -1))
    assert ent.dtype == sq.dtype == torch.float32 and ent.device.type == "cpu"
    torch.testing.assert_close(ent, torch.tensor([math.log(4), 0.0, 1.5 * math.log(2)]))
    torch.testing.assert_close(sq, torch.tensor([0.25, 1.0, 0.375]))
    ent, sq = distribution_stats(torch.tensor([[float("nan"), -1.0, -2.0], [-1.0, -1.0, -1.0]]))
    assert math.isnan(ent[0]) and math.isnan(sq[0]) and not math.isnan(ent[1])
