"""EchoGRPOTrainer (TRL GRPOTrainer subclass) computes echotrain's loss, exactly over micro-batches.

A tiny random Llama and a char-level tokenizer are built here (no downloads).
"""

from __future__ import annotations

import string

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl==1.16.0)")
datasets = pytest.importorskip("datasets", reason="datasets is not installed")

from echotrain.integrations.trl import EchoGRPOConfig, EchoGRPOTrainer  # noqa: E402
from echotrain.rl import compute_policy_loss  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + list(string.digits + "abcdesyt: "))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(tok, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def digit_reward(prompts, completions, **kwargs):
    return [float(p[-1]["content"][-1] in c[-1]["content"]) for p, c in zip(prompts, completions)]


def make_trainer(tmp_path, dtype=torch.float32, **overrides):
    from datasets import Dataset

    tok = make_tokenizer()
    model = make_model(tok, dtype)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"say {i % 10}"}]} for i in range(16)])
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
              logging_strategy="no", bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
              per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=6, temperature=1.0, learning_rate=1e-2, max_steps=1,
              dataloader_num_workers=0, dataloader_pin_memory=False, loss_mode="echo", loss_agg_mode="balanced",
              epsilon=0.2, epsilon_high=0.28, batch_clip_low=0.01, batch_clip_high=0.01)
    kw.update(overrides)
    args = EchoGRPOConfig(**kw)
    return EchoGRPOTrainer(model=model, reward_funcs=[digit_reward], args=args, train_dataset=ds,
                           processing_class=tok)


def fabricated_window(trainer, seed=0, B=4, P=5, T=6, off_policy=True):
    """Two TRL-style micro-batches (dicts as TRL's rollout buffer holds them) of one optimizer step."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    mbs = []
    for k in range(2):
        prompt_mask = torch.ones(B, P, dtype=torch.long)
        prompt_mask[0, :2] = 0  # left padding
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        completion_mask = (torch.arange(T) < lengths[:, None]).long()
        mb = {
            "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
            "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(4, vocab, (B, T), generator=g),
            "completion_mask": completion_mask,
            "advantages": torch.randn(B, generator=g),
            "group_index": torch.tensor([0, 1, 0, 1]) + 2 * k,
            "num_items_in_batch": completion_mask.sum(),
        }
        if off_policy:
            with torch.no_grad():
                lp, _ = trainer._log_probs(trainer.model, mb)
            # the policy "moved" since the rollout: old log-probs lower, so log R ~ +0.1 and ECHO clips
            mb["old_per_token_logps"] = (lp - 0.1 + 0.05 * torch.randn(lp.shape, generator=g)).detach()
        mbs.append(mb)
    return mbs


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def accumulate_window(trainer, mbs):
    """TRL's accumulation loop over the micro-batches ``mbs`` (one optimizer step): the summed
    loss value and the accumulated gradients."""
    model = trainer.model
    trainer._buffered_inputs = mbs
    trainer.current_gradient_accumulation_steps = len(mbs)
    model.zero_grad()
    total = 0.0
    for k, mb in enumerate(mbs):
        trainer._step = k
        loss = trainer._compute_loss(model, mb)
        loss.backward()
        total += float(loss.detach())
    return total, _grads(model)


@pytest.mark.parametrize("loss_mode,agg", [("echo", "balanced"), ("echo", "token-mean"),
                                           ("vanilla", "seq-mean-token-mean")])
def test_accumulated_gradient_equals_whole_step(tmp_path, loss_mode, agg):
    """Two micro-batches through _compute_loss (TRL's accumulation loop) == echotrain's loss of the
    whole step as one batch (the single-tensor oracle), value sum and parameter gradients.

    TRL's fused log-prob head computes in float32, so equality is to float32 rounding; the naive
    per-micro-batch loss (each micro-batch its own step) is far off, so the test can fail."""
    trainer = make_trainer(tmp_path, loss_mode=loss_mode, loss_agg_mode=agg)
    model = trainer.model
    model.train()
    mbs = fabricated_window(trainer)
    total, acc = accumulate_window(trainer, mbs)
    if loss_mode == "echo":
        assert trainer._metrics["train"]["echotrain/echo/batch_clipped"][-1] == 1.0

    model.zero_grad()
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k != "num_items_in_batch"}
    log_prob, _ = trainer._log_probs(model, cat)
    ref, _ = compute_policy_loss(loss_mode, cat["old_per_token_logps"], log_prob, cat["advantages"],
                                 cat["completion_mask"], agg, trainer.policy_loss_config,
                                 group_index=cat["group_index"])
    ref.backward()
    oracle = _grads(model)
    assert total == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    for a, b in zip(acc, oracle):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    model.zero_grad()  # contrast: each micro-batch normalised on its own (what exactness avoids)
    for mb in mbs:
        lp, _ = trainer._log_probs(model, mb)
        compute_policy_loss(loss_mode, mb["old_per_token_logps"], lp, mb["advantages"], mb["completion_mask"], agg,
                            trainer.policy_loss_config, group_index=mb["group_index"])[0].backward()
    naive = torch.cat([g.flatten() for g in _grads(model)])
    exact = torch.cat([g.flatten() for g in oracle])
    assert (naive - exact).norm() > 0.05 * exact.norm()


def test_vanilla_token_mean_equals_trl_dapo_loss(tmp_path):
    """One micro-batch, one step: loss_mode=vanilla + token-mean is TRL's own loss_type='dapo'."""
    trainer = make_trainer(tmp_path, loss_mode="vanilla", loss_agg_mode="token-mean", gradient_accumulation_steps=1)
    trainer.model.train()
    mb = fabricated_window(trainer, seed=1)[0]
    trainer._buffered_inputs = [mb]
    trainer._step = 0
    trainer.current_gradient_accumulation_steps = 1
    ours = trainer._compute_loss(trainer.model, mb)
    trainer.loss_type = "dapo"
    theirs = trl.GRPOTrainer._compute_loss(trainer, trainer.model, mb)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_one_training_step_runs_and_updates(tmp_path):
    """A real GRPO step (generation, reward, advantages, 2 accumulated micro-batches, AdamW)."""
    trainer = make_trainer(tmp_path, loss_agg_mode="token-mean")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    moved = sum(int(not torch.equal(a, b.detach())) for a, b in zip(before, trainer.model.parameters()))
    assert moved > 0
    assert trainer.state.global_step == 1


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="loss_mode"):
        EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_mode="nope")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_agg_mode="token-max")
    with pytest.raises(ValueError, match="multiple of"):
        EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                       gradient_accumulation_steps=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="beta"):
        make_trainer(tmp_path, beta=0.1)


