"""Exact micro-batching and data parallelism: accumulated gradients equal the single-batch one.

The cases enumerate the registries: every registered policy loss (POLICY_LOSSES, a plugin's too:
ECHOTRAIN_TEST_PLUGINS, tests/conftest.py) with the base config, times every aggregation mode
(AGG_MODES), plus the config variants below for the built-in losses' open choices. A loss
registered ``exact="<why not>"`` is checked for what it declares instead: exact with one
micro-batch (any loss is), finite gradients under any split."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import (
    AGG_MODES,
    POLICY_LOSSES,
    compute_policy_loss,
    compute_step_stats,
    needs_log_prob_prepass,
    shard_batch,
    split_micro_batches,
)

BASE_CFG = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "norm_constant": 9.0}

# ECHO variants: in band, batch clip firing (geo / arith / detached kappa), dual-clip on top.
ECHO_CASES = [
    ("echo-inband", dict(batch_clip_low=0.5, batch_clip_high=0.5)),
    ("echo-geo-clipped", dict(batch_ratio="geo")),
    ("echo-arith-clipped", dict(batch_ratio="arith")),
    ("echo-detached", dict(detach_kappa=True)),
    ("echo-dualclip", dict(clip_ratio_c=1.5)),
]
#: extra config variants of built-in losses (their open choices); every loss also runs with BASE_CFG
VARIANTS = {"echo": ECHO_CASES, "vanilla": [("vanilla-dualclip", dict(clip_ratio_c=1.5))]}
CASES = [c for m in POLICY_LOSSES for c in ([(m, m, {})] if m not in VARIANTS else [])
         + [(m, n, o) for n, o in VARIANTS.get(m, [])]]


def _exact(loss_mode: str) -> bool:
    return POLICY_LOSSES.info(loss_mode)["exact"] is True


def _prepass(loss_mode: str) -> bool:
    stats = POLICY_LOSSES.info(loss_mode)["step_stats"]
    return stats is not None and stats.needs_log_prob


def _cfg(overrides):
    return {**BASE_CFG, **overrides}


def _oracle_grad(batch, loss_mode, agg, cfg):
    log_prob = batch["log_prob"].detach().clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        loss_mode, batch["old_log_prob"], log_prob, batch["advantages"], batch["response_mask"], agg, cfg,
        group_index=batch["group_index"],
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def _accumulate(mbs, loss_mode, agg, cfg, step):
    """The trainer loop of the stepwise docstring; returns (sum of losses, grads per mb)."""
    total, grads = 0.0, []
    for mb in mbs:
        lp = mb["log_prob"].detach().clone().requires_grad_(True)
        loss, _ = compute_policy_loss(
            loss_mode, mb["old_log_prob"], lp, mb["advantages"], mb["response_mask"], agg, cfg,
            group_index=mb["group_index"], step=step,
        )
        loss.backward()
        total += float(loss.detach())
        grads.append(lp.grad)
    return total, torch.cat(grads)


def _drifted_batch(batch_factory, seed, B=12, dtype=torch.float64):
    # drift -0.1 puts ECHO's geo and arith R near 0.9-0.92, below the default band: the batch clip fires.
    return batch_factory(seed=seed, B=B, T=6, group_size=4, drift=-0.1, noise=0.2, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode,name,overrides", CASES, ids=[c[1] for c in CASES])
def test_random_micro_batch_split_matches_single_batch(batch_factory, loss_mode, name, overrides, agg, dtype, tol):
    cfg = _cfg(overrides)
    batch = _drifted_batch(batch_factory, seed=3, dtype=dtype)
    ref_loss, ref_grad, ref_metrics = _oracle_grad(batch, loss_mode, agg, cfg)
    if name.endswith("clipped") or name in ("echo-detached", "echo-dualclip"):
        assert ref_metrics["echo/batch_clipped"] == 1.0  # the case really exercises the batch clip
    if name == "echo-inband":
        assert ref_metrics["echo/batch_clipped"] == 0.0
    g = torch.Generator().manual_seed(7)
    for _ in range(2):  # two random splits, sizes may be 0
        cuts = sorted(torch.randint(0, 13, (3,), generator=g).tolist())
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [12])]
        mbs = split_micro_batches(batch, sizes)
        assert needs_log_prob_prepass(loss_mode) == _prepass(loss_mode)
        step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)
        total, grad = _accumulate(mbs, loss_mode, agg, cfg, step)
        if not _exact(loss_mode):  # declared inexact under splits: finite, and exact as one micro-batch
            assert torch.isfinite(grad).all()
            (whole,) = split_micro_batches(batch, [12])
            one = compute_step_stats([whole], loss_mode=loss_mode, loss_agg_mode=agg, config=cfg)
            torch.testing.assert_close(_accumulate([whole], loss_mode, agg, cfg, one)[1], ref_grad, rtol=0, atol=tol)
            continue
        assert total == pytest.approx(float(ref_loss), abs=tol)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=tol)


def _run_ranks(run_ranks, batch, loss_mode, agg, cfg, world=2, mb_size=2, dp_size=None):
    """Each simulated rank: shard -> micro-batches -> step stats (thread all-reduce) -> backward."""
    out: dict[int, torch.Tensor] = {}

    def work(rank, reducer):
        mbs = split_micro_batches(shard_batch(batch, rank, world), mb_size)
        step = compute_step_stats(
            mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=cfg, reduce_fn=reducer.for_rank(rank), dp_size=dp_size
        )
        out[rank] = _accumulate(mbs, loss_mode, agg, cfg, step)[1]

    run_ranks(world, work)
    return torch.cat([out[r] for r in range(world)])


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode,name,overrides", CASES, ids=[c[1] for c in CASES])
def test_two_simulated_ranks_match_single_batch(batch_factory, run_ranks, loss_mode, name, overrides, agg):
    if not _exact(loss_mode):
        pytest.skip(f"loss_mode={loss_mode!r} declares it is not exact under splits: "
                    f"{POLICY_LOSSES.info(loss_mode)['exact']}")
    cfg = _cfg(overrides)
    # shard 0 holds groups 0 and half of group 1 -> groups straddle ranks.
    batch = _drifted_batch(batch_factory, seed=5)
    _, ref_grad, _ = _oracle_grad(batch, loss_mode, agg, cfg)
    grad = _run_ranks(run_ranks, batch, loss_mode, agg, cfg)  # ranks' grads summed (dp_size=1)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)


ECHO_FLAG_CASES = [
    ("geo-pessimistic-ppo", dict(batch_ratio="geo", echo_pessimistic=True)),
    ("arith-pessimistic-none", dict(batch_ratio="arith", echo_pessimistic=True, echo_token_clip="none")),
    ("geo-truncate", dict(batch_ratio="geo", echo_token_clip="truncate", echo_token_cap=1.1)),
    ("arith-pessimistic-truncate", dict(batch_ratio="arith", echo_pessimistic=True, echo_token_clip="truncate",
                                        echo_token_cap=1.1)),
]


@pytest.mark.parametrize("agg", ["token-mean", "balanced"])
@pytest.mark.parametrize("name,overrides", ECHO_FLAG_CASES, ids=[c[0] for c in ECHO_FLAG_CASES])
def test_two_simulated_ranks_match_single_batch_for_echo_flags(batch_factory, run_ranks, name, overrides, agg):
    """ECHO's open-choice flags (tests/rl/test_rl_echo_flags.py) stay exact across ranks too."""
    cfg = _cfg(overrides)
    batch = _drifted_batch(batch_factory, seed=5)
    _, ref_grad, ref_metrics = _oracle_grad(batch, "echo", agg, cfg)
    assert ref_metrics["echo/batch_clipped"] == 1.0
    grad = _run_ranks(run_ranks, batch, "echo", agg, cfg)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)


