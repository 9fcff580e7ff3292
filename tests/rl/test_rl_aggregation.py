"""loss_agg_mode: the design page's pinned table, edge cases, Balanced Aggregation."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import AGG_MODES, POLICY_LOSSES, agg_loss, agg_weights, compute_policy_loss

# design/objectives.md §5 pinned example: seq1 [2] (length 1), seq2 [1, 1, 1] (length 3).
PINNED = {"token-mean": 1.25, "seq-mean-token-mean": 1.5, "seq-mean-token-sum": 2.5, "seq-mean-token-sum-norm": 0.625}


def _pinned():
    loss = torch.tensor([[2.0, 7.0, -3.0], [1.0, 1.0, 1.0]])  # 7, -3 are padding
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    return loss, mask


@pytest.mark.parametrize("mode", list(PINNED))
def test_pinned_table(mode):
    loss, mask = _pinned()
    assert float(agg_loss(loss, mask, mode, norm_constant=4)) == pytest.approx(PINNED[mode], abs=1e-7)


@pytest.mark.parametrize("mode", list(PINNED))
def test_empty_response_adds_no_phantom_token_or_sequence(mode):
    loss, mask = _pinned()
    loss3 = torch.cat([loss, torch.full((1, 3), 100.0)])
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    assert float(agg_loss(loss3, mask3, mode, norm_constant=4)) == pytest.approx(PINNED[mode], abs=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_gives_zero_loss_and_finite_zero_grad(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = agg_loss(loss, mask, mode, norm_constant=4, advantages=torch.ones(3), group_index=torch.tensor([0, 0, 1]))
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(3, 4))


def test_masked_positions_may_hold_inf_and_get_no_gradient():
    loss = torch.tensor([[1.0, float("inf")], [2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    out = agg_loss(loss, mask, "token-mean")
    out.backward()
    assert out.item() == 1.5
    assert torch.equal(loss.grad, torch.tensor([[0.5, 0.0], [0.5, 0.0]]))


def test_external_normalisers_override_local_counts():
    loss, mask = _pinned()
    assert float(agg_loss(loss, mask, "token-mean", num_tokens=10)) == pytest.approx(0.5)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=5)) == pytest.approx(1.0)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean", num_seqs=4)) == pytest.approx(0.75)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm", num_seqs=5, norm_constant=2)) == pytest.approx(0.5)
    assert float(agg_loss(loss, mask, "token-mean", dp_size=4)) == pytest.approx(5.0)


def test_errors_name_the_problem():
    loss, mask = _pinned()
    with pytest.raises(ValueError, match=r"loss_agg_mode='token-max' is unknown; valid: \['balanced'"):
        agg_loss(loss, mask, "token-max")
    with pytest.raises(ValueError, match="needs norm_constant"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="needs advantages and group_index"):
        agg_loss(loss, mask, "balanced")
    with pytest.raises(ValueError, match="response_mask must be boolean or hold only 0/1"):
        agg_loss(loss, mask * 0.5, "token-mean")
    with pytest.raises(ValueError, match="loss_mat has 1 NaN/Inf"):
        agg_loss(torch.tensor([[float("nan"), 0.0, 0.0], [1.0, 1.0, 1.0]]), mask, "token-mean")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(loss, mask[:, :2], "token-mean")
    with pytest.raises(ValueError, match="num_tokens must be a finite scalar"):
        agg_loss(loss, mask, "token-mean", num_tokens=-1)
    gid = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\); expected \(2,\) or \(2, 3\)"):
        agg_loss(loss, mask, "balanced", advantages=torch.ones(3), group_index=gid)
    with pytest.raises(ValueError, match="advantages has 1 NaN/Inf"):  # was read as sign 0: weight 0, silently
        agg_loss(loss, mask, "balanced", advantages=torch.tensor([float("nan"), 1.0]), group_index=gid)
    # NaN advantages at padding are fine (row 0 has one valid token)
    adv2 = torch.tensor([[1.0, float("nan"), float("nan")], [-1.0, -1.0, -1.0]])
    assert float(agg_loss(loss, mask, "balanced", advantages=adv2, group_index=gid)) == pytest.approx(0.5 * 2 + 0.5 * 1)


# ---------------------------------------------------------------- Balanced Aggregation


def test_balanced_hand_computed():
    # group 0 (G=3): + [3] (len 1); - [1, 1] (len 2) and - [4] (len 1): k=1, m=2, T+=1, T-=3
    #   L0 = (1/3)(3/1) + (2/3)(6/3) = 1 + 4/3
    # group 1 (G=2): + [2, 2] (len 2); zero-advantage [9] (len 1): k=1, m=0 -> L1 = (1/2)(4/2) = 1
    loss = torch.tensor([[3.0, 0], [1, 1], [4, 0], [2, 2], [9, 0]])
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1, -2, 0.5, 0])
    gid = torch.tensor([7, 7, 7, 3, 3])  # arbitrary ids
    out = agg_loss(loss, mask, "balanced", advantages=adv, group_index=gid)
    assert out.item() == pytest.approx((1 + 4 / 3 + 1) / 2)
    # zero-advantage responses not counted in G: group 1 has G=1 -> L1 = 2
    out = agg_loss(loss, mask, "balanced", advantages=adv, group_index=gid, ba_count_zero_adv=False)
    assert out.item() == pytest.approx((1 + 4 / 3 + 2) / 2)
    # pooled over the batch: G=5, k=2, m=2, T+=3, T-=3: (2/5)(7/3) + (2/5)(6/3)
    out = agg_loss(loss, mask, "balanced", advantages=adv, group_index=gid, ba_scope="batch")
    assert out.item() == pytest.approx(0.4 * 7 / 3 + 0.4 * 2)


def test_balanced_empty_subset_gives_zero_not_nan():
    loss = torch.tensor([[1.0, 1.0], [5.0, 5.0], [2.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])  # the only negative response is empty
    adv = torch.tensor([1.0, -1.0, 1.0])
    out = agg_loss(loss, mask, "balanced", advantages=adv, group_index=torch.tensor([0, 0, 0]))
    out.backward()
    # k=2, G=3, T+=3; negative subset empty -> contributes 0
    assert out.item() == pytest.approx((2 / 3) * (4 / 3))
    assert torch.isfinite(loss.grad).all()
    # a group whose advantages are all positive (m = 0): no NaN either
    w = agg_weights(torch.ones(2, 2, dtype=torch.bool), "balanced", advantages=torch.ones(2), group_index=torch.zeros(2, dtype=torch.long))
    assert torch.allclose(w, torch.tensor([0.25, 0.25], dtype=torch.float64))


def _on_policy(adv, lengths, T):
    mask = torch.arange(T) < torch.tensor(lengths)[:, None]
    old = torch.full(mask.shape, -1.0, dtype=torch.float64)
    return old, old.clone().requires_grad_(True), torch.tensor(adv, dtype=torch.float64), mask


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_balanced_equals_token_and_seq_mean_when_lengths_equal(loss_mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 5, generator=g, dtype=torch.float64)
    lp = old + 0.1 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    # no A = 0 response: Balanced Aggregation gives those no weight, which matters for the losses with
    # a term free of A (dro's log-ratio penalty), not for the PPO-style ones
    adv = torch.tensor([1.0, -1, 0.5, 0.25, -0.5, 1, -2, 2], dtype=torch.float64)
    mask = torch.ones(8, 5, dtype=torch.bool)
    gid = torch.arange(8) // 4
    out = {}
    for agg in ("balanced", "token-mean", "seq-mean-token-mean"):
        x = lp.clone().requires_grad_(True)
        loss, _ = compute_policy_loss(loss_mode, old, x, adv, mask, agg, group_index=gid)
        loss.backward()
        out[agg] = (loss.detach(), x.grad)
    for agg in ("token-mean", "seq-mean-token-mean"):
        torch.testing.assert_close(out["balanced"][0], out[agg][0])
        torch.testing.assert_close(out["balanced"][1], out[agg][1])


def test_balanced_keeps_count_weights_when_lengths_differ():
    # one group, G=4: 2 short correct answers (len 2), 2 long wrong ones (len 6), on-policy.
    old, lp, adv, mask = _on_policy([1.0, 1.0, -1.0, -1.0], [2, 2, 6, 6], 6)
    grads = {}
    for agg in ("balanced", "token-mean"):
        x = lp.detach().clone().requires_grad_(True)
        loss, _ = compute_policy_loss("vanilla", old, x, adv, mask, agg, group_index=torch.zeros(4, dtype=torch.long))
        loss.backward()
        grads[agg] = x.grad
    # d loss / d log pi = -A * w per token: the subsets' total weights.
    pos_w = -grads["balanced"][:2].sum()
    neg_w = grads["balanced"][2:].sum()
    assert float(pos_w) == pytest.approx(2 / 4) and float(neg_w) == pytest.approx(2 / 4)  # (k/G), (m/G)
    assert float(-grads["token-mean"][:2].sum()) == pytest.approx(4 / 16)  # token-mean: 0.25 vs 0.75
    assert float(grads["token-mean"][2:].sum()) == pytest.approx(12 / 16)