def test_echo_flags_reach_the_policy_loss_config(tmp_path):
    args = EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, echo_pessimistic=True,
                          echo_token_clip="truncate", echo_token_cap=1.5)
    plc = args.policy_loss_config()
    assert (plc.echo_pessimistic, plc.echo_token_clip, plc.echo_token_cap) == (True, "truncate", 1.5)
    with pytest.raises(ValueError, match="echo_token_clip='clip'"):
        EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, echo_token_clip="clip")


def test_loss_fields_are_policy_loss_config_fields(tmp_path):
    """EchoGRPOConfig declares no loss setting itself: each PolicyLossConfig field but the token
    clip (TRL's epsilon / epsilon_high) is derived with its default and help; unset norm_constant
    is max_completion_length."""
    import dataclasses

    from echotrain.integrations.trl import TRL_OWNED
    from echotrain.rl.config import POLICY_LOSS_FIELDS

    trl_fields = {f.name: f for f in dataclasses.fields(EchoGRPOConfig)}
    for name, f in POLICY_LOSS_FIELDS.items():
        if name in TRL_OWNED:
            continue
        assert (trl_fields[name].default, trl_fields[name].metadata["help"]) == (f.default, f.metadata["help"]), name
    args = EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=12,
                          epsilon=0.1, epsilon_high=0.3, log_ratio_clamp=5.0)
    plc = args.policy_loss_config()
    assert (plc.norm_constant, plc.clip_ratio_low, plc.clip_ratio_high, plc.log_ratio_clamp) == (12.0, 0.1, 0.3, 5.0)
    with pytest.raises(ValueError, match="norm_constant must be > 0"):
        EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, norm_constant=0)