def test_dp_size_makes_ddp_average_exact(batch_factory, run_ranks):
    """DDP averages rank gradients: with dp_size=world the average is the global gradient."""
    cfg = _cfg({"batch_ratio": "geo"})
    batch = _drifted_batch(batch_factory, seed=11)
    _, ref_grad, _ = _oracle_grad(batch, "echo", "balanced", cfg)
    # Each rank's rows only get that rank's gradient; DDP's average over 2 ranks is grad / 2.
    grad = _run_ranks(run_ranks, batch, "echo", "balanced", cfg, dp_size=2) / 2
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)


def test_step_for_other_mode_is_rejected(batch_factory):
    batch = batch_factory()
    step = compute_step_stats([batch], loss_mode="vanilla", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="loss_mode='vanilla'"):
        compute_policy_loss("gspo", batch["old_log_prob"], batch["log_prob"], batch["advantages"],
                            batch["response_mask"], "token-mean", step=step)
    with pytest.raises(ValueError, match="loss_agg_mode='token-mean'"):
        compute_policy_loss("vanilla", batch["old_log_prob"], batch["log_prob"], batch["advantages"],
                            batch["response_mask"], "seq-mean-token-mean", step=step)


def test_echo_step_needs_prepass_log_prob(batch_factory):
    batch = batch_factory()
    del batch["log_prob"]
    with pytest.raises(ValueError, match="pre-pass log_prob"):
        compute_step_stats([batch], loss_mode="echo", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="group_index"):
        b = batch_factory()
        del b["group_index"]
        compute_step_stats([b], loss_mode="vanilla", loss_agg_mode="balanced")


