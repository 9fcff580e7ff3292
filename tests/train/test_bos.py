"""Issue 9 case 5: one BOS, never zero and never two, for string and chat-templated prompts, in the
rollouts, the log-prob path (which reuses the rollout's prompt ids) and ``evaluate``."""

from __future__ import annotations

import pytest
import torch

from echotrain.train.evaluate import evaluate
from echotrain.runtime.rollout import bos_to_prepend, encode_prompts, forward_log_probs, generate_rollouts

BOS = 1


@pytest.fixture
def bos_tokenizer(tiny_tokenizer):
    """The char tokenizer with a Llama-style post-processor that adds BOS (id 1)."""
    from tokenizers import processors

    tiny_tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)])
    assert tiny_tokenizer("hi")["input_ids"] == [BOS, 21, 22]  # what the model is trained on
    return tiny_tokenizer


NO_BOS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


def _rows(ids, attn):
    return [r[m.bool()].tolist() for r, m in zip(ids, attn)]


def test_encode_prompts_one_bos(bos_tokenizer):
    assert bos_to_prepend(bos_tokenizer) == BOS
    chat_with_bos = bos_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                      add_generation_prompt=True)
    assert chat_with_bos.startswith("<s>")  # this template writes BOS itself
    ids, attn = encode_prompts(bos_tokenizer, ["hi", chat_with_bos, "<s>hi"])
    rows = _rows(ids, attn)
    assert rows[0] == [BOS, 21, 22]  # string prompt: BOS added (was [21, 22])
    assert rows[1][:2] == [BOS, 34] and rows[1].count(BOS) == 2  # "<s>u...": the template's BOS, not doubled
    assert rows[2] == [BOS, 21, 22]  # already there: not doubled
    assert ids[0, 0].item() == bos_tokenizer.pad_token_id  # left-padded


def test_no_bos_for_tokenizers_without_one(tiny_tokenizer):
    assert bos_to_prepend(tiny_tokenizer) is None  # no post-processor BOS: the model never saw one
    ids, attn = encode_prompts(tiny_tokenizer, ["hi"])
    assert _rows(ids, attn) == [[21, 22]]


def _spy_generate(model):
    seen = []
    orig = model.generate

    def generate(input_ids, **kw):
        seen.append((input_ids.clone(), kw["attention_mask"].clone()))
        return orig(input_ids, **kw)

    model.generate = generate
    return seen


@pytest.mark.parametrize("template", ["bos", "no_bos"])
def test_rollouts_log_probs_and_eval_see_one_bos(bos_tokenizer, make_tiny_model, digit_task, template):
    if template == "no_bos":
        bos_tokenizer.chat_template = NO_BOS_TEMPLATE
    model = make_tiny_model(bos_tokenizer)
    seen = _spy_generate(model)
    prompts = ["hi", [{"role": "user", "content": "say 3"}]]
    torch.manual_seed(0)
    # the spy watches generate; both decode loops get the same encoded prompts (encode_prompts)
    b = generate_rollouts(model, bos_tokenizer, prompts, 2, max_new_tokens=2, decode_loop="generate")
    chat_text = bos_tokenizer.apply_chat_template(prompts[1], tokenize=False, add_generation_prompt=True)
    expected = [bos_tokenizer("hi")["input_ids"]] * 2 + [bos_tokenizer(chat_text, add_special_tokens=False)
                                                         ["input_ids"]] * 2
    if template == "no_bos":
        expected[2:] = [[BOS] + expected[2]] * 2
    for row in _rows(b.prompt_ids, b.prompt_mask):
        assert row[0] == BOS and row[1] != BOS
    assert _rows(b.prompt_ids, b.prompt_mask) == expected
    assert _rows(*seen[0]) == expected  # what generate was fed
    # the log-prob path scores the responses after exactly these prompt ids: same as a manual pass
    lp, _ = forward_log_probs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, share_prefix=False)
    row = expected[0] + b.response_ids[0].tolist()
    logits = model(torch.tensor([row])).logits[0, len(expected[0]) - 1:-1].float().log_softmax(-1)
    ref = logits.gather(-1, b.response_ids[0].unsqueeze(-1)).squeeze(-1)
    m = b.response_mask[0].bool()
    torch.testing.assert_close(lp[0][m], ref[m], atol=1e-5, rtol=0)
    # echotrain eval goes through the same encoder
    seen.clear()
    evaluate(model, bos_tokenizer, digit_task, num_prompts=2, n=1, max_new_tokens=2, temperature=0,
             decode_loop="generate")
    for row in _rows(*seen[0]):
        assert row[0] == BOS and row[1] != BOS