def test_rollout_correction_needs_vllm_log_probs(tmp_path):
    with pytest.raises(ValueError, match="rollout_correction='token_is' needs the sampler's per-token log-probs"):
        make_trainer(tmp_path, rollout_correction="token_is")


@pytest.mark.parametrize("correction", ["token_is", "seq_mask,rejection"])
def test_rollout_correction_with_vllm_log_probs_is_exact_over_the_window(tmp_path, correction):
    """With TRL's sampling_per_token_logps (vLLM) as rollout_log_prob, two micro-batches through
    _compute_loss == the whole step as one batch (batch-normalised weights are step-global)."""
    import dataclasses

    trainer = make_trainer(tmp_path, loss_mode="vanilla", loss_agg_mode="token-mean")
    # as with use_vllm=True (vLLM itself is not installed here): the correction reads TRL's key
    trainer.policy_loss_config = dataclasses.replace(trainer.policy_loss_config, rollout_correction=correction,
                                                     rollout_is_threshold=1.05, rollout_is_threshold_lower=0.95,
                                                     rollout_is_batch_normalize=True, rollout_rs="token_k2",
                                                     rollout_rs_threshold=0.002)
    model = trainer.model
    model.train()
    mbs = fabricated_window(trainer)
    g = torch.Generator().manual_seed(3)
    for mb in mbs:
        mb["sampling_per_token_logps"] = mb["old_per_token_logps"] + 0.05 * torch.randn(
            mb["old_per_token_logps"].shape, generator=g)
    total, acc = accumulate_window(trainer, mbs)
    assert trainer._metrics["train"]["echotrain/rollout_corr/frac_high"][-1] > 0
    model.zero_grad()
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k != "num_items_in_batch"}
    log_prob, _ = trainer._log_probs(model, cat)
    ref, _ = compute_policy_loss("vanilla", cat["old_per_token_logps"], log_prob, cat["advantages"],
                                 cat["completion_mask"], "token-mean", trainer.policy_loss_config,
                                 group_index=cat["group_index"], rollout_log_prob=cat["sampling_per_token_logps"])
    ref.backward()
    assert total == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    for a, b in zip(acc, _grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_entropy_coef_is_mapped_and_exact_over_the_window(tmp_path):
    """TRL's entropy_coef: the step's token-mean entropy bonus, accumulated == whole-step oracle."""
    from echotrain.rl import compute_step_stats
    from echotrain.rl.entropy import entropy_bonus

    trainer = make_trainer(tmp_path, loss_mode="vanilla", loss_agg_mode="token-mean", entropy_coef=0.5)
    model = trainer.model
    model.train()
    mbs = fabricated_window(trainer, seed=2)
    total, acc = accumulate_window(trainer, mbs)
    model.zero_grad()
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k != "num_items_in_batch"}
    log_prob, ent = trainer._log_probs(model, cat)
    mask = cat["completion_mask"]
    step = compute_step_stats([dict(old_log_prob=cat["old_per_token_logps"], advantages=cat["advantages"],
                                    response_mask=mask, group_index=cat["group_index"])],
                              loss_mode="vanilla", loss_agg_mode="token-mean", config=trainer.policy_loss_config)
    ref, _ = compute_policy_loss("vanilla", cat["old_per_token_logps"], log_prob, cat["advantages"], mask,
                                 "token-mean", trainer.policy_loss_config, group_index=cat["group_index"])
    h = entropy_bonus(ent, mask, step, "token-mean")
    assert float(h.detach()) == pytest.approx(float((ent.detach() * mask).sum() / mask.sum()), rel=1e-6)
    (ref - 0.5 * h).backward(retain_graph=True)
    oracle = _grads(model)
    for a, b in zip(acc, oracle):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    ref.backward()  # the bonus has a gradient of its own (TRL's entropies carry grad)
    assert sum(float((a - b).norm()) for a, b in zip(oracle, _grads(model))) > 1e-4
    assert total == pytest.approx(float(ref - 0.5 * h), rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        make_trainer(tmp_path, use_adaptive_entropy=True)
