"""Late-phase SAM: where the switch happens, momentum restart, closure-free base steps, resume."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from echotrain.optim.sam import SAM
from echotrain.optim.late_sam import LateSAM, resolve_sam_start


def _setup(sam_start, unit="step", **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = LateSAM(model.parameters(), torch.optim.SGD, sam_start=sam_start, sam_start_unit=unit,
                  lr=0.1, momentum=0.9, rho=0.05, **kwargs)
    calls = []

    def closure():
        calls.append(opt.steps_taken)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    closure.data = (x, y)
    return model, opt, closure, calls


def test_switch_happens_at_the_configured_step_and_not_before():
    _, opt, closure, calls = _setup(5)
    for _ in range(8):
        opt.step(closure)
    # one closure call per base step (steps 0..4), two per SAM step (5, 6, 7)
    assert calls == [0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 7]
    assert [opt.sam_active(t) for t in (0, 4, 5, 7)] == [False, False, True, True]


@pytest.mark.parametrize(
    ("sam_start", "unit", "kwargs", "expected"),
    [
        (5, "step", {}, 5),
        (3, "epoch", {"steps_per_epoch": 4}, 12),
        (0.875, "fraction", {"total_steps": 200}, 175),
        (0.85, "fraction", {"total_steps": 100}, 85),
        (0.29, "fraction", {"total_steps": 100}, 29),  # 0.29 * 100 = 28.999999999999996 in binary
        (0.0, "fraction", {"total_steps": 10}, 0),
        (1.0, "fraction", {"total_steps": 10}, 10),
    ],
)
def test_resolve_sam_start(sam_start, unit, kwargs, expected):
    assert resolve_sam_start(sam_start, unit, **kwargs) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((5, "minute"), "valid"),
        ((0.5, "fraction"), "total_steps"),
        ((1.5, "fraction", 10), r"\[0, 1\]"),
        ((2, "epoch"), "steps_per_epoch"),
        ((-1, "step"), "non-negative"),
        ((2.5, "step"), "integer"),
        ((float("nan"), "step"), "finite"),  # was a bare "cannot convert float NaN to integer"
        ((float("inf"), "epoch", None, 4), "finite"),  # was an OverflowError
        ((2, "epoch", None, 2.5), "steps_per_epoch=2.5 must be an integer"),  # returned 5.0
        ((0.5, "fraction", 10.5), "total_steps=10.5 must be an integer"),
    ],
)
def test_resolve_sam_start_rejects_bad_config(args, match):
    with pytest.raises(ValueError, match=match):
        resolve_sam_start(*args)


def test_epoch_unit_switches_at_first_step_of_that_epoch():
    _, opt, closure, calls = _setup(2, "epoch", steps_per_epoch=3)
    for _ in range(7):
        opt.step(closure)
    assert calls == [0, 1, 2, 3, 4, 5, 6, 6]


def test_before_switch_equals_plain_sgd_and_after_equals_sam():
    # Reference: plain SGD for 3 steps, then SAM around a fresh SGD (momentum restarted).
    model, opt, closure, _ = _setup(3)
    ref = copy.deepcopy(model)
    x, y = closure.data
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        sgd.zero_grad()
        F.mse_loss(ref(x), y).backward()
        sgd.step()
    sam = SAM(ref.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    for _ in range(2):
        sam.step(lambda: F.mse_loss(ref(x), y).backward())
    for _ in range(5):
        opt.step(closure)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def _sam_gradient(model, x, y, rho=0.05):
    """g_sam at the current weights, computed by hand on a copy."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    g = torch.autograd.grad(F.mse_loss(m(x), y), params)
    norm = torch.sqrt(sum((gi * gi).sum() for gi in g))
    with torch.no_grad():
        for p, gi in zip(params, g):
            p.add_(rho * gi / norm)
    return torch.autograd.grad(F.mse_loss(m(x), y), params)


@pytest.mark.parametrize("restart", [True, False])
def test_momentum_buffer_at_the_switch(restart):
    model, opt, closure, _ = _setup(2, restart_momentum=restart)
    x, y = closure.data
    opt.step(closure)
    opt.step(closure)
    old = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    g_sam = _sam_gradient(model, x, y)
    opt.step(closure)  # the first SAM step
    for p, b0, g in zip(model.parameters(), old, g_sam):
        expected = g if restart else 0.9 * b0 + g  # torch SGD: a fresh buffer starts at g
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], expected)
    assert opt.momentum_restarted is restart


