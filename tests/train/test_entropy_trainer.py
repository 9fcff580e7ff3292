"""The entropy terms in the trainer and the CLI: exact over micro-batches, the adaptive
coefficient's trajectory and its resume, the high-entropy token selection."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from echotrain.cli import main
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=1, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=4,
            num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=0, seed=0, eval_prompts=0, save_every=0)


@pytest.fixture
def run(run_trainer):
    return functools.partial(run_trainer, BASE)


@pytest.mark.parametrize("term", [{"entropy_coeff": 0.3, "loss_agg_mode": "seq-mean-token-mean"},
                                  {"entropy_coef": 0.3, "preset": "echo+balanced"}])
def test_entropy_term_is_exact_over_micro_batches_and_moves_the_update(run, term):
    params = {}
    for name, over in (("mb8", dict(micro_batch_size=8, **term)), ("mb3", dict(micro_batch_size=3, **term)),
                       ("none", dict(micro_batch_size=8))):
        trainer, recs = run(name, num_mini_batches=1, max_grad_norm=0.0, lr=1e-3, **over)
        params[name] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        if name != "none":
            assert recs[0]["entropy/coef"] == 0.3 and recs[0]["entropy/current"] > 0
    for k in params["mb8"]:
        torch.testing.assert_close(params["mb8"][k], params["mb3"][k], atol=5e-6, rtol=1e-5)
    assert any(not torch.allclose(params["mb8"][k], params["none"][k]) for k in params["mb8"])


def test_adaptive_coefficient_follows_skywork_rule_and_resumes_exactly(run, tmp_path):
    # target above any entropy: every step is "below target", so the coefficient climbs by delta; the
    # first optimizer step applies 0 (no entropy measured yet), each later one the climbed value
    over = dict(steps=3, use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.05, entropy_target=100.0,
                save_every=1, keep_last=3)
    _, full = run("full", **over)
    assert [r["entropy/coef"] for r in full] == pytest.approx([0.15, 0.25, 0.35])
    with pytest.raises(Killed):
        run("killed", callbacks=[kill_at(3)], **over)
    trainer, resumed = run("killed", resume=True, **over)
    assert trainer.start_step == 2 and trainer.entropy_state["coef"] == pytest.approx(0.4)  # 0.1 + 6 updates x 0.05

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}

    assert [strip(r) for r in resumed] == [strip(r) for r in full]


def test_adaptive_coefficient_falls_and_gates_above_target(run):
    _, recs = run("above", steps=2, use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.04,
                  entropy_target=0.0)
    # entropy > 0 = target after every step: the coefficient falls (0.1 -> 0.06 -> 0.02 -> 0 -> 0) and none applies
    assert [r["entropy/coef"] for r in recs] == [0.0, 0.0]


def test_top_entropy_quantile_trains_on_the_high_entropy_tokens_only(build_trainer):
    trainer = build_trainer(BASE, top_entropy_quantile=0.25)
    seen = []
    rollouts_for = trainer.rollouts.rollouts_for
    trainer.rollouts.rollouts_for = lambda step: seen.append(rollouts_for(step)) or seen[-1]
    trainer.train()
    (d,) = seen
    valid = d.batch.response_mask.bool()
    kept = d.response_mask.bool()
    assert (kept & ~valid).sum() == 0 and 0 < kept.sum() < valid.sum()
    threshold = torch.quantile(d.entropy[valid].float(), 0.75)
    assert torch.equal(kept, valid & (d.entropy >= threshold))
    assert not trainer.reuses_first_forward()  # the mask needs every row's old entropy first


@pytest.mark.parametrize("term,how", [({"entropy_coeff": 0.3}, "seq-mean-token-mean"), ({"entropy_coef": 0.3}, "token-mean")])
def test_entropy_term_adds_minus_coef_times_the_aggregated_entropy_gradient(build_trainer, make_tiny_model,
                                                                           tiny_tokenizer, term, how):
    """Closed form: with SGD, params(with the term) - params(without) = lr * coef * grad H_agg at the
    initial weights, H_agg verl's agg_loss(entropy, mask, loss_agg_mode) for ``entropy_coeff``
    and the token mean for TRL's ``entropy_coef`` (docs/design/objectives.md §11)."""
    from echotrain.rl import agg_loss
    from echotrain.train.update import policy_log_probs

    over = dict(optimizer="sgd", lr=0.5, max_grad_norm=0.0, num_mini_batches=1, micro_batch_size=16,
                loss_agg_mode="seq-mean-token-mean", weight_decay=0.0)
    runs = {}
    for name, extra in (("none", {}), ("ent", term)):
        trainer = build_trainer(BASE, name=name, model=make_tiny_model(tiny_tokenizer), **over, **extra)
        seen = []
        rollouts_for = trainer.rollouts.rollouts_for
        trainer.rollouts.rollouts_for = lambda step, f=rollouts_for, s=seen: s.append(f(step)) or s[-1]
        (rec,) = trainer.train()
        runs[name] = (trainer, seen[0], rec)
    (t_none, d_none, _), (t_ent, d, rec) = runs["none"], runs["ent"]
    assert torch.equal(d.batch.response_ids, d_none.batch.response_ids)  # the same rollouts
    model = make_tiny_model(tiny_tokenizer)  # the initial weights
    _, ent = policy_log_probs(model, d.batch, t_ent.cfg, with_entropy=True, grad=True)
    mask = d.response_mask.to(ent.dtype)
    h = agg_loss(ent, mask, how) if how != "token-mean" else (ent * mask).sum() / mask.sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(h, params, allow_unused=True)
    moved = False
    for (n, p_ent), p_none, g in zip(t_ent.model.named_parameters(), t_none.model.parameters(), grads):
        expected = rec["lr"] * 0.3 * (g if g is not None else torch.zeros_like(p_ent))
        torch.testing.assert_close(p_ent.detach() - p_none.detach(), expected, atol=1e-6, rtol=1e-3, msg=n)
        moved = moved or bool(expected.abs().max() > 1e-4)
    assert moved


