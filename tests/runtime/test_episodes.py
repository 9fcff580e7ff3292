"""Multi-turn episodes (echotrain.runtime.episodes): the ids trained on are the ids sampled, the
environment's ids come from the chat template as a delta (no decode-then-encode drift), and the
update's forward layouts (packed rows, the KV-cache prefix, the plain forward) give the sampler's
log-probs on responses with holes."""

from __future__ import annotations

import pytest
import torch

from echotrain.envs import get_env_factory
from echotrain.runtime import episodes as episodes_mod
from echotrain.runtime.episodes import EPISODE_STATS, TurnRenderer, run_episodes
from echotrain.runtime.rollout import forward_log_probs
from echotrain.tasks import Example
from echotrain.train.config import TrainConfig
from echotrain.train.update import policy_log_probs


def _record_samples(monkeypatch) -> list[list[list[int]]]:
    """Wrap the turn sampler: each call's rows as token lists (what the sampler drew)."""
    calls: list[list[list[int]]] = []
    real = episodes_mod._sample

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.tokens.tolist())
        return out

    monkeypatch.setattr(episodes_mod, "_sample", spy)
    return calls


def _segments(mask_row: torch.Tensor, n: int) -> list[tuple[int, int, int]]:
    """``(start, stop, value)`` runs of a 0/1 row's first n entries."""
    out, start = [], 0
    for t in range(1, n + 1):
        if t == n or mask_row[t] != mask_row[start]:
            out.append((start, t, int(mask_row[start])))
            start = t
    return out


def test_ids_trained_equal_ids_sampled_on_the_testbed(monkeypatch):
    from echotrain.models import load_policy
    from echotrain.tasks import get_task

    model, tok = load_policy("testbed")
    calls = _record_samples(monkeypatch)
    torch.manual_seed(0)
    examples = get_task("testbed-calc").sample(2, 0)
    res = run_episodes(model, tok, examples, 2, get_env_factory("feedback", message="again"), max_new_tokens=6,
                       max_turns=3, max_episode_tokens=64)
    b = res.batch
    stats = dict(zip(EPISODE_STATS, b.episode_stats.T))
    assert stats["turns"].max() >= 2 and stats["env_tokens"].sum() > 0  # real multi-turn episodes with holes
    env_ids = tok("again\n", add_special_tokens=False, return_tensors=None)["input_ids"]
    for i in range(len(b)):
        n = int(b.attended_mask[i].sum())
        live_rows = []  # the sampler's rows of episode i, turn by turn
        for turn, rows in enumerate(calls):
            alive = [j for j in range(len(b)) if stats["turns"][j] > turn]
            if i in alive:
                live_rows.append(rows[alive.index(i)])
        segs = _segments(b.response_mask[i], n)
        model_segs = [s for s in segs if s[2] == 1]
        assert len(model_segs) == int(stats["turns"][i]) == len(live_rows)
        for (s, e, _), sampled in zip(model_segs, live_rows):
            assert b.response_ids[i, s:e].tolist() == sampled[:e - s]  # the sampled ids, as drawn
            assert sampled[e - s - 1] == tok.eos_token_id or e - s == 6
        for s, e, v in segs:
            if v == 0:
                assert b.response_ids[i, s:e].tolist() == env_ids  # the environment's ids, masked out
    # the update's forward (train/update.py) scores exactly these ids at these positions: its
    # log-probs are the sampler's on every model token
    lp, _ = policy_log_probs(model, b, TrainConfig(model="testbed", task="testbed"))
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], b.rollout_log_prob[m], rtol=0, atol=2e-5)


def _smollm_tokenizer():
    from transformers import AutoTokenizer

    from echotrain.models.gguf import default_cache_dir

    path = default_cache_dir() / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"no converted SmolLM2-135M tokenizer at {path}")
    return AutoTokenizer.from_pretrained(path)


