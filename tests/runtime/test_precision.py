"""Mixed precision (``autocast``): resolution of the setting and what a bfloat16 run computes."""

from __future__ import annotations

import json

import pytest
import torch

from echotrain.runtime import precision
from echotrain.train.config import ConfigError, resolve_config

BASE = dict(steps=2, prompts_per_step=2, num_generations=4, max_new_tokens=6, micro_batch_size=4,
            num_mini_batches=2, lr=1e-2, device="cpu", progress=False, plots=False, save_final_model=False,
            seed=0, eval_prompts=2)


def test_resolve_explicit_and_auto(monkeypatch):
    assert precision.resolve_autocast("off", "cpu") is None
    assert precision.resolve_autocast("bfloat16", "cpu") is torch.bfloat16
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "1")
    assert precision.native_bf16("cpu") is True
    assert precision.resolve_autocast("auto", "cpu") is torch.bfloat16
    assert precision.resolve_autocast("auto", "cpu", torch.bfloat16) is None  # low-precision weights: no autocast
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    assert precision.native_bf16("cpu") is False
    assert precision.resolve_autocast("auto", torch.device("cpu")) is None
    monkeypatch.delenv(precision.NATIVE_BF16_ENV)
    assert precision.native_bf16("meta") is False  # an unknown device type never claims native bf16
    with pytest.raises(ValueError, match="autocast: 'fp8' is not one of auto, off, bfloat16"):
        precision.resolve_autocast("fp8", "cpu")


def test_config_rejects_a_bad_value():
    with pytest.raises(ConfigError, match="autocast"):
        resolve_config(overrides={"autocast": "fp16"})
    assert resolve_config().autocast == "auto"


def test_autocast_context_is_a_no_op_without_dtype():
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with precision.autocast(model, None):
        assert model(x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with precision.autocast(model, torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


@pytest.fixture
def linear_dtypes():
    """Records (grad enabled, output dtype) of every nn.Linear call while installed."""
    seen: list[tuple[bool, torch.dtype]] = []

    def install(model):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, inp, out: seen.append((torch.is_grad_enabled(), out.dtype)))
        return seen

    return install


@pytest.mark.parametrize("setting", ["off", "bfloat16"])
def test_bfloat16_run_keeps_float32_state_and_exact_on_policy_ratio(setting, build_trainer, linear_dtypes):
    trainer = build_trainer(BASE, name=setting, autocast=setting)
    seen = linear_dtypes(trainer.model)
    records = trainer.train()
    want = torch.bfloat16 if setting == "bfloat16" else torch.float32
    # generation / no-grad passes and the with-grad forward all ran in the resolved precision
    assert {grad for grad, _ in seen} == {False, True}
    assert {dtype for _, dtype in seen} == {want}
    # weights, gradients and optimizer state stay float32
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(t.dtype == torch.float32 for s in trainer.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.is_floating_point())
    for r in records:
        assert torch.isfinite(torch.tensor(r["grad_norm"]))
        if r["groups/zero_variance_frac"] < 1.0:  # a step whose groups all tied has no gradient to take
            assert r["grad_norm"] > 0
        # the first mini-batch is on-policy in both precisions: its batch ratio is 1 exactly
        assert 1.0 in (r["echo/R_batch_min"], r["echo/R_batch_max"])
    assert any(r["grad_norm"] > 0 for r in records)  # and the run did learn something
    info = json.loads((trainer.run_dir / "run_info.json").read_text())
    assert info["autocast"] == setting


def test_bfloat16_log_probs_are_close_to_float32_but_not_equal(tiny_model):
    """The with-grad log-probs of a fixed batch: bfloat16 autocast is a different computation
    (a guard that the setting is not silently ignored) within bf16's precision of float32's;
    both come back float32 with float32 gradients."""
    from echotrain.runtime.rollout import forward_log_probs

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 20, (4, 5), generator=g)
    response = torch.randint(3, 20, (4, 6), generator=g)
    ones = torch.ones_like
    out = {}
    for dtype in (None, torch.bfloat16):
        tiny_model.zero_grad()
        with precision.autocast(tiny_model, dtype):
            lp, _ = forward_log_probs(tiny_model, prompt, ones(prompt), response, ones(response))
        lp.sum().backward()
        grad = next(tiny_model.parameters()).grad
        assert lp.dtype == torch.float32 and grad.dtype == torch.float32
        out[dtype] = (lp.detach(), grad.clone())
    (lp32, g32), (lp16, g16) = out[None], out[torch.bfloat16]
    assert not torch.equal(lp32, lp16)
    assert torch.allclose(lp16, lp32, atol=0.05, rtol=0.02)
    assert torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("variant", [
    dict(kl_coef=0.1),  # reference log-probs from the initial model's copy
    dict(kl_coef=0.1, lora_r=4, lora_alpha=8),  # reference = the same model with adapters off
    dict(optimizer="sam"),  # the closure's second forward, at w + e
    dict(gradient_checkpointing=True, num_mini_batches=1),  # the recomputation in backward
], ids=["kl_ref_copy", "kl_lora", "sam", "grad_ckpt"])
def test_every_forward_and_nothing_else_runs_under_autocast(variant, build_trainer, monkeypatch):
    """With autocast=bfloat16, every linear layer call of every model of the run (policy and KL
    reference, generation, log-probs, evaluation, SAM's second pass, checkpoint recomputation) is
    under autocast and returns bfloat16; the losses and the optimizer step are not."""
    from echotrain.train import update

    trainer = build_trainer({**BASE, "steps": 1}, name="v", autocast="bfloat16", **variant)
    seen: list[tuple[str, bool, torch.dtype]] = []
    models = {"policy": trainer.model, "ref": trainer.ref_model}
    for name, model in models.items():
        for m in (model.modules() if model is not None else ()):
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, inp, out, name=name: seen.append(
                    (name, torch.is_autocast_enabled("cpu"), out.dtype)))
    outside: list[tuple[str, bool]] = []

    def spy(name, fn):
        def wrapped(*a, **k):
            outside.append((name, torch.is_autocast_enabled("cpu")))
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(update, "compute_policy_loss", spy("loss", update.compute_policy_loss))
    monkeypatch.setattr(update, "kl_penalty", spy("kl", update.kl_penalty))
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: outside.append(("optimizer", torch.is_autocast_enabled("cpu"))))
    trainer.train()
    assert seen and {(on, dtype) for _, on, dtype in seen} == {(True, torch.bfloat16)}
    if variant.get("kl_coef") and "lora_r" not in variant:
        assert {name for name, _, _ in seen} == {"policy", "ref"}
    assert {name for name, _ in outside} >= ({"loss", "optimizer"} | ({"kl"} if variant.get("kl_coef") else set()))
    assert not any(on for _, on in outside)


