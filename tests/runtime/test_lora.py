"""LoRA through peft: only adapters train, the KL reference is the base model (adapters off, no
copy), checkpoints hold adapters + optimizer state and resume exactly, final_model merged or not."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("peft")

from echotrain.runtime.checkpoints import latest_checkpoint, load_checkpoint  # noqa: E402
from echotrain.train.config import ConfigError, resolve_config  # noqa: E402
from echotrain.runtime.lora import reference_policy  # noqa: E402
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES  # noqa: E402
from echotrain.runtime.rollout import forward_log_probs, generate_rollouts  # noqa: E402
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=8,
            num_mini_batches=2, lr=2e-2, device="cpu", progress=False, plots=False, save_final_model=False,
            eval_prompts=0, seed=0, lora_r=4, lora_alpha=8, kl_coef=0.05, save_every=1, keep_last=3)


@pytest.fixture
def lora_run(run_trainer):
    return functools.partial(run_trainer, BASE)


def test_only_adapters_change_and_reference_is_the_base_model(lora_run, tiny_tokenizer, make_tiny_model):
    trainer, records = lora_run()
    base = make_tiny_model(tiny_tokenizer)  # the same initial weights (seeded)
    assert trainer.ref_model is None  # no second copy of the model
    named = dict(trainer.model.named_parameters())
    lora = {k: p for k, p in named.items() if "lora_" in k}
    assert lora and all(p.requires_grad for p in lora.values())
    assert all(not p.requires_grad for k, p in named.items() if k not in lora)
    base_sd = base.state_dict()
    for k, p in named.items():
        if k in lora:
            continue
        name = k.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p.detach(), base_sd[name]), k  # frozen base weights are bit-identical
    assert max(float(p.detach().abs().max()) for k, p in lora.items() if "lora_B" in k) > 1e-3  # B left zero
    # KL to the reference grows from ~0 (B = 0 at the first update) as the adapters move
    assert 0 <= records[0]["kl/ref"] < records[-1]["kl/ref"] and records[-1]["kl/ref"] > 1e-4

    torch.manual_seed(1)
    batch = generate_rollouts(base, tiny_tokenizer, [[{"role": "user", "content": "say 3"}]] * 2, 3,
                              max_new_tokens=6)
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        want, _ = forward_log_probs(base, *args)
        with reference_policy(trainer.model) as ref:
            got, _ = forward_log_probs(ref, *args)
        tuned, _ = forward_log_probs(trainer.model, *args)
    m = batch.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=0, atol=1e-6)
    assert float((tuned[m] - want[m]).abs().max()) > 1e-3  # adapters on: a different policy
    # the peft wrapper keeps the shared-prompt forward (its kwargs reach the base model)
    from echotrain.runtime.rollout import _supports_shared_prefix

    assert _supports_shared_prefix(trainer.model)
    with torch.no_grad():
        plain, _ = forward_log_probs(trainer.model, *args, share_prefix=False)
    torch.testing.assert_close(tuned[m], plain[m], rtol=0, atol=1e-5)


def test_lora_checkpoint_holds_adapters_and_resume_is_exact(lora_run):
    _, full = lora_run("full", steps=4)

    with pytest.raises(Killed):
        lora_run("killed", steps=4, callbacks=[kill_at(3)])
    trainer, resumed = lora_run("killed", steps=4, resume=True)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}  # noqa: E731
    assert [strip(r) for r in resumed] == [strip(r) for r in full]
    ckpt = load_checkpoint(latest_checkpoint(trainer.run_dir))
    assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])  # adapters only
    n_adapter = sum(1 for _ in ckpt["model"])
    assert len(ckpt["optimizer"]["state"]) == n_adapter  # Adam moments of the adapters only


def test_final_model_merged_or_adapters(lora_run, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    trainer, _ = lora_run("merged", steps=1, save_final_model=True)
    merged = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "final_model")
    torch.manual_seed(2)
    batch = generate_rollouts(merged, tiny_tokenizer, [[{"role": "user", "content": "say 5"}]], 3, max_new_tokens=6)
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        a, _ = forward_log_probs(merged, *args)
        b, _ = forward_log_probs(trainer.model, *args)
    m = batch.response_mask.bool()
    torch.testing.assert_close(a[m], b[m], rtol=0, atol=1e-5)
    trainer, _ = lora_run("adapters", steps=1, save_final_model=True, lora_merge_final=False)
    files = {p.name for p in (trainer.run_dir / "final_model").iterdir()}
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "model.safetensors" not in files  # no base weights in the adapter folder


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="lora_dropout=0.1: must be 0"):
        resolve_config(overrides={"lora_r": 4, "lora_dropout": 0.1})
    with pytest.raises(ConfigError, match="lora_target_modules is empty"):
        resolve_config(overrides={"lora_r": 4, "lora_target_modules": " , "})
    with pytest.raises(ConfigError, match="lora_r=-1"):
        resolve_config(overrides={"lora_r": -1})


def test_is_lora_never_imports_peft():
    """A run without adapters must not pay peft's import (seconds: torchao, bitsandbytes)."""
    import subprocess
    import sys

    code = ("import sys, torch; from echotrain.runtime.lora import is_lora, model_state; "
            "m = torch.nn.Linear(2, 2); assert not is_lora(m); model_state(m); print('peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