def _tiny_llama(tok, eos_bias: float = 0.0):
    """A random 2-layer Llama on SmolLM2's vocabulary; ``eos_bias`` added to the EOS logit (short turns)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    if eos_bias:
        bias = torch.zeros(len(tok))
        bias[tok.eos_token_id] = eos_bias
        model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    return model


def _chat_example(q: str) -> Example:
    return Example(messages=[{"role": "user", "content": q}], question=q, answer="7", task="t", index=0)


def test_decode_then_encode_drift_cannot_happen(monkeypatch):
    """Sampled ids that are not the tokenizer's own encoding of their text stay as sampled; the
    environment's turn is the chat template's delta, tokenised on its own."""
    tok = _smollm_tokenizer()
    model = _tiny_llama(tok)
    eos = tok.eos_token_id
    word = tok("hello", add_special_tokens=False)["input_ids"]
    split = [tok.convert_tokens_to_ids(c) for c in "hello"]  # h e l l o: five ids for one word
    assert len(word) == 1 and len(split) == 5 and tok.unk_token_id not in split
    scripted = [split + [eos], split[:2] + [eos]]
    assert tok(tok.decode(scripted[0][:-1]), add_special_tokens=False)["input_ids"] != scripted[0][:-1]  # drift

    def fake(model, ids, attn, *, max_new_tokens, **kw):
        turn = fake.turn
        fake.turn += 1
        rows = [scripted[turn] + [tok.pad_token_id] * (8 - len(scripted[turn]))] * ids.shape[0]
        t = torch.tensor(rows)[:, :max_new_tokens]
        return episodes_mod.Turn(t, torch.zeros(t.shape), torch.zeros(t.shape))

    fake.turn = 0
    monkeypatch.setattr(episodes_mod, "_sample", fake)
    res = run_episodes(model, tok, [_chat_example("What is 3+4?")], 1, get_env_factory("feedback", message="Sure?"),
                       max_new_tokens=8, max_turns=2, max_episode_tokens=64)
    b = res.batch
    n = int(b.attended_mask[0].sum())
    ids = b.response_ids[0, :n].tolist()
    delta = TurnRenderer(tok, True, tok.convert_ids_to_tokens(eos)).delta_text(
        [{"role": "user", "content": "What is 3+4?"}], [{"role": "user", "content": "Sure?"}])
    assert delta == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    env = tok(delta, add_special_tokens=False)["input_ids"]
    assert ids == scripted[0] + env + scripted[1]
    assert b.response_mask[0, :n].tolist() == [1.0] * 6 + [0.0] * len(env) + [1.0] * 3
    # the trajectory reads as the template renders the conversation (plus the newline it writes after the last EOS)
    convo = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "he"}]
    p = int(b.prompt_mask[0].sum())
    text = tok.decode(b.prompt_ids[0, -p:].tolist() + ids)
    assert text + "\n" == tok.apply_chat_template(convo, tokenize=False)


@pytest.mark.parametrize("layout", [dict(pack=True), dict(pack=False), dict(share_prefix=False)],
                         ids=["packed", "kv_cache", "plain"])
def test_forward_layouts_give_the_sampler_log_probs_on_holed_responses(layout):
    """Real sampling (echotrain's decode loop) of chat episodes with holes; every forward layout of
    the update scores the model's tokens as the sampler did."""
    tok = _smollm_tokenizer()
    model = _tiny_llama(tok, eos_bias=10.0)
    torch.manual_seed(1)
    res = run_episodes(model, tok, [_chat_example("What is 3+4?"), _chat_example("And 12+30?")], 3,
                       get_env_factory("feedback", message="Check it."), max_new_tokens=6, max_turns=3,
                       max_episode_tokens=80)
    b = res.batch
    holes = (b.attended_mask - b.response_mask).sum(-1)
    assert int((holes > 0).sum()) >= 3  # several responses of several segments
    lp, _ = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.attended_mask, **layout)
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], b.rollout_log_prob[m], rtol=0, atol=1e-4)


def _scripted_bytes(monkeypatch, turns: list[str]):
    """The turn sampler replaced by fixed byte-level turns (every row the same)."""
    from echotrain.models.byte_tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    def fake(model, ids, attn, *, max_new_tokens, **kw):
        t = torch.tensor([tok.encode(turns[fake.turn])] * ids.shape[0])[:, :max_new_tokens]
        fake.turn += 1
        return episodes_mod.Turn(t, torch.full(t.shape, -0.5), torch.zeros(t.shape))

    fake.turn = 0
    monkeypatch.setattr(episodes_mod, "_sample", fake)
    return tok


