"""End-to-end trainer runs on a tiny randomly initialised Llama (built in the test, no downloads)."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import yaml

from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=4,
            num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=2, seed=0, eval_prompts=3)

REQUIRED = ["step", "reward/mean", "reward/std", "accuracy", "format_rate", "response_length/mean",
            "response_length/max", "entropy", "ppo_kl", "pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low",
            "echo/R_batch", "echo/kappa", "grad_norm", "lr", "time/generation", "time/scoring", "time/update",
            "time/step", "throughput/tokens_per_s", "memory/peak_mb"]


@pytest.fixture
def run(run_trainer):
    """run(name, callbacks=(), resume=False, **config overrides) -> (trainer, records)."""
    return functools.partial(run_trainer, BASE)


def test_train_loop_writes_metrics_and_outputs(run, tmp_path, tiny_tokenizer, make_tiny_model):
    trainer, records = run(plots=True, save_every=2, keep_last=1)
    d = trainer.run_dir
    lines = read_jsonl(d / "metrics.jsonl")
    assert lines == records and [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:
        for key in REQUIRED:
            assert key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key]), key
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["format_rate"] <= 1
        assert r["reward/mean"] == pytest.approx(r["accuracy"])  # binary correctness reward
        assert 1 <= r["response_length/mean"] <= r["response_length/max"] <= 8
        assert r["entropy"] > 0 and r["grad_norm"] > 0 and r["lr"] == pytest.approx(1e-2)
        assert r["optimizer_steps"] == 2 and r["groups/kept"] == 4
        assert 0 <= r["pg_clipfrac_low"] <= 1 and r["pg_clipfrac"] == pytest.approx(
            r["pg_clipfrac_high"] + r["pg_clipfrac_low"])
        # the first mini-batch of every step is on-policy: R = 1 exactly, kappa = 1
        assert r["echo/R_batch_max"] == pytest.approx(1.0, abs=1e-6) or r["echo/R_batch_min"] == pytest.approx(1.0, abs=1e-6)
        assert r["time/step"] >= r["time/generation"] > 0 and r["memory/peak_mb"] > 0
    # the second mini-batch of some step is off-policy (lr 1e-2 moves the tiny model)
    assert any(abs(r["echo/R_batch_min"] - 1) > 1e-4 for r in lines)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    assert cfg["loss_mode"] == "echo" and cfg["steps"] == 3
    assert cfg["output_dir"] == str(d)  # the directory actually used, not null
    info = json.loads((d / "run_info.json").read_text())
    assert info["device"] == "cpu" and info["run_dir"] == str(d)
    assert info["torch_num_threads"] >= 1 and info["versions"]["torch"] == torch.__version__
    samples = [json.loads(s) for s in (d / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {"step", "question", "completion", "reward"} <= set(samples[0])
    assert [p.name for p in sorted((d / "checkpoints").iterdir())] == ["step_00000003.pt"]  # keep_last=1
    assert {p.name for p in (d / "plots").glob("*.png")} >= {"reward.png", "echo_batch_ratio.png", "gradient_norm.png", "truncated_responses.png"}
    evals = read_jsonl(d / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3] and all(0 <= e["eval/accuracy"] <= 1 for e in evals)
    assert lines[-1]["eval/accuracy"] == evals[-1]["eval/accuracy"]


@pytest.mark.parametrize("keep_last", [1, 2])  # 1: the default, which keeps one checkpoint on disk
def test_kill_and_resume_gives_identical_metrics(run, tmp_path, tiny_tokenizer, make_tiny_model, keep_last):
    over = dict(steps=4, save_every=2, keep_last=keep_last, preset="echo")
    _, full = run("full", **over)

    with pytest.raises(Killed):  # after step 3's metrics line, before its checkpoint: like a SIGKILL there
        run("killed", callbacks=[kill_at(3)], **over)
    assert [r["step"] for r in read_jsonl(tmp_path / "killed" / "metrics.jsonl")] == [1, 2, 3]
    trainer, resumed = run("killed", resume=True, **over)
    assert trainer.start_step == 2

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}

    assert [strip(r) for r in resumed] == [strip(r) for r in full]
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_00000004.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "killed" / "checkpoints" / "step_00000004.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_checkpoint_fails(run, tmp_path, tiny_tokenizer, make_tiny_model):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run("none", resume=True)


@pytest.mark.parametrize("attention,atol", [("mask", 2e-6), ("blocks", 5e-6)])
@pytest.mark.parametrize("preset", ["echo+balanced", "gspo", "dr_grpo"])
def test_micro_batching_is_exact(run, tmp_path, tiny_tokenizer, make_tiny_model, preset, attention, atol):
    """One step with micro-batches of 3 gives the same parameters as one micro-batch of 8
    (the step's normalisers are global: echotrain.rl.stepwise). Micro-batches of 3 pack other
    rows together, so the attention's sums run in another order; with the block attention the
    parameters (after one AdamW step at lr 1e-3, which turns a gradient's rounding into up to lr
    where the gradient is near 0) were 2.3e-6 apart, with the whole-row mask under 2e-6."""
    params = []
    for mbs in (8, 3):
        trainer, _ = run(f"mb{mbs}-{preset}-{attention}", steps=1, preset=preset,
                         micro_batch_size=mbs, max_grad_norm=0.0, lr=1e-3, packed_attention=attention)
        params.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    init = dict(make_tiny_model(tiny_tokenizer).named_parameters())
    assert any(not torch.allclose(params[0][k], init[k]) for k in init)  # it did move
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k], atol=atol, rtol=1e-5)


def test_dapo_dynamic_sampling_and_grpo_kl(run, tmp_path, tiny_tokenizer, make_tiny_model):
    _, recs = run("dapo", preset="dapo", steps=2, max_sampling_rounds=3)
    for r in recs:
        assert 1 <= r["sampling_rounds"] <= 3 and 1 <= r["groups/kept"] <= 4
        # dynamic sampling keeps only groups with mixed correctness
        assert r["reward/std"] > 0 or r["groups/kept"] == 4
    _, recs = run("grpo", preset="grpo", steps=2)
    assert all(r["kl/ref"] >= 0 for r in recs) and recs[-1]["kl/ref"] > 0


def test_eval_loads_a_run_directory(run, tiny_tokenizer, digit_task):
    from echotrain.runtime.loading import load_for_eval
    from echotrain.train.evaluate import evaluate

    trainer, _ = run("final", steps=1, save_final_model=True)
    model, tok, desc = load_for_eval(str(trainer.run_dir))
    assert desc.endswith("final_model")
    ours = dict(trainer.model.named_parameters())
    for k, p in model.named_parameters():
        assert torch.equal(p, ours[k])
    res = evaluate(model, tok, digit_task, num_prompts=2, n=2, ks=(1, 2), max_new_tokens=4)
    assert 0 <= res["pass@1"] <= res["pass@2"] <= 1
