"""The registries of echotrain.rl: one decorator adds a piece, every name list is a live view,
and a policy loss's declared step statistics are run by compute_step_stats without a branch."""

from __future__ import annotations

import math

import pytest
import torch

import echotrain.rl as rl
from echotrain.rl.advantages import ADV_ESTIMATOR_REGISTRY
from echotrain.rl.aggregation import AGG_MODE_REGISTRY, AggInputs
from echotrain.rl.kl import KL_ESTIMATOR_REGISTRY
from echotrain.rl.registry import Registry
from echotrain.rl.step import LossStepStats, StepBatch


@pytest.fixture
def cleanup():
    """Unregister what a test registered, even when it fails."""
    added: list[tuple[Registry, str]] = []
    yield added
    for registry, name in added:
        if name in registry:
            registry.unregister(name)


def test_names_view_behaves_like_the_tuple_and_follows_the_registry():
    reg: Registry[int] = Registry("thing", "thing_mode")
    names = reg.names()
    assert names == () and len(names) == 0
    reg.register("a")(1)
    reg.register("b", flag=True)(2)
    assert names == ("a", "b") and names == ["a", "b"] and names[1] == "b" and names[:1] == ("a",)
    assert "a" in names and "c" not in names and list(names) == ["a", "b"] and repr(names) == "('a', 'b')"
    assert names + ("c",) == ("a", "b", "c") and ("z",) + names == ("z", "a", "b")
    flagged = reg.names(lambda info: info.get("flag", False))
    assert flagged == ("b",)
    assert reg.info("b") == {"flag": True} and reg["a"] == 1
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")
    with pytest.raises(ValueError, match=r"thing_mode='c' is unknown; valid: \['a', 'b'\]"):
        reg.info("c")
    with pytest.raises(TypeError, match="non-empty str"):
        reg.register("")
    assert reg.unregister("a") == 1 and names == ("b",)


def test_a_registered_agg_mode_appears_in_agg_modes_and_aggregates(cleanup):
    """A toy mode w_i = 1 (plain sum of the valid token losses), registered after import."""

    @rl.register_agg_mode("toy-sum")
    def _toy(x: AggInputs) -> torch.Tensor:
        return (x.lengths > 0).to(torch.float64)

    cleanup.append((AGG_MODE_REGISTRY, "toy-sum"))
    assert "toy-sum" in rl.AGG_MODES and rl.AGG_MODES[-1] == "toy-sum"
    loss_mat = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert float(rl.agg_loss(loss_mat, mask, "toy-sum")) == 1 + 2 + 8
    # the trainer's config validation reads the same live view
    from echotrain.train.config import TrainConfig, validate

    validate(TrainConfig(loss_agg_mode="toy-sum"))


def test_a_registered_kl_estimator_and_adv_estimator_are_usable(cleanup):
    @rl.register_kl_estimator("abs")
    def _abs(x: torch.Tensor, clamp: float) -> torch.Tensor:
        return x.clamp(-clamp, clamp).abs()

    @rl.register_adv_estimator("centred_x2")
    def _x2(g) -> torch.Tensor:
        return 2 * g.centred

    cleanup += [(KL_ESTIMATOR_REGISTRY, "abs"), (ADV_ESTIMATOR_REGISTRY, "centred_x2")]
    assert "abs" in rl.KL_ESTIMATORS and "centred_x2" in rl.ADV_METHODS
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert rl.kl_penalty(lp, ref, "abs").tolist() == [[0.5, 1.0]]
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    assert rl.compute_advantages(rewards, groups, "centred_x2").tolist() == pytest.approx(
        [4 / 3, -2 / 3, -2 / 3, -4 / 3, 2 / 3, 2 / 3])


def _toy_local_sums(mb: StepBatch, cfg) -> torch.Tensor:
    # sum of (log_prob - old_log_prob) over valid tokens: the step's total log-ratio
    return torch.where(mb.response_mask, mb.log_prob - mb.old_log_prob, 0).sum(dtype=torch.float64).reshape(1)


def _toy_finish(sums, mbs, step, reduce_fn):
    return float(sums[0]) / step.num_tokens


TOY_STATS = LossStepStats(needs_log_prob=True, num_sums=1, local_sums=_toy_local_sums, finish=_toy_finish)


def test_a_loss_declares_its_step_statistics_and_stepwise_runs_them(cleanup):
    """A toy loss l = -A * rho * c, c = the step's mean log-ratio (from its declared statistics):
    compute_step_stats asks for the pre-pass log_prob, sums in the single all-reduce, and hands
    the result to the loss as step.loss_stats."""

    @rl.register_policy_loss("toy_mean_lr", step_stats=TOY_STATS)
    def _toy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, *,
                  group_index=None, step=None):
        c = step.loss_stats
        mat = -advantages[:, None] * torch.exp(log_prob - old_log_prob) * c
        return rl.agg_loss(mat, response_mask, loss_agg_mode, **step.agg_kwargs(step.config)), {}

    cleanup.append((rl.POLICY_LOSSES, "toy_mean_lr"))
    assert "toy_mean_lr" in rl.PREPASS_LOSS_MODES and rl.needs_log_prob_prepass("toy_mean_lr")
    assert not rl.needs_log_prob_prepass("vanilla")
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[1.0, 0.5, 0.5], [0.25, 0.5, 0.5]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mbs = rl.split_micro_batches({"old_log_prob": old, "log_prob": lp, "advantages": adv, "response_mask": mask}, 1)
    with pytest.raises(ValueError, match="toy_mean_lr needs the no-grad pre-pass log_prob"):
        rl.compute_step_stats([{k: v for k, v in mbs[0].items() if k != "log_prob"}], loss_mode="toy_mean_lr",
                              loss_agg_mode="token-mean")
    calls = []

    def reduce_fn(t, op):
        calls.append((op, t.tolist()))
        return t

    step = rl.compute_step_stats(mbs, loss_mode="toy_mean_lr", loss_agg_mode="token-mean", reduce_fn=reduce_fn)
    # log-ratios at valid tokens: ln 2, ln 2, ln 0.5 -> mean ln 2 / 3
    assert step.num_tokens == 3 and step.loss_stats == pytest.approx(math.log(2) / 3)
    assert calls == [("sum", pytest.approx([3.0, 2.0, math.log(2)]))]  # counts and the loss's sum: one round
    loss, _ = rl.compute_policy_loss("toy_mean_lr", mbs[0]["old_log_prob"], mbs[0]["log_prob"], mbs[0]["advantages"],
                                     mbs[0]["response_mask"], "token-mean", step=step)
    # row 0: -(+1) * (2 + 2) * c / 3 tokens
    assert float(loss) == pytest.approx(-4 * (math.log(2) / 3) / 3)