def test_registry_covers_the_four_losses():
    assert set(POLICY_LOSSES) >= {"vanilla", "gspo", "gspo_token", "echo"}


def test_split_and_shard_errors(batch_factory):
    batch = batch_factory()
    with pytest.raises(ValueError, match="sum to the batch size"):
        split_micro_batches(batch, [3, 3])
    with pytest.raises(ValueError, match="rank must be"):
        shard_batch(batch, 2, 2)
    assert [mb["old_log_prob"].shape[0] for mb in split_micro_batches(batch, 3)] == [3, 3, 2]


def _gloo_worker(rank, world, init_file, out_file):
    import torch.distributed as dist

    from echotrain.rl import compute_policy_loss, compute_step_stats, shard_batch, split_micro_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batch = torch.load(out_file + ".in")
        mbs = split_micro_batches(shard_batch(batch, rank, world), 2)
        cfg = _cfg({"batch_ratio": "geo"})
        step = compute_step_stats(mbs, loss_mode="echo", loss_agg_mode="balanced", config=cfg)  # real all_reduce
        assert step.dp_size == world
        grads = []
        for mb in mbs:
            lp = mb["log_prob"].detach().clone().requires_grad_(True)
            loss, _ = compute_policy_loss("echo", mb["old_log_prob"], lp, mb["advantages"], mb["response_mask"],
                                          "balanced", cfg, group_index=mb["group_index"], step=step)
            loss.backward()
            grads.append(lp.grad)
        # What DDP does to a parameter gradient: all-reduce SUM then divide by the world size.
        full = torch.zeros_like(batch["log_prob"])
        rows = torch.tensor_split(torch.arange(full.shape[0]), world)[rank]
        full[rows] = torch.cat(grads)
        dist.all_reduce(full)
        if rank == 0:
            torch.save(full / world, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="torch.distributed gloo backend not available")
def test_real_gloo_two_processes(batch_factory, tmp_path):
    """torch.distributed (gloo, 2 processes): ECHO + balanced, DDP-style averaging, exact."""
    import torch.multiprocessing as mp

    batch = _drifted_batch(batch_factory, seed=13)
    cfg = _cfg({"batch_ratio": "geo"})
    _, ref_grad, ref_metrics = _oracle_grad(batch, "echo", "balanced", cfg)
    assert ref_metrics["echo/batch_clipped"] == 1.0
    out = str(tmp_path / "grad.pt")
    torch.save({k: v.detach() for k, v in batch.items()}, out + ".in")
    mp.start_processes(_gloo_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True, start_method="fork")
    torch.testing.assert_close(torch.load(out), ref_grad, rtol=0, atol=1e-10)


