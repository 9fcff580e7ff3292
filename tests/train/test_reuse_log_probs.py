"""reuse_on_policy_log_probs: the first update's old log-probs from its own forward (issue 14 item 2);
reuse_sampler_log_probs: the later mini-batches' from the sampler's own log-probs (issue 21);
log_prob_prepass: ECHO's pre-pass from the with-grad forwards, graphs kept (issue 21).

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
    b, wb, calls_b = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "on", reuse_sampler_log_probs=False,
                          **extra)
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


def _mismatch_free(records):
    """The records without the train/inference mismatch metrics (measured on other rows by design)."""
    return [{k: v for k, v in r.items() if not k.startswith("rollout_corr/")} for r in records]


@pytest.mark.parametrize("extra", [dict(num_mini_batches=2), dict(num_mini_batches=4, ppo_epochs=2, kl_coef=0.05)])
def test_sampler_log_probs_replace_the_pass_in_float32(extra, tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """Synchronous float32: the later mini-batches' old log-probs are the sampler's, no no-grad
    policy pass runs at all, and the run equals the one that recomputes them to float rounding."""
    a, wa, calls_a = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "pass", reuse_sampler_log_probs=False,
                          **extra)
    b, wb, calls_b = _run(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "sampler", **extra)
    assert len(calls_a) > len(calls_b)  # the runs differ in the pass, not only in name
    for ra, rb in zip(_mismatch_free(a), _mismatch_free(b), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), k
    # (Adam at lr 1e-2 over 16 updates turns log-prob rounding of ~1e-7 into weight moves of ~1e-6)
    for x, y in zip(wa, wb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    ref = [16] if extra.get("kl_coef") else []
    rest = 16 - 16 // extra["num_mini_batches"]
    assert calls_a == ([rest] + ref) * 2 and calls_b == ref * 2
    # the mismatch is still measured, on the first mini-batch's rows (their own forward): float
    # rounding between the cached decode and the update's forward, not exactly 0
    for r in b:
        assert 0 < r["rollout_corr/log_prob_abs_diff"] < 1e-4


def test_mismatch_metrics_cover_exactly_the_first_mini_batch_rows(tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """With the sampler's numbers reused, every rollout_corr/* value of the step is the one of the
    first mini-batch's rows alone (the others would add zeros and dilute it)."""
    from echotrain.rl.correction import rollout_mismatch_metrics

    cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / "m"), "num_mini_batches": 2, "steps": 1})
    trainer = Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task)
    assert trainer.sampler_is_learner and trainer.reuses_first_forward()
    seen = []
    real = trainer.update_mini_batch
    trainer.update_mini_batch = lambda data, rows, **kw: seen.append((data, rows)) or real(data, rows, **kw)
    (record,) = trainer.train()
    data, first = seen[0]
    mask = torch.zeros_like(data.response_mask)
    mask[first] = data.response_mask[first]
    want = rollout_mismatch_metrics(data.old_log_prob, data.rollout_log_prob, mask, trainer.loss_config.log_ratio_clamp)
    for k, v in want.items():
        assert record[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # and the rows after the first mini-batch hold the sampler's numbers exactly
    rest = torch.ones(len(data.batch), dtype=torch.bool)
    rest[first] = False
    assert torch.equal(data.old_log_prob[rest], data.rollout_log_prob[rest])


@pytest.mark.parametrize("over", [dict(staleness=1), dict(autocast="bfloat16"), dict(dtype="bfloat16"),
                                  dict(rollout_correction="token_is")])
def test_sampler_log_probs_not_used_where_they_differ(over, tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """Older weights (staleness), bfloat16 arithmetic, or a rollout correction (which measures
    pi_old / mu): the no-grad pass runs over the later mini-batches' rows (all rows with a
    correction, which turns the first-rows reuse off too)."""
    cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / "x"), "num_mini_batches": 2, "steps": 1, **over})
    model = make_tiny_model(tiny_tokenizer)
    if over.get("dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    trainer = Trainer(cfg, model=model, tokenizer=tiny_tokenizer, task=digit_task)
    assert not trainer.sampler_is_learner
    calls = []
    real = trainer._log_probs_batched
    trainer._log_probs_batched = lambda model, batch, **kw: calls.append(len(batch)) or real(model, batch, **kw)
    trainer.train()
    assert calls == ([16] if "rollout_correction" in over else [8])


def _count_passes(trainer):
    """Wrap ``trainer._log_probs``: the (rows, grad) of every policy forward, in order."""
    passes = []
    real = trainer._log_probs
    trainer._log_probs = lambda model, batch, **kw: passes.append((len(batch), kw.get("grad", False))) or \
        real(model, batch, **kw)
    return passes


@pytest.mark.parametrize("extra", [dict(num_mini_batches=2), dict(num_mini_batches=2, ppo_epochs=2, kl_coef=0.05),
                                   dict(num_mini_batches=2, optimizer="sam")])
def test_retained_prepass_equals_the_no_grad_prepass(extra, tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    """ECHO's pre-pass from the with-grad forwards (graphs kept) gives the run of the separate
    no-grad pre-pass, bit for bit, with one forward of each off-policy micro-batch less (SAM's
    second pass at w + e runs its own forwards)."""
    runs = {}
    for mode in ("forward", "retain"):
        cfg = resolve_config(overrides={**BASE, "output_dir": str(tmp_path / mode), "preset": "echo",
                                        "log_prob_prepass": mode, **extra})
        trainer = Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task)
        passes = _count_passes(trainer)
        records = trainer.train()
        strip = [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in records]
        runs[mode] = strip, [p.detach().clone() for p in trainer.model.parameters()], passes
    (a, wa, pa), (b, wb, pb) = runs["forward"], runs["retain"]
    assert a == b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    grad_a, grad_b = sum(n for n, g in pa if g), sum(n for n, g in pb if g)
    nograd_a, nograd_b = sum(n for n, g in pa if not g), sum(n for n, g in pb if not g)
    assert grad_a == grad_b > 0
    # off-policy mini-batches a step: 1 (2 mini-batches) or 3 (2 epochs); 8 rows each, 2 steps
    off = 2 * (3 if extra.get("ppo_epochs") == 2 else 1) * 8
    assert nograd_a - nograd_b == off


@pytest.mark.parametrize("over, expected", [({}, True), (dict(staleness=1), False), (dict(async_rollouts=True), False),
                                            (dict(reuse_sampler_log_probs=False), False),
                                            (dict(rollout_correction="token_is", recompute_old_log_prob=True), False)])
def test_sampler_is_learner_conditions(over, expected):
    """The pure condition, setting by setting (async_rollouts runs a worker process: checked here
    rather than through a run), and by precision."""
    from echotrain.train.update import sampler_is_learner

    cfg = resolve_config(overrides={**BASE, "output_dir": "unused", **over})
    assert sampler_is_learner(cfg, None, torch.float32) is expected
    assert not sampler_is_learner(cfg, torch.bfloat16, torch.float32)
    assert not sampler_is_learner(cfg, None, torch.bfloat16)


def test_prepass_setting():
    from echotrain.train.update import retains_prepass_graph

    assert retains_prepass_graph("retain") and not retains_prepass_graph("forward")
    with pytest.raises(ValueError, match="log_prob_prepass"):
        retains_prepass_graph("sometimes")
