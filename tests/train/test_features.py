"""CLI features TRL / verl users expect (issue 10, item 6): generic JSONL task, custom reward by
import path, chat template override, reward timeout/exception counts, gradient checkpointing,
samples from several prompts."""

from __future__ import annotations

import json
import time

import pytest
import torch

from echotrain.rewards import RewardFunction
from echotrain.tasks import get_task
from echotrain.train.config import resolve_config
from echotrain.runtime.chat_template import read_chat_template
from echotrain.train.features import spread_sample_rows
from echotrain.train.metrics import read_jsonl
from echotrain.train.trainer import Trainer

BASE = dict(steps=2, prompts_per_step=4, num_generations=2, max_new_tokens=4, micro_batch_size=4, num_mini_batches=1,
            lr=1e-2, device="cpu", progress=False, plots=False, save_final_model=False, eval_prompts=0, seed=0)


def _trainer(tmp_path, name, tok, make_model, task, reward_fn=None, **over):
    cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / name), **over})
    return Trainer(cfg, model=make_model(tok), tokenizer=tok, task=task, reward_fn=reward_fn)


def test_jsonl_task_with_configurable_fields(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": "What is 2+3?", "a": "5", "level": 1}) + "\n\n" + json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    task = get_task("jsonl", path=str(f), prompt_field="q", answer_field="a", answer_format="tag")
    assert len(task) == 2 and task[0].question == "What is 2+3?" and task[0].answer == "5"
    assert task[0].metadata == {"level": 1} and task[0].messages[-1] == {"role": "user", "content": "What is 2+3?"}
    assert task.score("<answer>5</answer>", task[0]) == 1.0 and task.score("<answer>6</answer>", task[0]) == 0.0
    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"prompt": "p", "answer": "\\frac{1}{2}"}) + "\n")
    auto = get_task("jsonl", path=str(g))  # prompt field found by name; boxed answers by default
    assert auto[0].question == "p" and auto.score("\\boxed{0.5}", auto[0]) == 1.0
    with pytest.raises(ValueError, match="needs task_options.path"):
        get_task("jsonl")


