"""Optimizers as data (the registry entries) and the one LR-schedule module (issue 11, item 4)."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.optim.late_sam import LateSAM
from echotrain.optim.registry import (
    OPTIMIZERS,
    base_optimizer_names,
    build_from_settings,
    optimizer_spec,
    register_optimizer,
)
from echotrain.optim.sam import SAM
from echotrain.optim.schedules import LR_DECAYS, step_decay, warmup_decay

SETTINGS = dict(lr=0.1, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6, fused=True, rho=0.2, model=None, sam_start=0.5,
                sam_start_unit="fraction", total_steps=8, restart_momentum=False)


def test_entries_say_which_wrap_a_base_and_what_they_take():
    assert base_optimizer_names() == ["adamw", "adamw4bit", "sgd"]
    assert [n for n, s in OPTIMIZERS.items() if s.wraps_base] == ["sam", "late_sam"]
    assert optimizer_spec("adamw").takes == ("betas", "eps", "fused") and optimizer_spec("sgd").takes == ()
    assert optimizer_spec("late_sam").load() is LateSAM
    with pytest.raises(ValueError, match="optimizer='adam' is unknown"):
        optimizer_spec("adam")


def test_build_from_settings_passes_only_declared_keys():
    w = torch.zeros(3, requires_grad=True)
    opt = build_from_settings("adamw", [w], SETTINGS, base="sgd")  # base ignored: adamw wraps nothing
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["betas"], g["eps"], g["fused"]) == (0.1, 0.01, (0.8, 0.9), 1e-6, True)
    sgd = build_from_settings("sgd", [torch.zeros(1, requires_grad=True)], SETTINGS)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0


def test_wrapping_optimizers_get_their_base_and_its_settings():
    w = torch.zeros(3, requires_grad=True)
    sam = build_from_settings("sam", [w], SETTINGS, base="adamw")
    assert type(sam) is SAM and isinstance(sam.base_optimizer, torch.optim.AdamW)
    assert sam.param_groups[0]["rho"] == 0.2 and sam.param_groups[0]["betas"] == (0.8, 0.9)
    assert sam.base_optimizer.param_groups[0]["fused"] is True
    # "eps" is also SAM's own argument, so it lands there (as before issue 11), not on the base
    assert sam.eps == 1e-6 and sam.param_groups[0]["eps"] == 1e-8
    late = build_from_settings("late_sam", [torch.zeros(1, requires_grad=True)], SETTINGS, base="sgd")
    assert isinstance(late.base_optimizer, torch.optim.SGD)
    assert late.sam_start_step == 4 and late.restart_momentum is False and "betas" not in late.param_groups[0]
    with pytest.raises(ValueError, match="needs a base optimizer"):
        build_from_settings("sam", [w], SETTINGS, base="late_sam")
    with pytest.raises(ValueError, match=r"settings lack \['rho'\]"):
        build_from_settings("sam", [w], {k: v for k, v in SETTINGS.items() if k != "rho"}, base="sgd")


def test_a_registered_optimizer_is_a_valid_trainer_setting(monkeypatch):
    """One register_optimizer call makes a name valid for optimizer= and sam_base= (no other edits)."""
    from echotrain.train.config import ConfigError, resolve_config

    with OPTIMIZERS.restoring():
        _register_rmsprop_and_train_with_it(ConfigError, resolve_config)
    assert "rmsprop" not in OPTIMIZERS


def _register_rmsprop_and_train_with_it(ConfigError, resolve_config):
    with pytest.raises(ConfigError, match="sam_base"):
        resolve_config(overrides={"optimizer": "sam", "sam_base": "rmsprop"})
    register_optimizer("rmsprop", "torch.optim:RMSprop", takes=("momentum",))
    cfg = resolve_config(overrides={"optimizer": "sam", "sam_base": "rmsprop"})
    opt = build_from_settings(cfg.optimizer, [torch.zeros(1, requires_grad=True)], {**SETTINGS, "momentum": 0.5},
                              base=cfg.sam_base)
    assert isinstance(opt.base_optimizer, torch.optim.RMSprop) and opt.param_groups[0]["momentum"] == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer("rmsprop", "torch.optim:RMSprop")


def test_warmup_decay_values():
    # warm-up 4 of 20 steps: (u + 1) / 4, then frac = (u - 4) / 16
    assert [warmup_decay(u, 4, 20) for u in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_decay(12, 4, 20, "linear") == 0.5 and warmup_decay(30, 4, 20, "linear") == 0.0
    assert warmup_decay(12, 4, 20, "cosine") == pytest.approx(0.5, abs=1e-15)
    assert warmup_decay(8, 4, 20, "cosine", peak=2.0) == pytest.approx(1.0 + math.cos(math.pi / 4))
    assert warmup_decay(0, 0, 1, "cosine") == 1.0 and warmup_decay(5, 0, 1, "cosine") == 0.0  # clamped at the end
    assert set(LR_DECAYS) == {"constant", "linear", "cosine"}
    with pytest.raises(ValueError, match="decay='step'"):
        warmup_decay(0, 0, 10, "step")


def test_step_decay_is_the_wrn_schedule():
    assert [step_decay(e, 10) for e in (0, 2, 3, 5, 6, 9)] == [1.0, 1.0, 0.2, 0.2, 0.04, 0.04]
    assert step_decay(5, 10, milestones=(0.5,), factors=(1.0, 0.1)) == 0.1
    with pytest.raises(ValueError, match="one more entry"):
        step_decay(0, 10, milestones=(0.5,), factors=(1.0,))


def test_trainer_lr_lambda_uses_the_schedule():
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import lr_lambda

    cfg = resolve_config(overrides={"warmup_steps": 2, "lr_scheduler": "cosine"})
    f = lr_lambda(cfg, 10)
    assert [f(u) for u in range(11)] == [warmup_decay(u, 2, 10, "cosine") for u in range(11)]
    assert f(0) == 0.5 and f(6) == pytest.approx(0.5, abs=1e-15) and f(10) == 0.0


def test_old_import_paths_still_work():
    import echotrain.optim.schedules as schedules

    assert schedules.LateSAM is LateSAM and schedules.resolve_sam_start(2) == 2


def test_sharpness_has_one_import_path():
    """``echotrain.optim.sharpness`` only: the ``echotrain.sharpness`` alias module is gone, and
    no document names it."""
    import importlib.util
    from pathlib import Path

    from echotrain.optim import sharpness

    assert importlib.util.find_spec("echotrain.sharpness") is None
    assert callable(sharpness.top_hessian_eigenvalue)
    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "src").rglob("*.py"),
            *(root / "benchmarks").rglob("*.py")]
    assert [str(d) for d in docs if "echotrain.sharpness" in d.read_text(encoding="utf-8")] == []


def _adamw_step(opt, params, grad=1.0):
    for p in params:
        p.grad = torch.full_like(p, grad)
    opt.step()


def test_set_adamw_fused_switches_the_base_of_sam():
    """set_adamw_fused reaches the AdamW a SAM wraps (the wrapper is not an AdamW itself)."""
    from echotrain.optim.registry import set_adamw_fused

    sam = build_from_settings("sam", [torch.zeros(3, requires_grad=True)], dict(SETTINGS, fused=False), base="adamw")
    assert not sam.base_optimizer.param_groups[0]["fused"]
    set_adamw_fused(sam, True)
    assert sam.base_optimizer.param_groups[0]["fused"] is True
    set_adamw_fused(sam, False)
    assert not sam.base_optimizer.param_groups[0]["fused"]


def test_set_adamw_fused_on_moves_step_to_float32_and_clears_foreach():
    """Switching on: foreach is cleared (torch refuses fused with foreach), a parameter without
    state yet is left alone, and a kept ``step`` becomes a float32 tensor of the same value (here
    a float64 one); the next update then equals the unfused one."""
    from echotrain.optim.registry import set_adamw_fused

    ws = [torch.ones(4, requires_grad=True), torch.ones(2, requires_grad=True)]
    refs = [w.detach().clone().requires_grad_() for w in ws]
    opt = torch.optim.AdamW(ws, lr=0.1, foreach=True)
    ref = torch.optim.AdamW(refs, lr=0.1, foreach=False)
    for o, ps in ((opt, ws), (ref, refs)):  # one update of the first parameter only
        _adamw_step(o, ps[:1])
    opt.state[ws[0]]["step"] = opt.state[ws[0]]["step"].to(torch.float64)
    set_adamw_fused(opt, True)
    g = opt.param_groups[0]
    assert g["fused"] is True and g["foreach"] is None
    assert ws[1] not in opt.state  # no state was made for it
    step = opt.state[ws[0]]["step"]
    assert step.dtype == torch.float32 and step.device == ws[0].device and step.item() == 1.0
    _adamw_step(opt, ws, 0.5)
    _adamw_step(ref, refs, 0.5)
    for w, r in zip(ws, refs):
        torch.testing.assert_close(w, r, atol=1e-6, rtol=0)
