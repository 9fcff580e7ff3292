"""reuse_on_policy_log_probs: the first update's old log-probs from its own forward (issue 14 item 2).

The same run with the separate no-grad pass and with the reuse must give the same metrics and the
same weights: bit-identical with one mini-batch (same micro-batches in both), and to float
tolerance with several (the later mini-batches' pass then runs over other row chunks)."""

from __future__ import annotations

import pytest
import torch

from echotrain.train.config import resolve_config
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES
from echotrain.train.trainer import Trainer

BASE = dict(steps=2, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=4, lr=1e-2,
            temperature=1.0, device="cpu", progress=False, plots=False, save_final_model=False, seed=0,
            eval_prompts=0, save_every=0)


def _run(tmp_path, tok, make_model, task, name, **over):
    cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / name), **over})
    trainer = Trainer(cfg, model=make_model(tok), tokenizer=tok, task=task)
    calls = []
    real = trainer._log_probs_batched
    trainer._log_probs_batched = lambda model, batch, **kw: calls.append(len(batch)) or real(model, batch, **kw)
    records = trainer.train()
    strip = [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in records]
    return strip, [p.detach().clone() for p in trainer.model.parameters()], calls


@pytest.mark.parametrize("preset", ["echo", "grpo", "gspo", "dapo+balanced"])
def test_one_mini_batch_is_bit_identical_and_skips_the_pass(preset, tmp_path, tiny_tokenizer, make_tiny_model,
                                                               digit_task):
    kw = dict(preset=preset, num_mini_batches=1)
    a, wa, calls_a = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "off", reuse_on_policy_log_probs=False, **kw)
    b, wb, calls_b = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "on", **kw)
    assert a == b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    # without reuse one no-grad policy pass per step; with it none (the reference pass
    # of presets with a KL term, grpo's kl_coef 0.04, stays)
    assert len(calls_a) - len(calls_b) == 2 and set(calls_b) <= set(calls_a)


@pytest.mark.parametrize("extra", [dict(num_mini_batches=2), dict(num_mini_batches=2, ppo_epochs=2, kl_coef=0.05)])
def test_several_mini_batches_match_and_only_the_rest_is_recomputed(extra, tmp_path, tiny_tokenizer,
                                                                    make_tiny_model, digit_task):
    a, wa, calls_a = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "off", reuse_on_policy_log_probs=False,
                          **extra)
    b, wb, calls_b = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "on", **extra)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), k
    for x, y in zip(wa, wb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    # policy pass: all 16 rows without reuse, the 8 rows of the later mini-batch with it
    # (the reference pass for kl_coef > 0 always covers all 16)
    ref = [16] if extra.get("kl_coef") else []
    assert calls_a == ([16] + ref) * 2 and calls_b == ([8] + ref) * 2


def test_sam_keeps_the_separate_pass(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    _, _, calls = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "sam", optimizer="sam",
                       num_mini_batches=1, steps=1)
    assert calls == [16]