def test_base_phase_accepts_step_without_closure_sam_phase_requires_it():
    model, opt, _, _ = _setup(1)
    F.mse_loss(model(torch.ones(2, 3)), torch.zeros(2, 1)).backward()
    opt.step()
    assert opt.steps_taken == 1
    with pytest.raises(ValueError, match="closure is required from step 1"):
        opt.step()


def test_state_dict_keeps_the_step_counter():
    model, opt, closure, _ = _setup(4)
    for _ in range(3):
        opt.step(closure)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["late_sam"]["steps_taken"] == 3
    _, opt2, closure2, calls2 = _setup(4)
    opt2.load_state_dict(sd)
    opt2.step(closure2)
    opt2.step(closure2)
    assert calls2 == [3, 4, 4]


def test_registry_name_and_existing_optimizer_instance():
    w = torch.zeros(2, requires_grad=True)
    base = torch.optim.SGD([w], lr=0.1)
    opt = LateSAM(None, base, sam_start=0)
    assert opt.base_optimizer is base and opt.sam_active()
    opt2 = LateSAM([torch.zeros(1, requires_grad=True)], "sgd", sam_start=3, lr=0.1)
    assert isinstance(opt2.base_optimizer, torch.optim.SGD) and not opt2.sam_active()


def test_grad_scaler_in_both_phases_matches_unscaled_run():
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    scaled_model, scaled, _, _ = _setup(2)
    plain_model, plain, plain_closure, _ = _setup(2)
    x, y = plain_closure.data

    def scaled_closure():
        loss = F.mse_loss(scaled_model(x), y)
        scaler.scale(loss).backward()
        return loss

    for _ in range(4):  # 2 SGD steps, 2 SAM steps
        scaled.step(scaled_closure, grad_scaler=scaler)
        scaler.update()
        plain.step(plain_closure)
    for p, q in zip(scaled_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q)
    assert scaler.get_scale() == pytest.approx(64.0)


def test_adamw_base_by_keyword_restarts_all_its_state():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = LateSAM(model.parameters(), base_optimizer="adamw", sam_start=0.5, sam_start_unit="fraction",
                  total_steps=4, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    assert isinstance(opt.base_optimizer, torch.optim.AdamW) and opt.sam_start_step == 2
    closure = lambda: F.mse_loss(model(x), y).backward()  # noqa: E731
    for _ in range(3):
        opt.step(closure)
    # restarted at step 2: AdamW's own step count is 1, not 3
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())


def test_batchnorm_statistics_frozen_in_the_sam_phase():
    bn = nn.BatchNorm1d(1, momentum=0.1)
    model = nn.Sequential(bn, nn.Linear(1, 1))
    x = torch.tensor([[0.0], [2.0], [1.0], [1.0]])  # batch mean 1
    y = torch.zeros(4, 1)
    opt = LateSAM(model.parameters(), torch.optim.SGD, sam_start=1, lr=0.1, model=model)
    closure = lambda: F.mse_loss(model(x), y).backward()  # noqa: E731
    opt.step(closure)  # SGD step: one forward, running_mean 0.1
    opt.step(closure)  # SAM step: only its first forward counts, 0.9 * 0.1 + 0.1 = 0.19
    assert bn.running_mean.item() == pytest.approx(0.19, abs=1e-6)
    assert bn.num_batches_tracked.item() == 2


def test_resume_after_the_switch_matches_an_uninterrupted_run():
    """The restored ``momentum_restarted`` flag keeps a resumed run from clearing the momentum
    a second time (the first test resumes before the switch only)."""
    model, opt, closure, _ = _setup(2)
    for _ in range(3):  # steps 0, 1 SGD; step 2 SAM (momentum restarted)
        opt.step(closure)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for _ in range(2):
        opt.step(closure)
    model2, opt2, closure2, _ = _setup(2)
    model2.load_state_dict(sd_model)
    opt2.load_state_dict(sd_opt)
    assert opt2.momentum_restarted and opt2.steps_taken == 3
    for _ in range(2):
        opt2.step(closure2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
