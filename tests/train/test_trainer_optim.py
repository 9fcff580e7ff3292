"""Trainer x optimizers and the KL term: SAM / late-phase SAM wired by config, AdamW4bit, and the
KL penalty aggregated with the step's normalisers (all on the tiny Llama of conftest.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from echotrain.optim import LateSAM
from echotrain.train.config import ConfigError, resolve_config
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from echotrain.train.trainer import Trainer
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=8,
            num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=0, seed=0, eval_prompts=0, save_every=0)


@pytest.fixture
def make_trainer(build_trainer):
    """make_trainer(name, model=None, resume=False, callbacks=(), **config overrides) -> Trainer."""
    return functools.partial(build_trainer, BASE)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}


# ---------------------------------------------------------------------------- KL term
def _kl_run(make_trainer, make_tiny_model, tiny_tokenizer, name, **over):
    """One step, one optimizer update, SGD; the reference policy is another random model, so the
    KL term and its gradient are large from the first update (with ref = policy both are 0)."""
    ref = make_tiny_model(tiny_tokenizer, seed=1).eval()  # built before the trainer seeds the run
    for p in ref.parameters():
        p.requires_grad_(False)
    trainer = make_trainer(name, preset="grpo+balanced", steps=1, num_mini_batches=1, optimizer="sgd", lr=1.0,
                           max_grad_norm=0.0, **over)  # plain SGD, lr 1: the weight change is the gradient
    trainer.ref_model = ref
    return trainer, trainer.train()


@pytest.mark.parametrize("ba_scope", ["batch", "group"])
def test_kl_term_balanced_micro_batching_is_exact(make_trainer, make_tiny_model, tiny_tokenizer, ba_scope):
    """loss_agg_mode=balanced + kl_coef > 0 (ba_scope=batch used to raise): micro-batches of 5 give
    the parameters of one micro-batch of 16, and the KL term moves them."""
    runs = {}
    for mbs, kl in ((16, 1.0), (5, 1.0), (16, 0.5)):
        trainer, recs = _kl_run(make_trainer, make_tiny_model, tiny_tokenizer, f"kl{ba_scope}{mbs}-{kl}",
                                ba_scope=ba_scope, micro_batch_size=mbs, kl_coef=kl)
        assert trainer.cfg.loss_agg_mode == "balanced" and recs[0]["kl/ref"] > 1e-3
        runs[mbs, kl] = params_of(trainer)
    for k in runs[16, 1.0]:
        torch.testing.assert_close(runs[5, 1.0][k], runs[16, 1.0][k], atol=1e-6, rtol=1e-5)
    # the KL term's share of the gradient is far above the tolerance (measured ~8e-3 for beta 1 -> 0.5)
    assert max((runs[16, 1.0][k] - runs[16, 0.5][k]).abs().max() for k in runs[16, 1.0]) > 1e-3


def test_kl_metric_ignores_non_finite_padding(make_trainer, monkeypatch):
    """NaN reference log-probs at padded positions leave kl/ref, the loss and the weights finite."""
    trainer = make_trainer("nanpad", preset="grpo", steps=2, kl_coef=0.1, micro_batch_size=3)
    real = trainer._log_probs_batched
    padded = []

    def nan_at_padding(model, batch, with_entropy=False):
        lp, ent = real(model, batch, with_entropy)
        if model is trainer.ref_model:
            valid = batch.response_mask.bool()
            padded.append(bool((~valid).any()))
            lp = torch.where(valid, lp, float("nan"))
        return lp, ent

    monkeypatch.setattr(trainer, "_log_probs_batched", nan_at_padding)
    recs = trainer.train()
    assert any(padded)  # some responses ended before max_new_tokens
    assert all(math.isfinite(r["kl/ref"]) and r["kl/ref"] >= 0 for r in recs) and recs[-1]["kl/ref"] > 0
    assert all(math.isfinite(r["grad_norm"]) for r in recs)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ---------------------------------------------------------------------------- SAM / late SAM
def _count_passes(trainer: Trainer, monkeypatch) -> list[int]:
    """Per optimizer update, the number of with-grad forward passes (one per closure call when a
    mini-batch is one micro-batch)."""
    counts: list[int] = []
    log_probs, update = trainer._log_probs, trainer.update_mini_batch

    def counting_log_probs(model, batch, with_entropy=False, grad=False):
        if grad:
            counts[-1] += 1
        return log_probs(model, batch, with_entropy=with_entropy, grad=grad)

    def counting_update(*args, **kwargs):
        counts.append(0)
        return update(*args, **kwargs)

    monkeypatch.setattr(trainer, "_log_probs", counting_log_probs)
    monkeypatch.setattr(trainer, "update_mini_batch", counting_update)
    return counts


def test_late_sam_switches_from_one_to_two_passes(make_trainer, monkeypatch):
    # 3 steps x 2 mini-batches = 6 updates; sam_start 0.5 -> SAM from update 3 (0-based)
    trainer = make_trainer("late", optimizer="late_sam", sam_start=0.5, sam_rho=0.05)
    assert isinstance(trainer.optimizer, LateSAM) and trainer.optimizer.sam_start_step == 3
    counts = _count_passes(trainer, monkeypatch)
    recs = trainer.train()
    assert counts == [1, 1, 1, 2, 2, 2]
    assert [r["sam/active"] for r in recs] == [0.0, 0.5, 1.0]
    assert trainer.optimizer.steps_taken == 6 and trainer.optimizer.momentum_restarted
    for r in recs:
        for k, v in r.items():
            assert not isinstance(v, float) or math.isfinite(v), k
        assert r["grad_norm"] > 0 and r["optimizer_steps"] == 2


def test_sam_from_the_start_uses_two_passes(make_trainer, monkeypatch):
    trainer = make_trainer("sam", optimizer="sam", steps=1, sam_base="sgd")
    assert type(trainer.optimizer.base_optimizer).__name__ == "SGD"
    counts = _count_passes(trainer, monkeypatch)
    recs = trainer.train()
    assert counts == [2, 2] and recs[0]["sam/active"] == 1.0 and math.isfinite(recs[0]["grad_norm"])


def test_late_sam_that_never_switches_is_the_base_optimizer(make_trainer):
    """sam_start=1: every update is the base AdamW's; the run equals optimizer=adamw exactly.
    (Both compute every old log-prob with the no-grad pass: SAM turns the reuse of the first
    mini-batch's forward off, and with it the sampler's numbers for the rest. The AdamW run is
    told so: a reused forward packs the mini-batch's groups together, the no-grad pass the rows in
    order, and prompts packed with other prompts round differently, ~1e-8.)"""
    a = make_trainer("adamw", steps=2, reuse_sampler_log_probs=False, reuse_on_policy_log_probs=False)
    ra = a.train()
    b = make_trainer("never", steps=2, optimizer="late_sam", sam_start=1.0)
    rb = b.train()
    assert [r["sam/active"] for r in rb] == [0.0, 0.0]
    assert [strip(r) for r in ra] == [{k: v for k, v in strip(r).items() if k != "sam/active"} for r in rb]
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_late_sam_resume_across_the_switch_is_exact(make_trainer, tmp_path):
    """4 steps x 2 updates, SAM from update 3 (in step 2). Killed at step 2 (resumes before the
    switch) and again at step 3 (resumes after it: the momentum restart must not repeat)."""
    over = dict(steps=4, optimizer="late_sam", sam_start=0.375, save_every=1, keep_last=4)
    full = make_trainer("full", **over).train()

    with pytest.raises(Killed):
        make_trainer("killed", callbacks=[kill_at(2)], **over).train()
    t = make_trainer("killed", resume=True, callbacks=[kill_at(3)], **over)
    assert t.start_step == 1 and t.optimizer.steps_taken == 2 and not t.optimizer.momentum_restarted
    with pytest.raises(Killed):
        t.train()
    t = make_trainer("killed", resume=True, **over)
    assert t.start_step == 2 and t.optimizer.steps_taken == 4 and t.optimizer.momentum_restarted
    resumed = t.train()
    assert [strip(r) for r in resumed] == [strip(r) for r in full]
    assert [r["sam/active"] for r in full] == [0.0, 0.5, 1.0, 1.0]
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_00000004.pt", weights_only=False)
    b = torch.load(tmp_path / "killed" / "checkpoints" / "step_00000004.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"]["late_sam"] == b["optimizer"]["late_sam"] == {
        "steps_taken": 8, "sam_start_step": 3, "momentum_restarted": True}


@pytest.mark.parametrize("over, key", [
    (dict(optimizer="late_sam", sam_base="late_sam"), "sam_base"),
    (dict(optimizer="sam", sam_base="nadam"), "sam_base"),
    (dict(optimizer="late_sam", sam_start=1.5), "sam_start"),
    (dict(optimizer="sam", sam_rho=-0.1), "sam_rho"),
])
def test_sam_config_is_validated(tmp_path, over, key):
    with pytest.raises(ConfigError, match=key):
        resolve_config(overrides={**BASE, "output_dir": str(tmp_path), **over})


# ---------------------------------------------------------------------------- AdamW4bit
def test_adamw4bit_trains_the_tiny_model(make_trainer, make_tiny_model, tiny_tokenizer):
    """optimizer=adamw4bit (eager: tests/conftest.py sets ECHOTRAIN_OPTIM_COMPILE=0). A wider model
    than the default tiny one, so that the MLP matrices (128 x 64 >= min_quantize_numel) get 4-bit
    states. Its first update is AdamW's (both moments are exact before they are first stored)."""
    runs = {}
    for opt in ("adamw4bit", "adamw"):
        model = make_tiny_model(tiny_tokenizer, hidden_size=64, intermediate_size=128)
        trainer = make_trainer(opt, model=model, optimizer=opt, steps=2, num_mini_batches=1, micro_batch_size=16)
        trainer.train()
        runs[opt] = trainer
    records = read_jsonl(runs["adamw4bit"].run_dir / "metrics.jsonl")
    assert len(records) == 2 and all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    codes = [s for s in runs["adamw4bit"].optimizer.state.values() if "exp_avg_codes" in s]
    assert len(codes) == 6 and all(s["exp_avg_codes"].dtype == torch.uint8 for s in codes)
    p4, p32 = params_of(runs["adamw4bit"]), params_of(runs["adamw"])
    init = dict(make_tiny_model(tiny_tokenizer, hidden_size=64, intermediate_size=128).named_parameters())
    moved = max((p32[k] - init[k]).abs().max() for k in init)
    assert moved > 1e-2  # two updates of lr 1e-2
    assert max((p4[k] - p32[k]).abs().max() for k in init) < 0.5 * moved