@pytest.mark.parametrize("turns, kw, expect", [
    # turn 1 calls, the reply (7 ids) fits, turn 2 answers: 2 turns, no cut
    (["ab\n", "7\n"], dict(max_turns=3, max_episode_tokens=12), dict(turns=2, env_tokens=7, model_tokens=5, cut=(0, 0))),
    # the reply would pass the budget (3 + 7 >= 10): cut by tokens after turn 1, truncated
    (["ab\n"], dict(max_turns=3, max_episode_tokens=10), dict(turns=1, env_tokens=0, model_tokens=3, cut=(1, 0))),
    # max_turns=2 and turn 2 is still not an answer: cut by turns, not truncated
    (["ab\n", "cd\n"], dict(max_turns=2, max_episode_tokens=64), dict(turns=2, env_tokens=7, model_tokens=6, cut=(0, 1))),
    # a turn without its EOS within max_new_tokens=4: cut by tokens, truncated
    (["abcdef\n"], dict(max_turns=3, max_episode_tokens=64), dict(turns=1, env_tokens=0, model_tokens=4, cut=(1, 0))),
])
def test_episode_ends_and_counts(monkeypatch, turns, kw, expect):
    """Hand-counted episodes of the byte tokenizer (one id a character): the environment's turn
    is the plain renderer's ``again!\\n`` (7 ids); a model turn ends at its ``\\n`` (EOS);
    ``max_new_tokens=4``."""
    tok = _scripted_bytes(monkeypatch, turns)
    make = get_env_factory("feedback", message="again!")  # plain renderer: "again!\n" = 7 ids
    if turns[-1] == "7\n":
        class Answer:
            def __init__(self):
                self.n = 0

            def reset(self, ex):
                return ex.messages

            def step(self, text):
                from echotrain.envs import EnvReply

                self.n += 1
                return EnvReply(done=text == "7", messages=[{"role": "user", "content": "again!"}])
        make = Answer
    ex = Example(messages="3+4=", question="3+4=", answer="7", task="t", index=0)
    res = run_episodes(torch.nn.Linear(1, 1), tok, [ex], 1, make, max_new_tokens=4, **kw)
    stats = dict(zip(EPISODE_STATS, res.batch.episode_stats[0].tolist()))
    assert (stats["turns"], stats["env_tokens"], stats["model_tokens"]) == (
        expect["turns"], expect["env_tokens"], expect["model_tokens"])
    assert (stats["cut_by_tokens"], stats["cut_by_turns"]) == expect["cut"]
    assert bool(res.batch.truncated[0]) == bool(expect["cut"][0])
    b = res.batch
    assert float(b.response_mask.sum()) == expect["model_tokens"]
    assert float((b.attended_mask - b.response_mask).sum()) == expect["env_tokens"]
    assert b.rollout_log_prob[b.response_mask.bool()].eq(-0.5).all() and b.rollout_log_prob[~b.response_mask.bool()].eq(0).all()


def test_evaluation_of_an_env_run_scores_the_final_turn_of_episodes(monkeypatch):
    """evaluate(episodes=...) plays the environment's turns and scores each episode's last model
    turn: a scripted policy that answers only after the feedback is right every time with the
    environment, and never when its first turn is scored alone."""
    from echotrain.models.byte_tokenizer import ByteTokenizer
    from echotrain.tasks import get_task
    from echotrain.train.evaluate import evaluate

    tok = ByteTokenizer()

    def fake(model, ids, attn, *, max_new_tokens, **kw):  # turn 1: "?"; after the feedback: the sum
        rows = []
        for r in range(ids.shape[0]):
            text = tok.decode(ids[r][attn[r].bool()].tolist(), skip_special_tokens=True)
            question = text.split("=")[0]
            rows.append(tok.encode(f"{eval(question)}\n" if "again" in text else "?\n"))
        width = max(len(r) for r in rows)
        t = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])[:, :max_new_tokens]
        return episodes_mod.Turn(t, torch.zeros(t.shape), torch.zeros(t.shape))

    monkeypatch.setattr(episodes_mod, "_sample", fake)
    model, task = torch.nn.Linear(1, 1), get_task("testbed")
    episodes = dict(make_env=get_env_factory("feedback", message="again"), max_turns=2, max_episode_tokens=32)
    res = evaluate(model, tok, task, num_prompts=6, n=1, max_new_tokens=8, temperature=0.0, episodes=episodes)
    assert res["accuracy"] == 1.0 and res["truncated_frac"] == 0.0
    one_turn = dict(episodes, max_turns=1)
    assert evaluate(model, tok, task, num_prompts=6, n=1, max_new_tokens=8, temperature=0.0,
                    episodes=one_turn)["accuracy"] == 0.0


