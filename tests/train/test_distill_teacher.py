"""The distillation teacher's parts (train/distill.py) on their own: the coefficient and beta the update reads, a
frozen teacher in eval mode, log-softmax at the sampling temperature (student and teacher), the step's time and
memory counters, the vocabulary width and the tokenizer check."""

from __future__ import annotations

import types

import pytest
import torch

from echotrain.errors import ConfigError
from echotrain.train import distill
from echotrain.train.config import resolve_config
from echotrain.train.distill import Teacher, check_same_tokenizer, distill_coeff_now, vocab_size
from tests.train.conftest import make_model, make_tokenizer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    tok = make_tokenizer()
    d = tmp_path_factory.mktemp("teacher") / "t"
    make_model(tok, seed=1).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _teacher(teacher_dir, **over):
    cfg = resolve_config(overrides={"teacher": teacher_dir, "objective": "distill", "device": "cpu", **over})
    tok = make_tokenizer()
    return Teacher(cfg, make_model(tok), tok, torch.device("cpu")), tok


def _batch(tok, rows: int = 1):
    """``rows`` unpadded rows of a 5-id prompt and a 4-id response (what Teacher reads of a RolloutBatch)."""
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(4, len(tok), (rows, 5), generator=g)
    response = torch.randint(4, len(tok), (rows, 4), generator=g)
    return types.SimpleNamespace(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=response,
                                 attended_mask=torch.ones_like(response))


def _by_hand(model, batch, temperature):
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, batch.prompt_ids.shape[1] - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1)


def test_what_the_update_reads(teacher_dir):
    t, _ = _teacher(teacher_dir, distill_beta=0.5, distill_coeff=0.3)
    assert (t.coeff, t.beta, t.objective) == (1.0, 0.5, "distill")  # objective=distill: coefficient 1
    assert not t.model.training and not any(p.requires_grad for p in t.model.parameters())
    cfg = resolve_config(overrides={"teacher": teacher_dir, "distill_coeff": 0.3, "device": "cpu"})
    assert distill_coeff_now(cfg) == 0.3


def test_log_softmax_at_the_sampling_temperature(teacher_dir):
    """The teacher's and the student's distributions are at the temperature the rollouts sampled at."""
    t, tok = _teacher(teacher_dir, temperature=0.7, pack_responses=False)
    batch = _batch(tok)
    torch.testing.assert_close(t.log_softmax(batch), _by_hand(t.model, batch, 0.7))
    student = make_model(tok)
    with torch.no_grad():
        torch.testing.assert_close(t.student_log_softmax(student, batch), _by_hand(student, batch, 0.7))


def test_step_counters_add_the_time_keep_the_largest_output_and_reset(teacher_dir, monkeypatch):
    t, tok = _teacher(teacher_dir)
    clock = iter([0.0, 1.0, 10.0, 12.5])
    monkeypatch.setattr(distill.time, "perf_counter", lambda: next(clock))
    t.log_softmax(_batch(tok, 2))
    t.log_softmax(_batch(tok, 1))
    v = len(tok)
    assert t.step_metrics() == {"time/teacher": 3.5, "memory/teacher_mb": 2 * 4 * v * 4 / 2**20}
    assert t.step_metrics() == {"time/teacher": 0.0, "memory/teacher_mb": 0.0}


def test_vocab_size_prefers_the_models_width():
    tok = make_tokenizer()
    padded = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(tok) + 16))
    assert vocab_size(padded, tok) == len(tok) + 16
    head = torch.nn.Linear(8, 40, bias=False)
    bare = types.SimpleNamespace(config=types.SimpleNamespace(), get_output_embeddings=lambda: head)
    assert vocab_size(bare, tok) == 40
    assert vocab_size(types.SimpleNamespace(), tok) == len(tok)
    with pytest.raises(ConfigError, match=f"vocabulary of {len(tok) + 16} tokens"):
        check_same_tokenizer((types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(tok))), tok),
                             (padded, tok), "student", "teacher")


def test_the_same_ids_decoded_otherwise_are_another_tokenizer():
    tok = make_tokenizer()
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(tok)))

    class Shouting:
        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids):
            return tok.decode(ids).upper()

    check_same_tokenizer((model, tok), (model, tok), "s", "t")
    with pytest.raises(ConfigError, match="tokenize .* differently"):
        check_same_tokenizer((model, tok), (model, Shouting()), "s", "t")
