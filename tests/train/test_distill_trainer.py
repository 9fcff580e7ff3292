"""On-policy distillation through the trainer (docs/design/objectives.md §12): exact over
micro-batches, a teacher equal to the student trains nothing, the top-k variant at k = V is the
exact one, the tokenizer check."""

from __future__ import annotations

import functools

import pytest
import torch

from echotrain.errors import ConfigError
from tests.train.conftest import make_model, make_tokenizer

BASE = dict(steps=1, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=8,
            num_mini_batches=1, optimizer="sgd", lr=1.0, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=0, seed=0, eval_prompts=0, max_grad_norm=0.0, weight_decay=0.0)


@pytest.fixture
def run(run_trainer):
    return functools.partial(run_trainer, BASE)


@pytest.fixture
def teacher_dir(tmp_path):
    """Another tiny Llama (seed 1) with the same tokenizer, saved as a model folder."""
    tok = make_tokenizer()
    d = tmp_path / "teacher"
    make_model(tok, seed=1).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


@pytest.mark.parametrize("over", [dict(objective="distill"), dict(objective="distill", distill_beta=0.5),
                                  dict(objective="distill", distill_top_k=5),
                                  dict(preset="grpo", distill_coeff=0.5)],
                         ids=["reverse_kl", "jsd", "top_k", "rl_plus_term"])
def test_micro_batching_is_exact(run, teacher_dir, tiny_tokenizer, make_tiny_model, over):
    """One step with micro-batches of 3 gives the same parameters as one micro-batch of 16: the
    term is aggregated with the step's normalisers (step_agg_loss). SGD at lr 1: the parameter
    change is the gradient itself (Adam would hide a wrong overall scale)."""
    params, recs = [], []
    for mbs in (16, 3):
        trainer, r = run(f"mb{mbs}", micro_batch_size=mbs, teacher=teacher_dir, **over)
        params.append(_params(trainer))
        recs.append(r[0])
    init = dict(make_tiny_model(tiny_tokenizer).named_parameters())
    assert any(not torch.allclose(params[0][k], init[k]) for k in init)  # it did move
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k], atol=2e-6, rtol=1e-5)
    assert recs[0]["distill/kl"] > 0
    assert recs[0]["distill/kl"] == pytest.approx(recs[1]["distill/kl"], rel=1e-5)
    assert recs[0]["time/teacher"] > 0 and recs[0]["memory/teacher_mb"] > 0


def test_teacher_equal_to_student_trains_nothing(run, tmp_path, tiny_tokenizer):
    """KL(s || s) = 0 with zero gradient, and objective=distill has no policy loss: the weights stay."""
    d = tmp_path / "same"
    make_model(tiny_tokenizer, seed=0).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    trainer, recs = run("same", teacher=str(d), objective="distill")
    init = dict(make_model(tiny_tokenizer, seed=0).named_parameters())
    assert recs[0]["distill/kl"] == pytest.approx(0.0, abs=1e-6)
    assert recs[0]["grad_norm"] < 1e-5
    for k, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, init[k], atol=1e-6, rtol=0)


def test_top_k_at_full_vocabulary_is_the_exact_term(run, teacher_dir, tiny_tokenizer):
    exact, _ = run("exact", teacher=teacher_dir, objective="distill")
    top, _ = run("top", teacher=teacher_dir, objective="distill", distill_top_k=len(tiny_tokenizer))
    a, b = _params(exact), _params(top)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=1e-5)


def test_different_tokenizer_is_refused(build_trainer, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *"0123456789abc"])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                    unk_token="<unk>")
    d = tmp_path / "other"
    make_model(other, seed=1).save_pretrained(d)
    other.save_pretrained(d)
    with pytest.raises(ConfigError, match=r"teacher='.*other' has a vocabulary of 17 tokens, model=None of 45: .*same tokenizer"):
        build_trainer(BASE, "bad", teacher=str(d), objective="distill")


