"""Fixtures: a tiny randomly initialised Llama, a char-level tokenizer and a trivial task, built in-process
(no downloads), for trainer tests."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tokenizer():
    """Char-level PreTrainedTokenizerFast: digits, lowercase letters, ':', ' ', '<', '>', '/'
    plus the special tokens <pad> (0), <s> (1), </s> (2, EOS)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list(string.digits + string.ascii_lowercase + ": <>/")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def make_model(tokenizer, seed: int = 0, hidden_size: int = 32, intermediate_size: int = 64,
               max_position_embeddings: int = 256):
    """2-layer Llama, hidden 32 (MLP 64) unless given, random init with ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


class Killed(Exception):
    """Raised by a :func:`kill_at` callback: a run stopped as by a SIGKILL."""


def kill_at(step: int, before: Any = None):
    """A trainer callback that raises :class:`Killed` at ``step``, after that step's metrics line
    and before its checkpoint (calling ``before()`` first when given)."""

    def callback(at: int, record: dict) -> None:
        if at == step:
            if before is not None:
                before()
            raise Killed

    return callback


def prefix_batch(vocab: int, seed: int = 0, shared_len: int = 6):
    """3 prompts sharing ``shared_len`` tokens (rests of 2, 4, 1), 6 rows (groups interleaved),
    responses of 1-6 tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (shared_len,), generator=g)
    prompts = [torch.cat([shared, torch.randint(3, vocab, (n,), generator=g)]) for n in (2, 4, 1)]
    which, lens = [2, 0, 1, 0, 2, 1], [3, 5, 1, 2, 6, 4]
    P, T = shared_len + 5, 7
    p_ids = torch.zeros(6, P, dtype=torch.long)
    p_mask = torch.zeros(6, P, dtype=torch.long)
    r_ids = torch.zeros(6, T, dtype=torch.long)
    r_mask = torch.zeros(6, T)
    for i, (w, n) in enumerate(zip(which, lens)):
        p_ids[i, P - len(prompts[w]):], p_mask[i, P - len(prompts[w]):] = prompts[w], 1
        r_ids[i, :n], r_mask[i, :n] = torch.randint(3, vocab, (n,), generator=g), 1
    return p_ids, p_mask, r_ids, r_mask


@dataclass
class Ex:
    messages: list
    question: str
    answer: str
    index: int
    metadata: dict = field(default_factory=dict)


class DigitTask:
    """Question: a digit d. Reward 1 if the completion contains d (a random tiny model does that
    with probability ~0.3 per 8 tokens, so groups have reward variance)."""

    name = "digit"
    answer_format = "tag"

    def __init__(self, size: int = 50):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Ex:
        d = str(i % 10)
        return Ex(messages=[{"role": "user", "content": f"say {d}"}], question=d, answer=d, index=i)

    def __iter__(self):
        return (self[i] for i in range(self.size))

    def sample(self, n: int, seed: int) -> list[Ex]:
        rng = random.Random(seed)
        return [self[rng.randrange(self.size)] for _ in range(n)]

    def extract(self, completion: str) -> str | None:
        return completion

    def is_formatted(self, completion: str) -> bool:
        return len(completion) > 0

    def score(self, completion: str, example: Any) -> float:
        return 1.0 if example.answer in completion else 0.0


@pytest.fixture
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return make_model(tiny_tokenizer)


@pytest.fixture
def digit_task():
    return DigitTask()


@pytest.fixture
def make_tiny_model():
    """The factory ``make_model(tokenizer, seed=0)`` (a fresh model per call)."""
    return make_model


@pytest.fixture
def build_trainer(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """build_trainer(base, name="run", model=None, resume=False, callbacks=(), **config overrides) -> a
    Trainer of config ``{**base, **overrides}`` on the tiny Llama (a fresh one unless ``model``) and the
    digit task, writing to ``tmp_path / name``."""
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import Trainer

    def _build(base, name="run", model=None, resume=False, callbacks=(), **over):
        cfg = resolve_config(overrides={**base, "output_dir": str(tmp_path / name), **over})
        model = make_tiny_model(tiny_tokenizer) if model is None else model
        return Trainer(cfg, model=model, tokenizer=tiny_tokenizer, task=digit_task, resume=resume,
                       callbacks=callbacks)

    return _build


@pytest.fixture
def run_trainer(build_trainer):
    """run_trainer(base, name="run", **as build_trainer) -> (trainer, trainer.train())."""

    def _run(base, name="run", **kw):
        trainer = build_trainer(base, name, **kw)
        return trainer, trainer.train()

    return _run
