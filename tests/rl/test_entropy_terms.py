"""The entropy terms (echotrain.rl.entropy): hand values, verl's agg_loss parity for the
``entropy_coeff`` bonus, exactness over a random micro-batch split, TRL's high-entropy mask and
the adaptive coefficient's rule."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import AGG_MODES, compute_step_stats
from echotrain.rl.entropy import adaptive_entropy_coef, applied_entropy_coef, entropy_bonus, high_entropy_mask


def _batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T) < torch.randint(0, T + 1, (B,), generator=g)[:, None]).double()
    mask[0] = 1.0
    ent = 3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).contiguous()
    gid = torch.arange(B) // 2
    return ent, mask, adv, gid


def _stats(mbs, mode):
    return compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode=mode, config={"norm_constant": 5}, dp_size=1)


def _mb(ent, mask, adv, gid, rows):
    return dict(old_log_prob=torch.zeros_like(ent[rows]), advantages=adv[rows], response_mask=mask[rows],
                group_index=gid[rows])


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("how", ["loss_agg_mode", "token-mean"])
def test_bonus_is_exact_over_a_random_micro_batch_split(mode, how):
    ent, mask, adv, gid = _batch()
    ent = ent.requires_grad_()
    whole = _stats([_mb(ent, mask, adv, gid, slice(None))], mode)
    full = entropy_bonus(ent, mask, whole, how, advantages=adv, group_index=gid)
    (g_full,) = torch.autograd.grad(full, ent)
    parts = [torch.tensor([3, 0]), torch.tensor([5]), torch.tensor([1, 4, 2])]
    split = _stats([_mb(ent.detach(), mask, adv, gid, r) for r in parts], mode)
    total = sum(entropy_bonus(ent[r], mask[r], split, how, advantages=adv[r], group_index=gid[r]) for r in parts)
    (g_split,) = torch.autograd.grad(total, ent)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_split, g_full)


def test_token_mean_bonus_hand_value_and_verl_parity():
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.ones(2, 3, dtype=torch.float64)
    gid = torch.tensor([0, 0])
    # TRL: the mean over valid tokens, whatever loss_agg_mode is
    for mode in ("token-mean", "seq-mean-token-mean"):
        st = _stats([_mb(ent, mask, adv, gid, slice(None))], mode)
        assert float(entropy_bonus(ent, mask, st, "token-mean")) == pytest.approx(2.0)
    # verl: agg_loss(entropy, mask, loss_agg_mode): seq-mean-token-mean = mean(1.5, 3) = 2.25
    st = _stats([_mb(ent, mask, adv, gid, slice(None))], "seq-mean-token-mean")
    assert float(entropy_bonus(ent, mask, st, "loss_agg_mode")) == pytest.approx(2.25)
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        st = _stats([_mb(ent, mask, adv, gid, slice(None))], mode)
        ref = core_algos.agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=mode)
        assert float(entropy_bonus(ent, mask, st, "loss_agg_mode")) == pytest.approx(float(ref))


def test_high_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    ent = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.7, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # valid entropies 0.1, 0.3, 0.5, 0.7, 0.9; the 0.6 quantile (rho 0.4) is 0.58 -> 0.7, 0.9 kept
    assert high_entropy_mask(ent, mask, 0.4).tolist() == [[False, False, True, False], [False, True, False, False]]
    assert high_entropy_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()
    assert high_entropy_mask(ent, mask, 0.0).sum() == 1  # the highest valid one only
    assert not high_entropy_mask(ent, torch.zeros_like(mask), 0.2).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(ent, mask, 1.5)
    with pytest.raises(ValueError, match="entropy has 1 NaN/Inf"):
        high_entropy_mask(torch.tensor([[float("nan"), 1.0]]), torch.ones(1, 2), 0.5)


def test_adaptive_coefficient_rule():
    kw = dict(target=0.2, delta=0.05, coef_min=0.0, coef_max=0.12)
    assert adaptive_entropy_coef(0.1, 0.15, **kw) == pytest.approx(0.12)  # below target: up, capped
    assert adaptive_entropy_coef(0.1, 0.2, **kw) == pytest.approx(0.12)  # at target counts as below
    assert adaptive_entropy_coef(0.1, 0.5, **kw) == pytest.approx(0.05)  # above: down
    assert adaptive_entropy_coef(0.01, 0.5, **kw) == 0.0  # floored
    assert applied_entropy_coef(0.3, float("inf"), 0.2) == 0.0  # no entropy yet (TRL's first step)
    assert applied_entropy_coef(0.3, 0.1, 0.2) == 0.3 and applied_entropy_coef(0.3, 0.25, 0.2) == 0.0


def test_bonus_errors_name_the_argument():
    ent, mask, adv, gid = _batch()
    st = _stats([_mb(ent, mask, adv, gid, slice(None))], "token-mean")
    with pytest.raises(ValueError, match="how="):
        entropy_bonus(ent, mask, st, "seq")
    with pytest.raises(ValueError, match="response_mask has shape"):
        entropy_bonus(ent, mask[:, :2], st, "token-mean")
    bad = ent.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="entropy has 1 NaN/Inf"):
        entropy_bonus(bad, mask, st, "token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "balanced"])
@pytest.mark.parametrize("how", ["loss_agg_mode", "token-mean"])
def test_bonus_over_two_simulated_ranks_is_the_whole_steps_after_ddp_averaging(mode, how):
    """Each rank's bonus carries dp_size, so DDP's average over ranks (the sum / 2 here) is the
    single-process bonus of the whole step, value and gradient."""
    ent, mask, adv, gid = _batch(seed=3)
    ent = ent.requires_grad_()
    whole = _stats([_mb(ent.detach(), mask, adv, gid, slice(None))], mode)
    full = entropy_bonus(ent, mask, whole, how, advantages=adv, group_index=gid)
    (g_full,) = torch.autograd.grad(full, ent)
    ranks = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])]  # whole groups per rank
    # the step statistics after the all-reduce: the sums of both ranks' micro-batches, dp_size 2
    both = compute_step_stats([_mb(ent.detach(), mask, adv, gid, r) for r in ranks], loss_mode="vanilla",
                              loss_agg_mode=mode, config={"norm_constant": 5}, dp_size=2)
    avg = sum(entropy_bonus(ent[r], mask[r], both, how, advantages=adv[r], group_index=gid[r]) for r in ranks) / 2
    (g_avg,) = torch.autograd.grad(avg, ent)
    torch.testing.assert_close(avg, full)
    torch.testing.assert_close(g_avg, g_full)


def test_token_mean_bonus_ignores_masked_entropies_even_if_non_finite_there():
    """Tokens outside the mask add nothing (a NaN/Inf there neither raises nor leaks into the value or gradient)."""
    ent = torch.tensor([[1.0, float("nan")], [3.0, 1e6]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    st = _stats([_mb(ent.detach(), mask, torch.ones(2, 2, dtype=torch.float64), torch.tensor([0, 0]), slice(None))],
                "token-mean")
    h = entropy_bonus(ent, mask, st, "token-mean")
    assert float(h.detach()) == pytest.approx(2.0)
    (grad,) = torch.autograd.grad(h, ent)
    assert grad.tolist() == [[0.5, 0.0], [0.5, 0.0]]


def test_applied_coefficient_at_the_target_counts_as_below():
    """Skywork-OR1 / TRL: the bonus applies when the last entropy is <= the target (equality included)."""
    assert applied_entropy_coef(0.3, 0.2, 0.2) == 0.3


def test_keeping_every_token_returns_a_new_mask():
    """At top_entropy_quantile=1 the result is every valid token, as a new tensor: changing it in place leaves the
    caller's (bool) response_mask alone."""
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = high_entropy_mask(torch.rand(2, 3), mask, 1.0)
    assert out.tolist() == mask.tolist() and out.data_ptr() != mask.data_ptr()
    out[0, 0] = False
    assert mask[0, 0]