def test_auto_is_off_on_a_gpu_that_only_emulates_bf16(monkeypatch):
    """A pre-Ampere GPU (e.g. T4): torch.cuda.is_bf16_supported() is True by emulation, which is
    slower than float32, so ``auto`` must not pick bfloat16 there; an Ampere+ GPU does."""
    monkeypatch.delenv(precision.NATIVE_BF16_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, want in ((False, None), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or including_emulation)
        precision._probe_native_bf16.cache_clear()
        try:
            assert precision.resolve_autocast("auto", "cuda") is want
        finally:
            precision._probe_native_bf16.cache_clear()


def test_the_resolution_says_why(monkeypatch):
    why = precision.resolve_autocast_why
    assert why("off", "cpu") == (None, "autocast=off is set")
    monkeypatch.delenv(precision.NATIVE_BF16_ENV)
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ())  # an AVX2-only CPU
    assert why("auto", "cpu") == (None, "autocast=auto and this CPU has no native bf16 (no AVX512-BF16 or AMX)")
    assert why("bfloat16", "cpu") == (torch.bfloat16, "autocast=bfloat16 is set, but this CPU has no native bf16 "
                                      "(no AVX512-BF16 or AMX): bf16 is emulated, slower than float32")
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ("AVX512-BF16",))
    assert why("auto", "cpu") == (torch.bfloat16, "autocast=auto and this CPU has native bf16 (AVX512-BF16)")
    assert why("bfloat16", "cpu") == (torch.bfloat16, "autocast=bfloat16 is set")
    assert why("auto", "cpu", torch.bfloat16) == (None, "autocast=auto and the parameters are bfloat16, not float32")
    assert why("auto", "meta") == (None, "autocast=auto and no native bf16 known for device type 'meta'")
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "0")
    assert why("auto", "cpu") == (None, "autocast=auto and ECHOTRAIN_NATIVE_BF16=0 says the hardware has no native bf16")
    assert precision.describe(None, "autocast=off is set") == "no autocast, because autocast=off is set"
    assert precision.describe(torch.bfloat16) == "bfloat16 autocast"