@pytest.mark.parametrize("over,msg", [
    (dict(objective="distill"), "objective=distill needs teacher"),
    (dict(distill_coeff=0.1), "distill_coeff=0.1: > 0 needs teacher"),
    (dict(teacher="x"), "teacher='x': is set but unused"),
    (dict(teacher="x", objective="distill", distill_beta=1.5), r"distill_beta=1.5: must be in \[0, 1\]"),
    (dict(teacher="x", objective="distill", distill_top_k=-1), "distill_top_k=-1: must be >= 0"),
    (dict(teacher="x", objective="distill", preset="echo+balanced"), "loss_agg_mode='balanced': .* weigh 0"),
])
def test_bad_settings_are_config_errors(over, msg):
    from echotrain.train.config import resolve_config, validate

    with pytest.raises(ConfigError, match=msg):
        validate(resolve_config(overrides={**BASE, **over}))


def test_same_vocabulary_size_but_other_ids_is_refused():
    """The round trip: a tokenizer with the same size but permuted ids maps the probe elsewhere."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from echotrain.train.distill import check_same_tokenizer

    ours = make_tokenizer()
    vocab = dict(ours.get_vocab())
    a, b = vocab["1"], vocab["2"]
    vocab["1"], vocab["2"] = b, a
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    swapped = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>")
    model = make_model(ours)
    check_same_tokenizer((model, ours), (model, make_tokenizer()), "a", "b")  # the same: passes
    with pytest.raises(ConfigError, match="teacher='b' and model='a' tokenize .* differently"):
        check_same_tokenizer((model, ours), (model, swapped), "a", "b")


def test_packed_full_log_softmax_equals_the_plain_forward(tiny_tokenizer):
    """response_log_softmax's packed layout (what distillation's student and teacher passes use) gives
    the plain forward's (N, T, V) log-softmax, with the gradient too, and is the gathered log-probs."""
    from echotrain.runtime.packing import supports_packed_forward
    from echotrain.runtime.rollout import forward_log_probs, response_log_softmax
    from tests.train.conftest import prefix_batch

    model = make_model(tiny_tokenizer)
    assert supports_packed_forward(model)
    p_ids, p_mask, r_ids, r_mask = prefix_batch(len(tiny_tokenizer))
    outs, grads = [], []
    for pack in (True, False):
        model.zero_grad()
        out = response_log_softmax(model, p_ids, p_mask, r_ids, r_mask, temperature=0.7, pack=pack)
        (out * r_mask.unsqueeze(-1)).exp().sum().backward()
        outs.append(out.detach() * r_mask.unsqueeze(-1))
        grads.append(model.model.embed_tokens.weight.grad.clone())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    lp, _ = forward_log_probs(model, p_ids, p_mask, r_ids, r_mask, temperature=0.7)
    gathered = torch.gather(outs[0], -1, r_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(gathered * r_mask, lp.detach() * r_mask, atol=2e-6, rtol=1e-5)


def test_gradient_checkpointing_covers_the_students_distillation_forward(run, teacher_dir, monkeypatch):
    """Under gradient_checkpointing the student's full-distribution forward (distillation's update pass) is
    recomputed in the backward like the update's own forward: each attention module of the policy runs twice
    per micro-batch instead of once (on the code before, once); the update is the same."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    calls = {"n": 0}
    forward = LlamaAttention.forward  # (not a checkpointed layer itself: patching it leaves the wrapper alone)

    def counted(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.q_proj.weight.requires_grad:
            calls["n"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", counted)
    counts, params = {}, {}
    for gc in (False, True):
        calls["n"] = 0
        trainer, _ = run(f"gc{gc}", teacher=teacher_dir, objective="distill", gradient_checkpointing=gc)
        counts[gc], params[gc] = calls["n"], _params(trainer)
    layers, micro_batches = len(trainer.model.model.layers), 2  # 16 rows in micro-batches of 8
    assert counts[False] == layers * micro_batches and counts[True] == 2 * counts[False]  # the forward, then the recompute
    for k in params[False]:
        torch.testing.assert_close(params[True][k], params[False][k], atol=2e-6, rtol=1e-5)
