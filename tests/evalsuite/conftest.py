"""Fixtures for the evaluation suite: a printable-ASCII char tokenizer and a scripted LM whose
``generate`` returns given texts in call order, so every score in a test is known in advance."""

from __future__ import annotations

import string
from typing import Any

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_ascii_tokenizer():
    """Char-level tokenizer over printable ASCII (no newline) with <pad> 0, <s> 1, </s> 2 (EOS),
    <unk> 3; decoding joins characters without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


class ScriptedLM(torch.nn.Module):
    """``generate`` answers row r of the k-th call with the next text of ``responses`` (in
    order), cut at ``max_new_tokens``; a response that fits gets an EOS, one that does not is
    truncated. Records the generate kwargs it was called with."""

    def __init__(self, tokenizer: Any, responses: list[str]):
        super().__init__()
        self.tok = tokenizer
        self.responses = list(responses)
        self.used = 0
        self.calls: list[dict[str, Any]] = []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):  # not used by generation here
        raise NotImplementedError

    def generate(self, input_ids, *, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        self.calls.append({"rows": input_ids.shape[0], "max_new_tokens": max_new_tokens, **kwargs})
        outs = []
        for _ in range(input_ids.shape[0]):
            if self.used >= len(self.responses):
                raise AssertionError("ScriptedLM ran out of responses")
            text = self.responses[self.used]
            self.used += 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            ids = ids + [self.tok.eos_token_id] if len(ids) < max_new_tokens else ids[:max_new_tokens]
            outs.append(ids)
        width = max(len(o) for o in outs)
        resp = torch.tensor([o + [pad_token_id] * (width - len(o)) for o in outs], dtype=torch.long)
        return torch.cat([input_ids, resp], dim=1)


@pytest.fixture
def ascii_tokenizer():
    return make_ascii_tokenizer()


@pytest.fixture
def scripted_lm(ascii_tokenizer):
    """Factory: ``scripted_lm(responses) -> ScriptedLM``."""
    return lambda responses: ScriptedLM(ascii_tokenizer, responses)
