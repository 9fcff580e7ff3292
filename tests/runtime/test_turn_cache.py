"""The KV cache kept between the turns of an episode (echotrain.runtime.turn_cache and
``run_episodes(kv_cache=True)``): row caches are stacked right-aligned, the decode loop continues
from a cache of any prefix of its input, an episode's later turns prefill only the ids the cache
lacks, and the episodes drawn equal those of running the whole trajectory again."""

from __future__ import annotations

import pytest
import torch

from echotrain.envs import get_env_factory
from echotrain.runtime.decode import sample_tokens
from echotrain.runtime.episodes import run_episodes
from echotrain.runtime.rollout import encode_prompts, forward_log_probs
from echotrain.runtime.turn_cache import layers_of, row_cache, stack_row_caches
from echotrain.tasks import Example


@pytest.fixture(scope="module")
def policy():
    from tests.train.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=0)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.0  # turns end after a few tokens, at different steps
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return model.eval(), tok


def test_stack_row_caches_right_aligns_rows_of_different_lengths():
    a = [(torch.arange(1 * 2 * 3 * 4.).view(1, 2, 3, 4), -torch.ones(1, 2, 3, 4))]
    b = [(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0))]
    cache, mask = stack_row_caches([a, b])
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    (k, v), = layers_of(cache)
    assert k.shape == (2, 2, 3, 4)
    assert torch.equal(k[0], a[0][0][0]) and torch.equal(v[0], a[0][1][0])
    assert torch.equal(k[1, :, :2], torch.zeros(2, 2, 4)) and torch.equal(k[1, :, 2], torch.full((2, 4), 7.0))
    assert torch.equal(v[1, :, 2], torch.full((2, 4), 8.0))
    # a row cache drops the columns its mask does not attend, in order
    kept = row_cache(layers_of(cache), 1, mask[1])
    assert kept[0][0].shape == (1, 2, 1, 4) and torch.equal(kept[0][0], b[0][0])
    with pytest.raises(ValueError, match="empty"):
        stack_row_caches([])
    with pytest.raises(ValueError, match="layers"):
        stack_row_caches([a, a + a])


@pytest.mark.parametrize("covered", [1, 3, 5])
def test_decode_loop_continues_from_a_cache_of_any_prefix(policy, covered):
    """sample_tokens with a cache of the first ``covered`` columns draws what it draws from scratch."""
    model, tok = policy
    ids, attn = encode_prompts(tok, ["abc de", "x", "hello"], tok.pad_token_id)
    kw = dict(max_new_tokens=8, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        torch.manual_seed(5)
        ref = sample_tokens(model, ids, attn, **kw)
        pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
        pre = model(input_ids=ids[:, :covered], attention_mask=attn[:, :covered], position_ids=pos[:, :covered],
                    use_cache=True).past_key_values
        torch.manual_seed(5)
        got = sample_tokens(model, ids, attn, past_key_values=pre, **kw)
        with pytest.raises(ValueError, match="covers"):
            full = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True).past_key_values
            sample_tokens(model, ids, attn, past_key_values=full, **kw)
    assert ref.tokens.shape[1] > 2 and torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.log_prob, ref.log_prob, rtol=0, atol=1e-5)


def test_row_caches_hold_every_id_read_but_the_last(policy):
    """Each finished row's cache: its attended prompt ids and its drawn tokens but the last, and
    the keys equal those of a fresh forward over exactly those ids."""
    model, tok = policy
    ids, attn = encode_prompts(tok, ["abc de", "x", "hello"], tok.pad_token_id)
    torch.manual_seed(0)
    with torch.inference_mode():
        dec = sample_tokens(model, ids, attn, max_new_tokens=8, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id, return_cache=True)
        for r in range(3):
            drawn = dec.tokens[r].tolist()
            n = next((k + 1 for k, t in enumerate(drawn) if t == tok.eos_token_id), len(drawn))
            seq = ids[r][attn[r].bool()].tolist() + drawn[:n - 1]
            cache = dec.row_caches[r]
            assert len(cache) == 2 and cache[0][0].shape[2] == len(seq)
            fresh = layers_of(model(input_ids=torch.tensor([seq]), use_cache=True).past_key_values)
            for (k, v), (fk, fv) in zip(cache, fresh):
                torch.testing.assert_close(k, fk, rtol=0, atol=1e-5)
                torch.testing.assert_close(v, fv, rtol=0, atol=1e-5)
    assert sample_tokens(model, ids, attn, max_new_tokens=2, eos_token_ids=[], pad_token_id=0).row_caches is None


def _examples() -> list[Example]:
    return [Example(messages=[{"role": "user", "content": q}], question=q, answer="7", task="t", index=i)
            for i, q in enumerate(["what is 3 4", "and 12 30", "sum 1 2 3"])]


def _play(model, tok, kv_cache: bool, seed: int = 3):
    torch.manual_seed(seed)
    return run_episodes(model, tok, _examples(), 2, get_env_factory("feedback", message="check it"),
                        max_new_tokens=10, max_turns=3, max_episode_tokens=120, kv_cache=kv_cache).batch


