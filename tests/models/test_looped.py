"""Tests of the looped transformer (echotrain.models.looped): weight tying, scaling, cost, interface."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from echotrain.models.looped import LoopedConfig, LoopedTransformer, residual_multiplier


def tiny(**kw) -> LoopedTransformer:
    base = dict(vocab_size=23, d_model=16, n_heads=2, n_layers=2, n_loops=3)
    base.update(kw)
    torch.manual_seed(0)
    return LoopedTransformer(LoopedConfig(**base))


# ------------------------------------------------------------------------- scaling rule


def test_residual_multiplier_values():
    # eps = lambda / (N sqrt L), lambda / sqrt(N L), lambda
    assert residual_multiplier("1/N", n_loops=8, n_layers=4, lam=2.0) == pytest.approx(2.0 / 16)
    assert residual_multiplier("1/sqrt(N)", n_loops=8, n_layers=4, lam=2.0) == pytest.approx(2.0 / math.sqrt(32))
    assert residual_multiplier("none", n_loops=8, n_layers=4, lam=2.0) == 2.0
    assert tiny(n_loops=4, n_layers=1).eps == pytest.approx(0.25)


def test_bad_config_values_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"residual_scaling='1/L'.*1/sqrt\(N\)"):
        LoopedConfig(residual_scaling="1/L")
    with pytest.raises(ValueError, match="n_heads"):
        LoopedConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_loops"):
        LoopedConfig(n_loops=0)
    with pytest.raises(ValueError, match="lam"):
        LoopedConfig(lam=float("nan"))


# ----------------------------------------------------------------------- tied weights


def test_gradient_of_tied_scalar_is_sum_over_loops():
    # y = w (w x), w = 2, x = 1: dy/dw = 2 w x = 4 = x w (first use) + w x (second use)
    w, x = torch.tensor(2.0, requires_grad=True), torch.tensor(1.0)
    h = x
    for _ in range(2):
        h = w * h
    h.backward()
    assert w.grad.item() == 4.0


def untied_copy(model: LoopedTransformer) -> LoopedTransformer:
    """The same network unrolled: N * L distinct layers applied once, same weights and eps."""
    cfg = model.config
    ref = LoopedTransformer(LoopedConfig(**{**cfg.__dict__, "n_layers": cfg.n_layers * cfg.n_loops, "n_loops": 1}))
    ref.eps = model.eps
    ref.embed.load_state_dict(model.embed.state_dict())
    ref.norm_out.load_state_dict(model.norm_out.state_dict())
    for i, layer in enumerate(ref.layers):
        layer.load_state_dict(model.layers[i % cfg.n_layers].state_dict())
    return ref


def test_tied_gradient_equals_untied_then_summed_reference():
    model = tiny(n_layers=2, n_loops=3)
    ref = untied_copy(model)
    x = torch.randint(0, 23, (2, 7))
    loss = model(x, labels=x).loss
    ref_loss = ref(x, labels=x).loss
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    loss.backward()
    ref_loss.backward()
    L, N = 2, 3
    for l in range(L):
        ref_grads = dict(ref.layers[l].named_parameters())
        for name, p in model.layers[l].named_parameters():
            summed = sum(dict(ref.layers[n * L + l].named_parameters())[name].grad for n in range(N))
            torch.testing.assert_close(p.grad, summed, rtol=1e-5, atol=1e-7)
            # a single copy's gradient is not the whole story (the test can fail)
            assert not torch.allclose(p.grad, ref_grads[name].grad, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad, rtol=1e-5, atol=1e-7)


def test_perturbing_the_block_changes_every_loop_iteration():
    model = tiny(n_layers=1, n_loops=5)
    x = torch.randint(0, 23, (2, 6))
    calls = []
    model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    before = model(x, output_hidden_states=True).hidden_states
    assert len(calls) == 5  # one layer, applied N times
    with torch.no_grad():
        model.layers[0].mlp.fc.weight.add_(0.05 * torch.randn_like(model.layers[0].mlp.fc.weight))
    after = model(x, output_hidden_states=True).hidden_states
    torch.testing.assert_close(before[0], after[0])  # embeddings untouched
    for n in range(1, 6):
        # the update made in loop n (not just its input) changes: each loop uses the perturbed block
        delta_before, delta_after = before[n] - before[n - 1], after[n] - after[n - 1]
        assert (delta_before - delta_after).norm() > 1e-3 * delta_before.norm(), f"loop {n} unchanged"


def test_parameter_count_is_one_block_whatever_N():
    V, d, L = 23, 16, 2
    per_layer = 12 * d * d + 2 * d  # qkv 3d^2 + proj d^2 + MLP 8d^2 + two RMSNorm gains
    expected = V * d + L * per_layer + d  # tied embedding/output + L layers + final norm
    for N in (1, 4, 16):
        model = tiny(n_loops=N)
        assert model.num_params() == expected
        assert model.num_params(non_embedding=True) == expected - V * d
    assert tiny(tie_embeddings=False).num_params() == expected + V * d


def test_tied_weights_sit_in_exactly_one_optimizer_group():
    model = tiny()
    groups = model.param_groups(weight_decay=0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    decay = {id(p) for p in groups[0]["params"]}
    assert id(model.lm_head.weight) in decay and model.lm_head.weight is model.embed.weight
    assert all(id(p) not in decay for p in model.norm_out.parameters())


def test_tied_weight_is_decayed_once_per_step():
    # p = 1, g = 0, lr 0.1, wd 0.1: AdamW's Adam step is 0, decoupled decay gives 1 - 0.1 * 0.1 = 0.99
    # (0.9801 if a tied tensor were decayed twice).
    model = tiny(n_loops=4)
    opt = model.configure_optimizers(learning_rate=0.1, weight_decay=0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
            p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        target = 0.99 if p.dim() >= 2 else 1.0
        torch.testing.assert_close(p.detach(), torch.full_like(p, target), rtol=0, atol=1e-7)


# ------------------------------------------------------------------- scaling at init


def residual_growth(rule: str, N: int) -> float:
    """||h_N - h_0|| / ||h_0|| at init for a one-layer block looped N times."""
    torch.manual_seed(0)
    model = LoopedTransformer(LoopedConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=1, n_loops=N, residual_scaling=rule))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    return ((hs[-1] - hs[0]).norm() / hs[0].norm()).item()


def test_hidden_norm_at_init_bounded_under_1_over_N_and_growing_otherwise():
    loops = (1, 4, 16, 64)
    g = {rule: [residual_growth(rule, N) for N in loops] for rule in ("1/N", "1/sqrt(N)", "none")}
    # 1/N: the N correlated updates average out: the same size at N = 1 and N = 64
    assert max(g["1/N"]) / min(g["1/N"]) < 1.25, g
    # 1/sqrt(N): grows about like sqrt(N) (8x at N = 64), none like N (64x)
    assert all(a < b for a, b in zip(g["1/sqrt(N)"], g["1/sqrt(N)"][1:])), g
    assert g["1/sqrt(N)"][-1] / g["1/sqrt(N)"][0] > 4, g
    assert g["none"][-1] / g["none"][0] > 30, g


def test_input_injection_adds_eps_x0_per_extra_loop():
    # With every matrix of the block zeroed, the branches output 0 and only injection moves h:
    # h_N = x0 + (N - 1) eps x0.
    for injection, factor in ((False, 1.0), (True, 1.0 + 4 * 0.2)):
        model = tiny(n_layers=1, n_loops=5, input_injection=injection)
        with torch.no_grad():
            for p in model.layers.parameters():
                if p.dim() >= 2:
                    p.zero_()
        hs = model(torch.randint(0, 23, (1, 4)), output_hidden_states=True).hidden_states
        torch.testing.assert_close(hs[-1], factor * hs[0])


# --------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("N", [1, 4])
def test_flops_per_token_counts_N_block_applications(N):
    model = tiny(n_loops=N)
    T, d, L = 10, 16, 2
    x = torch.randint(0, 23, (1, T))
    with FlopCounterMode(display=False) as counter:
        model(x)
    # torch counts the weight matmuls; our attention term (4 T d per token per layer application)
    # is QK^T and AV, which torch's CPU attention kernel does not report.
    attention = N * L * 4 * T * d * T
    assert model.flops_per_token(T, training=False) * T == counter.get_total_flops() + attention
    assert model.flops_per_token(T) == 3 * model.flops_per_token(T, training=False)


def test_flops_grow_by_one_block_per_loop():
    T = 10
    f = [tiny(n_loops=N).flops_per_token(T, training=False) for N in (1, 2, 3)]
    block = 2 * 2 * 12 * 16 * 16 + 2 * 4 * T * 16  # L = 2 layers: 2 * weights + attention
    assert f[1] - f[0] == f[2] - f[1] == block


# ---------------------------------------------------------------- HF-style interface


def test_labels_give_shifted_cross_entropy_ignoring_minus_100():
    model = tiny()
    x = torch.randint(0, 23, (2, 6))
    labels = x.clone()
    labels[0, 3] = -100
    out = model(x, labels=labels)
    logp = out.logits.log_softmax(-1)[:, :-1]
    keep = labels[:, 1:] != -100
    manual = -logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0][keep].mean()
    torch.testing.assert_close(out.loss, manual)


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_left_padding_gives_the_unpadded_logits():
    model = tiny()
    prompt = [3, 7, 1, 9, 4]
    ids, mask = left_pad([prompt, [5] * 8])
    padded = model(ids, attention_mask=mask).logits[0, 3:]
    alone = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_kv_cache_step_equals_full_forward():
    model = tiny()
    ids, mask = left_pad([[3, 7, 1, 9], [5, 2]])
    out = model(ids, attention_mask=mask, use_cache=True)
    assert len(out.past_key_values) == 3 * 2  # one (k, v) per layer application
    nxt = torch.tensor([[11], [12]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    step = model(nxt, attention_mask=mask2, past_key_values=out.past_key_values).logits[:, -1]
    full = model(torch.cat([ids, nxt], dim=1), attention_mask=mask2).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_cached_generation_equals_uncached_greedy_and_is_batch_invariant():
    model = tiny(n_loops=2)
    prompts = [[3, 7, 1, 9], [5, 2], [8, 8, 8]]
    ids, mask = left_pad(prompts)
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=10, use_cache=False)
    assert cached.shape == (3, 4 + 10)
    assert torch.equal(cached, uncached)
    for i, p in enumerate(prompts):
        alone = model.generate(torch.tensor([p]), max_new_tokens=10)
        assert torch.equal(alone[0, len(p):], cached[i, 4:])


def test_generate_pads_after_eos_and_stops_when_all_finished():
    model = tiny()
    ids, mask = left_pad([[3, 7, 1, 9], [5, 2]])
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    eos = int(greedy[0, 4])  # row 0's first generated token
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=22)
    assert out.shape[1] <= 4 + 6
    for row in range(2):
        hits = (greedy[row, 4:] == eos).nonzero()
        stop = 4 + (int(hits[0]) + 1 if len(hits) else 6)  # through the first EOS
        assert torch.equal(out[row, :stop], greedy[row, :stop])
        assert (out[row, stop:] == 22).all()
    assert (out[0, 5:] == 22).all() and out.shape[1] > 5
    # every token an EOS: one new token, then stop
    done = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=list(range(23)))
    assert done.shape == (2, 5)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny()
    ids = torch.tensor([[3, 7, 1]])
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.7)
    a = model.generate(ids, generator=torch.Generator().manual_seed(0), **kw)
    b = model.generate(ids, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a, b)
    top1 = model.generate(ids, top_k=1, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(top1, model.generate(ids, max_new_tokens=8))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, do_sample=True, temperature=0.0)


def test_bad_shapes_raise_clear_errors():
    model = tiny()
    x = torch.randint(0, 23, (2, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="past_key_values"):
        model(x, past_key_values=((torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)),))
    with pytest.raises(ValueError, match="input_ids"):
        model(x[0])
    with pytest.raises(ValueError, match=r"vocab_size=23"):
        model(torch.tensor([[3, 23]]))