def test_custom_reward_both_styles_and_exception_counts(tmp_path, monkeypatch, tiny_tokenizer, make_tiny_model,
                                                        digit_task):
    (tmp_path / "my_rewards.py").write_text(
        "def trl_style(completions, answer, **kwargs):\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n"
        "def per_sample(completion, example):\n"
        "    if example.index % 2:\n"
        "        raise RuntimeError('boom')\n"
        "    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the TRL-style reward equals the digit task's own scorer ("answer in completion"): same run
    ours = _trainer(tmp_path, "trl", tiny_tokenizer, make_tiny_model, digit_task, reward="my_rewards:trl_style",
                    max_new_tokens=8, num_generations=4).train()
    ref = _trainer(tmp_path, "ref", tiny_tokenizer, make_tiny_model, digit_task, max_new_tokens=8, num_generations=4).train()
    assert [r["reward/mean"] for r in ours] == [r["reward/mean"] for r in ref]
    assert any(r["reward/mean"] > 0 for r in ref)
    t = _trainer(tmp_path, "ps", tiny_tokenizer, make_tiny_model, digit_task, reward="my_rewards:per_sample")
    recs = t.train()
    assert sum(r["reward/exceptions"] for r in recs) > 0
    for r in recs:
        assert r["reward/timeouts"] == 0
        n = BASE["prompts_per_step"] * BASE["num_generations"]
        # failing samples score 0, the others 0.5
        assert r["reward/mean"] == pytest.approx(0.5 * (n - r["reward/exceptions"]) / n)
    assert [r["reward/exceptions"] for r in read_jsonl(t.run_dir / "metrics.jsonl")] == [r["reward/exceptions"] for r in recs]


class SlowTask:
    """The digit task, but scoring sleeps 0.3 s on odd indices (a reward that times out)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score(self, completion, example):
        if example.index % 2:
            time.sleep(0.3)
        return 1.0


def test_reward_timeouts_counted_in_metrics(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    task = SlowTask(digit_task)
    t = _trainer(tmp_path, "slow", tiny_tokenizer, make_tiny_model, task, steps=1,
                 reward_fn=RewardFunction(task, timeout_s=0.05))
    (rec,) = t.train()
    examples = digit_task.sample(BASE["prompts_per_step"], (0 * 1_000_003 + 1) % (2**31 - 1))
    odd = sum(ex.index % 2 for ex in examples) * BASE["num_generations"]
    assert rec["reward/timeouts"] == odd and rec["reward/exceptions"] == 0
    assert read_jsonl(t.run_dir / "metrics.jsonl")[0]["reward/timeouts"] == odd


def test_chat_template_override(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    from echotrain.runtime.rollout import render_prompts

    template = "{% for m in messages %}q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} a:{% endif %}"
    t = _trainer(tmp_path, "tpl", tiny_tokenizer, make_tiny_model, digit_task, chat_template=template, steps=1)
    assert render_prompts(t.tokenizer, [[{"role": "user", "content": "say 3"}]]) == ["q:say 3 a:"]
    t.train()
    f = tmp_path / "tpl.jinja"
    f.write_text(template)
    assert read_chat_template(str(f)) == template
    with pytest.raises(ValueError, match="invalid Jinja"):
        read_chat_template("{% for x in %}")


def test_gradient_checkpointing_gives_the_same_update(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    params = []
    for gc in (False, True):
        t = _trainer(tmp_path, f"gc{gc}", tiny_tokenizer, make_tiny_model, digit_task, steps=1, gradient_checkpointing=gc,
                     max_grad_norm=0.0, lr=1e-3, num_generations=4, max_new_tokens=8, micro_batch_size=8)
        assert any(getattr(m, "gradient_checkpointing", False) for m in t.model.modules()) == gc
        t.train()
        assert not t.model.training  # back in eval mode after the checkpointed passes
        params.append({k: v.detach().clone() for k, v in t.model.named_parameters()})
    init = dict(make_tiny_model(tiny_tokenizer).named_parameters())
    assert any(not torch.allclose(params[0][k], init[k]) for k in init)
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k], atol=2e-6, rtol=1e-5)


def test_samples_spread_over_prompts():
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert spread_sample_rows(g, 4) == [0, 3, 6, 1]
    assert spread_sample_rows(g, 0) == [] and spread_sample_rows(g, 20) == [0, 3, 6, 1, 4, 7, 2, 5, 8]


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))


def test_sparse_tied_embedding_grad_only_where_the_gradient_stays_dense():
    from echotrain.train.features import sparse_tied_embedding_grad

    tied, untied, frozen = _tiny_llama(True), _tiny_llama(False), _tiny_llama(True)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert sparse_tied_embedding_grad(tied) and tied.get_input_embeddings().sparse
    assert not sparse_tied_embedding_grad(untied) and not untied.get_input_embeddings().sparse
    assert not sparse_tied_embedding_grad(frozen) and not frozen.get_input_embeddings().sparse
    assert not sparse_tied_embedding_grad(torch.nn.Linear(2, 2))  # no embeddings at all


def test_sparse_tied_embedding_grad_gives_the_dense_gradient():
    """Two accumulated backward passes (micro-batches): the same dense .grad of every parameter,
    up to summation order, with only a few vocabulary rows looked up."""
    from echotrain.train.features import sparse_tied_embedding_grad

    grads = []
    for sparse in (False, True):
        model = _tiny_llama(True)
        if sparse:
            assert sparse_tied_embedding_grad(model)
        for ids in (torch.tensor([[3, 5, 7, 5]]), torch.tensor([[9, 3, 11, 2]])):
            torch.log_softmax(model(input_ids=ids).logits, -1)[0, :, 4].sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    emb = "model.embed_tokens.weight"
    assert grads[1][emb].layout == torch.strided and not grads[1][emb].is_sparse
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-6, atol=1e-7)


def test_trainer_makes_the_tied_embedding_sparse_and_the_run_matches(tmp_path, tiny_tokenizer, make_tiny_model,
                                                                      digit_task):
    runs = {}
    for sparse in (False, True):
        t = _trainer(tmp_path, f"s{sparse}", tiny_tokenizer, make_tiny_model, digit_task, sparse_embedding_grad=sparse,
                     num_mini_batches=2, lr=1e-3)
        assert t.model.get_input_embeddings().sparse == sparse
        records = t.train()
        runs[sparse] = records, {k: v.detach().clone() for k, v in t.model.named_parameters()}
    from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES

    for a, b in zip(runs[False][0], runs[True][0], strict=True):
        keys = [k for k in a if not k.startswith(NONDETERMINISTIC_PREFIXES)]
        assert "grad_norm" in keys and keys == [k for k in b if not k.startswith(NONDETERMINISTIC_PREFIXES)]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for k, v in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], v, rtol=1e-5, atol=1e-6)