def test_first_adaptive_step_applies_zero_and_no_term_means_no_entropy_keys(run):
    """TRL: the first optimizer step has no measured entropy, so it applies coefficient 0 (then
    the coefficient climbs by delta); a run without any entropy setting has no entropy term at all."""
    trainer, (rec,) = run("first", num_mini_batches=1, use_adaptive_entropy=True, entropy_coef=0.1,
                          entropy_coef_delta=0.05, entropy_target=100.0)
    assert rec["entropy/coef"] == 0.0 and trainer.entropy_state["coef"] == pytest.approx(0.15)
    trainer, (rec,) = run("plain", num_mini_batches=1)
    assert trainer.entropy_coef_now() is None
    assert not any(k.startswith("entropy/") for k in rec)


_TINY = ["model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=0", "num_threads=1", "save_every=0",
         "save_final_model=false", "plots=false", "progress=false", "log_samples=0"]


@pytest.mark.usefixtures("real_testbed")
@pytest.mark.parametrize("keys", [["entropy_coeff=0.01"], ["use_adaptive_entropy=true", "entropy_target=5"],
                                  ["top_entropy_quantile=0.2", "entropy_coef=0.01"]])
def test_entropy_keys_from_the_cli(keys, tmp_path):
    assert main(["train", *_TINY, *keys, f"output_dir={tmp_path}"]) == 0
    (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "entropy/current" in rec and "entropy/coef" in rec


@pytest.mark.parametrize("bad", [["entropy_coeff=0.1", "entropy_coef=0.1"], ["top_entropy_quantile=1.5"],
                                 ["entropy_coef_min=0.5", "entropy_coef_max=0.1"]])
def test_bad_entropy_settings_exit_2_naming_the_key(bad, capsys):
    assert main(["train", *_TINY, *bad, "--print-config"]) == 2
    assert bad[0].split("=")[0] in capsys.readouterr().err