def test_adamw_is_fused_by_default_and_the_same_update(make_trainer):
    """adam_fused is on by default and builds torch's fused AdamW; adam_fused=false the
    one-op-at-a-time AdamW; two steps of each from the same start move every tensor and give the
    same weights up to float rounding."""
    from echotrain.train.config.schema import TrainConfig

    assert TrainConfig().adam_fused is True
    runs, init = {}, {}
    for fused in (True, False):
        over = {} if fused else {"adam_fused": False}
        t = make_trainer(f"fused-{fused}", steps=2, lr=1e-3, **over)
        assert bool(t.optimizer.param_groups[0]["fused"]) is fused
        init = params_of(t)
        runs[fused] = (t, t.train())
    pa, pb = params_of(runs[True][0]), params_of(runs[False][0])
    assert all(not torch.equal(pa[k], init[k]) for k in pa)  # every tensor moved
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=1e-5, msg=k)
    for ra, rb in zip(runs[True][1], runs[False][1]):
        assert ra["reward/mean"] == rb["reward/mean"]


@pytest.mark.parametrize("saved,resumed", [(False, True), (True, False)])
def test_resume_takes_adam_fused_from_the_setting(make_trainer, saved, resumed):
    """A run resumed with the other adam_fused than its checkpoint's runs as the setting says
    (torch's load_state_dict would keep the checkpoint's flag) and continues to the same weights
    up to float rounding as the uninterrupted run."""
    over = dict(steps=2, save_every=1, lr=1e-3)
    full = make_trainer("full", adam_fused=saved, **over)
    full.train()

    with pytest.raises(Killed):
        make_trainer("killed", adam_fused=saved, callbacks=[kill_at(2)], **over).train()
    t = make_trainer("killed", resume=True, adam_fused=resumed, **over)
    assert t.start_step == 1
    assert bool(t.optimizer.param_groups[0]["fused"]) is resumed
    assert all(st["step"].dtype == torch.float32 for st in t.optimizer.state.values())
    t.train()
    pa, pb = params_of(full), params_of(t)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], atol=1e-6, rtol=1e-5, msg=k)
