"""SAM: the perturbation, zero gradients, BatchNorm statistics, gradient scaler, saving."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from echotrain.optim.sam import SAM, frozen_running_stats


def _two_params():
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    return a, b


def test_perturbation_is_rho_g_over_global_norm():
    # grads [3, 4] and [12]: global norm sqrt(9 + 16 + 144) = 13 (per-tensor norms would be 5, 12).
    a, b = _two_params()
    opt = SAM([a, b], torch.optim.SGD, rho=0.05, lr=0.1)
    a.grad = torch.tensor([3.0, 4.0])
    b.grad = torch.tensor([12.0])
    norm = opt.first_step()
    assert norm.item() == pytest.approx(13.0)
    torch.testing.assert_close(a.detach(), torch.tensor([0.15, 0.20]) / 13, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.detach(), torch.tensor([0.60]) / 13, rtol=1e-6, atol=0)
    # second_step restores w exactly before the base update: w = 0 - lr * g_sam
    a.grad = torch.tensor([1.0, -2.0])
    b.grad = torch.tensor([0.5])
    opt.second_step()
    torch.testing.assert_close(a.detach(), torch.tensor([-0.1, 0.2]))
    torch.testing.assert_close(b.detach(), torch.tensor([-0.05]))


def test_perturbation_spans_param_groups_with_their_own_rho():
    a, b = _two_params()
    opt = SAM([{"params": [a]}, {"params": [b], "rho": 0.5}], torch.optim.SGD, rho=0.05, lr=0.1)
    a.grad = torch.tensor([3.0, 4.0])
    b.grad = torch.tensor([12.0])
    opt.first_step()
    torch.testing.assert_close(a.detach(), 0.05 * torch.tensor([3.0, 4.0]) / 13)
    torch.testing.assert_close(b.detach(), 0.5 * torch.tensor([12.0]) / 13)


def test_adaptive_perturbation_matches_asam_formula():
    # ASAM: e = rho * w^2 g / || |w| g ||   (Kwon et al. 2021, eq. 9)
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    g = torch.tensor([0.5, 1.0, -1.5])
    opt = SAM([w], torch.optim.SGD, rho=0.5, adaptive=True, lr=0.1)
    w.grad = g.clone()
    w0 = w.detach().clone()
    opt.first_step()
    expected = w0 + 0.5 * w0.square() * g / torch.linalg.vector_norm(w0.abs() * g)
    torch.testing.assert_close(w.detach(), expected)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=6),
    st.floats(0.0, 2.0, allow_nan=False),
)
def test_perturbation_has_norm_rho(values, rho):
    w = torch.zeros(len(values), requires_grad=True)
    w.grad = torch.tensor(values)
    opt = SAM([w], torch.optim.SGD, rho=rho, lr=0.1)
    opt.first_step()
    norm_g = math.sqrt(sum(v * v for v in values))
    # ||e|| = rho ||g|| / (||g|| + eps), eps = 1e-12: rho for any ||g|| well above eps (1.2e-7 too)
    expected = rho * norm_g / (norm_g + 1e-12)
    assert torch.linalg.vector_norm(w.detach()).item() == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_zero_gradients_leave_parameters_unchanged_and_finite():
    a = torch.tensor([1.0, -2.0], requires_grad=True)
    b = torch.tensor([3.0], requires_grad=True)
    opt = SAM([a, b], torch.optim.SGD, rho=0.05, lr=0.1)

    def closure():
        loss = 0.0 * (a.sum() + b.sum())
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.equal(a.detach(), torch.tensor([1.0, -2.0]))
    assert torch.equal(b.detach(), torch.tensor([3.0]))
    opt.first_step()  # grads are zero here too: e = 0
    assert torch.isfinite(a).all() and torch.equal(a.detach(), torch.tensor([1.0, -2.0]))
    with pytest.raises(RuntimeError, match="twice"):
        opt.first_step()


def test_step_equals_manual_sam_on_a_quadratic():
    # L(w) = 0.5 * sum(h * w^2): g = h w; g_sam = h (w + rho g/||g||); SGD: w - lr g_sam
    h = torch.tensor([1.0, 4.0, 9.0])
    w = torch.tensor([1.0, 1.0, -1.0], requires_grad=True)
    opt = SAM([w], "sgd", rho=0.1, lr=0.05)
    w0 = w.detach().clone()
    calls = []

    def closure():
        calls.append(w.detach().clone())
        loss = 0.5 * (h * w * w).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    g = h * w0
    w_adv = w0 + 0.1 * g / g.norm()
    torch.testing.assert_close(calls[0], w0)
    torch.testing.assert_close(calls[1], w_adv)
    torch.testing.assert_close(w.detach(), w0 - 0.05 * h * w_adv)
    assert loss.item() == pytest.approx(0.5 * float((h * w0 * w0).sum()))


def test_batchnorm_running_mean_updated_only_in_first_pass():
    # momentum 0.1, batch mean 1: one pass gives 0.1; a second (perturbed) pass would give 0.19.
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(1, momentum=0.1)
    head = nn.Linear(1, 1)
    model = nn.Sequential(bn, head)
    x = torch.tensor([[0.0], [2.0], [1.0], [1.0]])  # mean 1
    y = torch.randn(4, 1)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, model=model)

    def closure():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    assert bn.running_mean.item() == pytest.approx(0.1, abs=1e-7)
    assert bn.num_batches_tracked.item() == 1
    # without `model=` the second pass also updates the statistics: the 0.19 of the issue
    bn2 = nn.BatchNorm1d(1, momentum=0.1)
    model2 = nn.Sequential(bn2, nn.Linear(1, 1))
    opt2 = SAM(model2.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    opt2.step(lambda: F.mse_loss(model2(x), y).backward())
    assert bn2.running_mean.item() == pytest.approx(0.19, abs=1e-6)


def test_frozen_running_stats_restores_buffers_but_keeps_batch_statistics():
    bn = nn.BatchNorm1d(2)
    x = torch.randn(8, 2) * 3 + 5
    with frozen_running_stats(bn):
        out = bn(x)
    assert torch.equal(bn.running_mean, torch.zeros(2))
    assert torch.equal(bn.running_var, torch.ones(2))
    torch.testing.assert_close(out.mean(0), torch.zeros(2), atol=1e-5, rtol=0)  # batch stats used


def _scaler_or_skip():
    try:
        return torch.amp.GradScaler("cpu", init_scale=8.0)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"GradScaler('cpu') unavailable: {exc}")


def test_grad_scaler_inf_in_first_pass_skips_step_and_backs_off():
    scaler = _scaler_or_skip()
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = SAM([w], torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    calls = []

    def closure():
        calls.append(1)
        loss = (w * torch.tensor([float("inf"), 1.0])).sum()
        scaler.scale(loss).backward()
        return loss

    opt.step(closure, grad_scaler=scaler)
    scaler.update()
    assert len(calls) == 1  # the perturbed pass never ran
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    assert len(opt.state) == 0  # no momentum buffer created: the base step was skipped
    assert scaler.get_scale() == pytest.approx(4.0)  # backoff 0.5


def test_grad_scaler_finite_step_equals_unscaled_step():
    scaler = _scaler_or_skip()
    h = torch.tensor([1.0, 4.0])
    w1 = torch.tensor([1.0, -1.0], requires_grad=True)
    w2 = w1.detach().clone().requires_grad_(True)
    opt1 = SAM([w1], torch.optim.SGD, rho=0.1, lr=0.05)
    opt2 = SAM([w2], torch.optim.SGD, rho=0.1, lr=0.05)

    def closure_scaled():
        loss = 0.5 * (h * w1 * w1).sum()
        scaler.scale(loss).backward()
        return loss

    def closure_plain():
        loss = 0.5 * (h * w2 * w2).sum()
        loss.backward()
        return loss

    opt1.step(closure_scaled, grad_scaler=scaler)
    scaler.update()
    opt2.step(closure_plain)
    torch.testing.assert_close(w1.detach(), w2.detach())
    assert scaler.get_scale() == pytest.approx(8.0)


def test_grad_scaler_inf_in_second_pass_restores_weights():
    scaler = _scaler_or_skip()
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = SAM([w], torch.optim.SGD, rho=0.05, lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        factor = 1.0 if len(calls) == 1 else float("nan")
        loss = (w * factor).sum()
        scaler.scale(loss).backward()
        return loss

    opt.step(closure, grad_scaler=scaler)
    scaler.update()
    assert len(calls) == 2
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    assert scaler.get_scale() == pytest.approx(4.0)


def test_nan_gradient_without_scaler_raises():
    w = torch.tensor([1.0], requires_grad=True)
    opt = SAM([w], torch.optim.SGD, lr=0.1)
    w.grad = torch.tensor([float("nan")])
    with pytest.raises(FloatingPointError, match="gradient norm"):
        opt.first_step()
    assert torch.equal(w.detach(), torch.tensor([1.0]))


def test_wraps_an_existing_optimizer_and_shares_state():
    w = torch.tensor([1.0, -1.0], requires_grad=True)
    base = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt = SAM(None, base, rho=0.05)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(lambda: (w * w).sum().backward())
    assert "momentum_buffer" in base.state[w]
    sched.step()
    assert base.param_groups[0]["lr"] == pytest.approx(0.05)


def test_state_dict_round_trip_resumes_identically():
    def make():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        return model, SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)

    x, y = torch.randn(5, 3), torch.randn(5, 2)

    def closure_for(model):
        return lambda: F.mse_loss(model(x), y).backward()

    m1, o1 = make()
    for _ in range(2):
        o1.step(closure_for(m1))
    sd_model, sd_opt = copy.deepcopy(m1.state_dict()), copy.deepcopy(o1.state_dict())
    o1.step(closure_for(m1))

    m2, o2 = make()
    m2.load_state_dict(sd_model)
    o2.load_state_dict(sd_opt)
    assert o2.state is o2.base_optimizer.state
    o2.step(closure_for(m2))
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rho": -0.1}, "rho"), ({"rho": float("nan")}, "rho"), ({"eps": 0.0}, "eps")],
)
def test_bad_config_is_rejected(kwargs, match):
    w = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        SAM([w], torch.optim.SGD, lr=0.1, **kwargs)
    with pytest.raises(ValueError, match="rho=-0.5 of param group 1"):  # was accepted: e pointed downhill
        SAM([{"params": [w]}, {"params": [torch.zeros(1, requires_grad=True)], "rho": -0.5}], torch.optim.SGD, lr=0.1)


def test_unknown_base_name_lists_valid_names_and_step_needs_closure():
    w = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="valid"):
        SAM([w], "nope", lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        SAM([w], "sgd", lr=0.1).step()
    other = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="params"):
        SAM([other], torch.optim.SGD([w], lr=0.1))


def test_closure_error_in_second_pass_restores_weights_and_next_step_works():
    """Before: an exception in the perturbed pass (e.g. an OOM the loop catches) left w at
    w + e for good, and every later step() raised "first_step called twice"."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = SAM([w], torch.optim.SGD, rho=0.5, lr=0.1)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        loss = (w * w).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="simulated"):
        opt.step(failing)
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    # the next step is a normal SAM step: g = 2w, e = 0.5 g/|g|, w <- w - 0.1 * 2 (w + e)
    opt.step(lambda: (w * w).sum().backward())
    w0 = torch.tensor([1.0, 2.0])
    expected = w0 - 0.1 * 2 * (w0 + 0.5 * w0 / w0.norm())
    torch.testing.assert_close(w.detach(), expected)