def test_readme_quotes_the_startup_reasons_exactly(monkeypatch):
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    monkeypatch.delenv(precision.NATIVE_BF16_ENV)
    for features in ((), ("AVX512-BF16",)):
        monkeypatch.setattr(precision, "cpu_bf16_features", lambda f=features: f)
        line = precision.describe(*precision.resolve_autocast_why("auto", "cpu"))
        assert f"`{line}`" in readme, line


def test_auto_on_a_cpu_takes_the_models_size(monkeypatch):
    """Issue 40 item 7: on a CPU with native bf16, ``auto`` is float32 for a model below
    CPU_BF16_MIN_PARAMS (the testbed ran 10-18% slower in bfloat16), bfloat16 from there on (the
    default model's size); an unknown size and a GPU keep the hardware rule."""
    assert precision.CPU_BF16_MIN_PARAMS == 100_000_000
    monkeypatch.delenv(precision.NATIVE_BF16_ENV)
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ("AMX",))
    why = precision.resolve_autocast_why
    assert why("auto", "cpu", num_params=426_624) == (
        None, "autocast=auto and this CPU has native bf16 (AMX), but the model has 426,624 parameters, fewer than "
              "100,000,000: bfloat16 does not pay there on a CPU (docs/benchmarks.md, \"Mixed precision\")")
    assert why("auto", "cpu", num_params=99_999_999)[0] is None
    for n in (100_000_000, 134_515_008, None):  # at the threshold, SmolLM2-135M, unknown
        assert why("auto", "cpu", num_params=n) == (torch.bfloat16, "autocast=auto and this CPU has native bf16 (AMX)")
    assert why("bfloat16", "cpu", num_params=426_624) == (torch.bfloat16, "autocast=bfloat16 is set")  # asked for
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ())
    assert why("auto", "cpu", num_params=426_624)[1] == ("autocast=auto and this CPU has no native bf16 (no "
                                                         "AVX512-BF16 or AMX)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the size rule is a CPU measurement only
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    precision._probe_native_bf16.cache_clear()
    try:
        assert precision.resolve_autocast("auto", "cuda", num_params=426_624) is torch.bfloat16
    finally:
        precision._probe_native_bf16.cache_clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # resolve_for counts the parameters
    monkeypatch.setattr(precision, "cpu_bf16_features", lambda: ("AMX",))
    assert precision.resolve_for_why(model, "auto")[1].endswith("but the model has 23 parameters, fewer than "
                                                                "100,000,000: bfloat16 does not pay there on a CPU "
                                                                "(docs/benchmarks.md, \"Mixed precision\")")


def test_testbed_run_with_native_bf16_resolves_auto_to_float32(tmp_path, monkeypatch, testbed_cache, capsys):
    """Through the real CLI: a testbed run on a CPU with native bf16 (the probe stubbed by
    ECHOTRAIN_NATIVE_BF16=1) computes in float32 and says why in its startup line and run_info.json."""
    from echotrain import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, "1")
    reason = ("autocast=auto and ECHOTRAIN_NATIVE_BF16=1 says the hardware has native bf16, but the model has "
              "426,624 parameters, fewer than 100,000,000: bfloat16 does not pay there on a CPU (docs/benchmarks.md, "
              "\"Mixed precision\")")
    assert cli.main(["train", "model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2",
                     "max_new_tokens=4", "eval_prompts=0", "num_threads=1", "progress=false", "plots=false",
                     "save_final_model=false", "output_dir=run"]) == 0
    assert f"no autocast, because {reason}; OpenMP" in capsys.readouterr().err
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert (info["autocast"], info["autocast_reason"]) == ("off", reason)


def test_train_help_states_what_was_measured(capsys):
    """``echotrain train --help`` on ``autocast`` says what was measured (issue 40 item 7: it said
    the default step was "2x faster" in bfloat16, which README no longer measures)."""
    from echotrain import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "2x faster" not in text
    assert ("on a CPU, the model has at least 100M parameters, else off. Measured on CPUs with native bf16: "
            f"{precision.CPU_BF16_MEASURED} (docs/benchmarks.md)") in text
    assert precision.CPU_BF16_MEASURED == ("bfloat16 autocast ran the default job (SmolLM2-135M) in 0.84x the float32 "
                                           "time (AMD AVX512-BF16, 2026-12-04) and the 0.43M testbed 10-18% slower")