def test_kept_cache_prefills_only_the_new_ids_and_draws_the_same_episodes(policy):
    model, tok = policy
    widths: list[int] = []  # the input width of every forward (the prefill's first)
    hook = model.register_forward_pre_hook(lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        cached = _play(model, tok, kv_cache=True)
        cached_widths, widths[:] = list(widths), []
        plain = _play(model, tok, kv_cache=False)
        plain_widths = list(widths)
    finally:
        hook.remove()
    turns = cached.episode_stats[:, 0]
    assert int(turns.max()) == 3 and int((turns > 1).sum()) >= 4  # real multi-turn episodes
    # the same episodes: ids, masks and the sampler's log-probs
    assert torch.equal(cached.response_ids, plain.response_ids)
    assert torch.equal(cached.response_mask, plain.response_mask)
    torch.testing.assert_close(cached.rollout_log_prob, plain.rollout_log_prob, rtol=0, atol=1e-5)
    # prefills (the forwards wider than one id): the first turn's is the same; later ones run the
    # whole trajectory again without the cache, only the end-of-turn id and the environment's with it
    big_cached = [w for w in cached_widths if w > 1]
    big_plain = [w for w in plain_widths if w > 1]
    assert len(big_cached) == len(big_plain) == 3 and big_cached[0] == big_plain[0]
    env_ids = len(tok("<s>user:check it</s><s>assistant:", add_special_tokens=False)["input_ids"])
    assert big_cached[1:] == [1 + env_ids, 1 + env_ids]
    assert all(p > c + 3 for p, c in zip(big_plain[1:], big_cached[1:]))
    # and the update's forward scores the model tokens as the sampler did
    lp, _ = forward_log_probs(model, cached.prompt_ids, cached.prompt_mask, cached.response_ids, cached.attended_mask)
    m = cached.response_mask.bool()
    torch.testing.assert_close(lp[m], cached.rollout_log_prob[m], rtol=0, atol=1e-4)


def test_a_sliding_window_model_runs_the_trajectory_again(policy):
    """Padding between a kept cache and the new ids would push keys out of a column-counting
    window: such a model keeps no cache, and its episodes still score as sampled."""
    from transformers import MistralConfig, MistralForCausalLM

    _, tok = policy
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=256,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).eval()
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        b = _play(model, tok, kv_cache=True)
    finally:
        hook.remove()
    assert int(b.episode_stats[:, 0].max()) >= 2
    big = [w for w in widths if w > 1]
    assert big == sorted(big) and big[-1] > 20  # every turn ran the whole trajectory
    lp, _ = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.attended_mask, pack=False,
                              share_prefix=False)
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], b.rollout_log_prob[m], rtol=0, atol=1e-4)


def test_kept_caches_are_freed_once_stacked_or_ended(policy, monkeypatch):
    """When a turn runs, no row cache of the turn before is alive: the live episodes' were copied
    into the stacked cache and dropped, the ended episodes' dropped (weak references)."""
    import gc
    import weakref

    from echotrain.runtime import episodes as episodes_mod

    model, tok = policy
    refs: list[list] = []
    dead_at_call: list[bool] = []
    real = episodes_mod._sample

    def spy(*args, **kwargs):
        gc.collect()
        if refs:
            dead_at_call.append(all(r() is None for r in refs[-1]))
        out = real(*args, **kwargs)
        refs.append([weakref.ref(c[0][0]) for c in (out.row_caches or []) if c is not None])
        return out

    monkeypatch.setattr(episodes_mod, "_sample", spy)
    b = _play(model, tok, kv_cache=True)
    assert int(b.episode_stats[:, 0].max()) == 3 and len(refs[0]) == 6  # every row's cache was taken at turn 1
    assert dead_at_call == [True, True]


@pytest.mark.parametrize("which", ["decode_loop", "generate", "testbed"])
def test_greedy_episodes_do_not_depend_on_the_seed(policy, which):
    """do_sample=False (evaluation): echotrain's decode loop, transformers' generate and the
    testbed's own generate all decode greedily (the same episodes under two seeds)."""
    if which == "testbed":
        from echotrain.models import load_policy
        from echotrain.tasks import get_task

        model, tok = load_policy("testbed-calc")
        examples, env = get_task("testbed-calc").sample(3, 0), get_env_factory("calculator")
        kw = dict(max_new_tokens=96, max_turns=2, max_episode_tokens=256)
    else:
        model, tok = policy
        examples, env = _examples(), get_env_factory("feedback", message="check it")
        kw = dict(max_new_tokens=10, max_turns=3, max_episode_tokens=120,
                  decode_loop="generate" if which == "generate" else "echotrain")
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        runs.append(run_episodes(model, tok, examples, 2, env, do_sample=False, **kw).batch)
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    assert torch.equal(runs[0].response_ids[0::2], runs[0].response_ids[1::2])  # a group's episodes agree
    torch.manual_seed(0)
    sampled = run_episodes(model, tok, examples, 2, env, do_sample=True, **kw).batch
    torch.manual_seed(1)
    again = run_episodes(model, tok, examples, 2, env, do_sample=True, **kw).batch
    assert sampled.response_ids.shape != again.response_ids.shape or not torch.equal(sampled.response_ids,
                                                                                       again.response_ids)