def test_the_turn_end_is_the_eos_the_template_closes_turns_with(monkeypatch):
    """A model whose generation config lists another eos first (Llama-3: <|end_of_text|> before <|eot_id|>) still
    plays episodes: the environment's delta is cut after the id the template writes after an assistant turn
    (before: "the chat template does not close an assistant turn with '<|endoftext|>'")."""
    from echotrain.runtime.episodes import turn_end_id

    tok = _smollm_tokenizer()
    model = _tiny_llama(tok)
    end_of_text, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.eos_token_id
    assert end_of_text != im_end
    model.generation_config.eos_token_id = [end_of_text, im_end]
    assert turn_end_id(model, tok, True) == im_end
    assert turn_end_id(model, tok, False) == end_of_text  # plain prompts: the first, as before
    scripted = [[tok.convert_tokens_to_ids("h"), im_end], [tok.convert_tokens_to_ids("e"), end_of_text]]

    def fake(model, ids, attn, *, max_new_tokens, **kw):
        t = torch.tensor([scripted[fake.turn]] * ids.shape[0])
        fake.turn += 1
        return episodes_mod.Turn(t, torch.zeros(t.shape), torch.zeros(t.shape))

    fake.turn = 0
    monkeypatch.setattr(episodes_mod, "_sample", fake)
    res = run_episodes(model, tok, [_chat_example("What is 3+4?")], 1, get_env_factory("feedback", message="Sure?"),
                       max_new_tokens=4, max_turns=2, max_episode_tokens=64)
    n = int(res.batch.attended_mask[0].sum())
    env = tok("\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert res.batch.response_ids[0, :n].tolist() == scripted[0] + env + scripted[1]


def test_the_delta_of_a_template_that_requires_alternating_roles():
    """A Mistral/Llama-2-style template that refuses two assistant turns in a row: the environment's delta after a
    history ending with the model's turn renders (the placeholder takes that turn's place), and it is what the
    template writes for the whole conversation after that turn's end-of-turn."""
    from tests.train.conftest import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'assistant') != (loop.index0 % 2 == 1) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
    eos_text = tok.convert_ids_to_tokens(tok.eos_token_id)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    delta = TurnRenderer(tok, True, eos_text).delta_text(history, [{"role": "user", "content": "c"}])
    whole = tok.apply_chat_template(history + [{"role": "user", "content": "c"}], tokenize=False,
                                    add_generation_prompt=True)
    assert delta == "<s>user:c</s><s>assistant:"
    assert whole.endswith("b</s>" + delta)


#: Gemma's rule: a system message goes into the first user turn, then user and model turns alternate; no ``tool``
#: role (its template raises on one)
GEMMA_LIKE = ("{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + ' ' %}"
              "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
              "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/model/user/model/...') }}{% endif %}"
              "<s>{{ 'model' if m['role'] == 'assistant' else m['role'] }}:{{ first if loop.first else '' }}"
              "{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>model:{% endif %}")


def test_a_reply_the_template_refuses_is_a_template_error_naming_the_remedy():
    """A Gemma-style template renders a user reply but refuses a tool result: TemplateError (a ValueError) with the
    role, the template's own message and the remedy (chat_template=FILE), not jinja's bare exception."""
    from tests.train.conftest import make_tokenizer
    from echotrain.runtime.episodes import TemplateError

    tok = make_tokenizer()
    tok.chat_template = GEMMA_LIKE
    renderer = TurnRenderer(tok, True, "</s>")
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert renderer.delta_text(history, [{"role": "user", "content": "c"}]) == "<s>user:c</s><s>model:"
    with pytest.raises(TemplateError, match=r"cannot render the environment's reply \(role 'tool'\) after a model "
                                            r"turn: TemplateError: Conversation roles must alternate .*"
                                            r"chat_template=FILE") as err:
        renderer.delta_text(history, [{"role": "tool", "content": "c"}])
    assert isinstance(err.value, ValueError) and err.value.__cause__ is not None