def test_group_ids_must_be_small_dense_integers(batch_factory):
    batch = batch_factory()
    batch["group_index"] = batch["group_index"] + 10**9
    with pytest.raises(ValueError, match="small dense integers"):
        compute_step_stats([batch], loss_mode="vanilla", loss_agg_mode="balanced")
    ok = batch_factory()
    step = compute_step_stats([ok], loss_mode="vanilla", loss_agg_mode="balanced")
    with pytest.raises(ValueError, match="ids must lie in"):
        compute_policy_loss("vanilla", ok["old_log_prob"], ok["log_prob"], ok["advantages"], ok["response_mask"],
                            "balanced", group_index=ok["group_index"] - 1, step=step)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("ba_scope", ["group", "batch"])
def test_step_agg_loss_of_an_extra_term_sums_to_the_full_batch_value(batch_factory, agg, ba_scope):
    from echotrain.rl import agg_loss, kl_penalty, step_agg_loss

    cfg = {**BASE_CFG, "ba_scope": ba_scope}
    batch = _drifted_batch(batch_factory, seed=17)
    ref_lp = batch["old_log_prob"] + 0.1
    kl = kl_penalty(batch["log_prob"].detach(), ref_lp, "k3")
    full = agg_loss(kl, batch["response_mask"], agg, advantages=batch["advantages"], group_index=batch["group_index"],
                    norm_constant=BASE_CFG["norm_constant"], ba_scope=ba_scope)
    mbs = split_micro_batches({**batch, "kl": kl}, [5, 0, 7])
    step = compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode=agg, config=cfg)
    total = sum(step_agg_loss(mb["kl"], mb["response_mask"], step, cfg, advantages=mb["advantages"],
                              group_index=mb["group_index"]).item() for mb in mbs)
    assert total == pytest.approx(full.item(), abs=1e-12)
    assert full.item() > 0


def test_step_rejects_another_config_and_bad_dp_size(batch_factory):
    """A step computed with one config and used with another gave a silently wrong ECHO
    gradient (kappa from geo R, gradient share as arith); now an error naming both configs."""
    batch = _drifted_batch(batch_factory, seed=3)
    geo, arith = _cfg({"batch_ratio": "geo"}), _cfg({"batch_ratio": "arith"})
    step = compute_step_stats([batch], loss_mode="echo", loss_agg_mode="token-mean", config=geo)
    assert step.config.batch_ratio == "geo" and step.loss_stats.clipped
    args = (batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"], "token-mean")
    with pytest.raises(ValueError, match="step was computed with config"):
        compute_policy_loss("echo", *args, arith, step=step)
    loss, m = compute_policy_loss("echo", *args, geo, step=step)
    assert m["echo/R_batch"] == step.loss_stats.R
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
            compute_step_stats([batch], loss_mode="vanilla", loss_agg_mode="token-mean", dp_size=bad)


def test_step_agg_loss_balanced_needs_advantages_and_a_0_1_mask(batch_factory):
    """Without advantages, balanced weights were silently 0 (zeros substituted): the KL term vanished."""
    from echotrain.rl import agg_loss, step_agg_loss

    batch = batch_factory()
    kl = torch.ones_like(batch["old_log_prob"])
    step = compute_step_stats([batch], loss_mode="vanilla", loss_agg_mode="balanced")
    with pytest.raises(ValueError, match="needs advantages and group_index"):
        step_agg_loss(kl, batch["response_mask"], step, group_index=batch["group_index"])
    full = agg_loss(kl, batch["response_mask"], "balanced", advantages=batch["advantages"], group_index=batch["group_index"])
    out = step_agg_loss(kl, batch["response_mask"], step, advantages=batch["advantages"], group_index=batch["group_index"])
    assert out.item() == pytest.approx(full.item(), abs=1e-12) and out.item() > 0
    tm = compute_step_stats([batch], loss_mode="vanilla", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="response_mask must be boolean or hold only 0/1"):
        step_agg_loss(kl, batch["response_mask"] * 0.5, tm)
    with pytest.raises(ValueError, match="differs from the one step was computed with"):
        step_agg_loss(kl, batch["response_mask"], tm, {"clip_ratio_high": 0.28})
