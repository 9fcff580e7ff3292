"""Issue 9 case 8: formulas no other test pinned (each mutation survived the suite before).

The log-ratio clamp (``log_ratio_clamp`` = 20) at log-ratios of +-30 for the token loss, GSPO
and GSPO-token, and Balanced Aggregation's per-response sign from the sum of per-token
advantages (not the first token)."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.rl import agg_loss, compute_policy_loss
from echotrain.rl.aggregation import response_sign

C = 20.0  # PolicyLossConfig.log_ratio_clamp
BAND = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)


def _pair(rows, advs):
    lr = torch.tensor(rows, dtype=torch.float64)
    old = torch.full_like(lr, -2.0)
    lp = (old + lr).requires_grad_(True)
    adv = torch.tensor(advs, dtype=torch.float64)[:, None].expand_as(lr).clone()
    return old, lp, adv, torch.ones_like(lr, dtype=torch.bool)


# seq 0: two tokens at +30, A = -1 (unclipped side: l = rho); seq 1: two at -30, A = +1 (l = -rho)
ROWS = [[30.0, 30.0, 0.1, -0.2], [-30.0, -30.0, 0.2, -0.1]]
ADVS = [-1.0, 1.0]


def test_token_loss_clamps_each_log_ratio_at_20_with_zero_gradient_beyond():
    old, lp, adv, mask = _pair(ROWS, ADVS)
    loss, m = compute_policy_loss("vanilla", old, lp, adv, mask, "token-mean", BAND)
    loss.backward()
    clamp = lambda x: max(-C, min(C, x))  # noqa: E731
    per_tok = []
    grad = torch.zeros(2, 4, dtype=torch.float64)
    for i, (row, a) in enumerate(zip(ROWS, ADVS)):
        for t, x in enumerate(row):
            rho = math.exp(clamp(x))
            clipped = min(max(rho, 0.8), 1.28)
            l_un, l_cl = -a * rho, -a * clipped
            per_tok.append(max(l_un, l_cl))
            if abs(x) < C and not l_cl > l_un:  # unclipped branch active and inside the clamp
                grad[i, t] = -a * rho / 8
    assert loss.item() == pytest.approx(sum(per_tok) / 8, rel=1e-12)
    assert loss.item() == pytest.approx(2 * (math.exp(20) - math.exp(-20)) / 8 + sum(per_tok[2:4] + per_tok[6:]) / 8,
                                        rel=1e-12)
    torch.testing.assert_close(lp.grad, grad, rtol=1e-12, atol=0)
    assert lp.grad[:, :2].eq(0).all()


def test_gspo_clamps_each_token_before_the_sequence_mean():
    old, lp, adv, mask = _pair(ROWS, ADVS)
    loss, _ = compute_policy_loss("gspo", old, lp, adv, mask, "seq-mean-token-mean", BAND)
    loss.backward()
    s0 = math.exp((C + C + 0.1 - 0.2) / 4)  # e^9.975, not e^(60 - 0.1)/4 = e^14.975 (unclamped)
    s1 = math.exp((-C - C + 0.2 - 0.1) / 4)
    assert loss.item() == pytest.approx((s0 + (-s1)) / 2, rel=1e-12)  # both on the unclipped side
    # d loss / d lp_t = (1/2) * (-A s) / 4 for tokens inside the clamp, 0 for the clamped ones
    expected = torch.tensor([[0, 0, s0 / 8, s0 / 8], [0, 0, -s1 / 8, -s1 / 8]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=0)


def test_gspo_token_same_value_gradient_on_every_token():
    old, lp, adv, mask = _pair(ROWS, ADVS)
    loss, _ = compute_policy_loss("gspo_token", old, lp, adv, mask, "seq-mean-token-mean", BAND)
    loss.backward()
    s0 = math.exp((C + C + 0.1 - 0.2) / 4)
    s1 = math.exp((-C - C + 0.2 - 0.1) / 4)
    assert loss.item() == pytest.approx((s0 - s1) / 2, rel=1e-12)
    # the per-token path pi / sg[pi] is not clamped: every token gets -A s_i / 8
    expected = torch.tensor([[s0 / 8] * 4, [-s1 / 8] * 4], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=0)


def test_balanced_sign_is_the_sum_over_the_response_not_its_first_token():
    # per-token advantages that change sign inside a response
    adv = torch.tensor([[-1.0, 2.0, 2.0], [1.0, -3.0, 0.0], [0.5, -0.5, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert response_sign(adv, mask).tolist() == [1, -1, 0, 1]
    # one group of 4: k = 2 positive (T+ = 3 + 1 = 4 tokens), m = 1 negative (T- = 2), G = 4
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 8.0, 0.0], [10.0, 0.0, 0.0]])
    loss = agg_loss(loss_mat, mask, "balanced", advantages=adv, group_index=torch.zeros(4, dtype=torch.long))
    c_pos, c_neg = 2 / (4 * 4), 1 / (4 * 2)
    assert loss.item() == pytest.approx(c_pos * (1 + 2 + 3 + 10) + c_neg * (4 + 5))


def test_balanced_equals_token_mean_only_with_equal_group_sizes_too():
    """Equal lengths are not enough (design §5): groups of 2 and 3 responses (length 2 each) with
    per-token losses 2 and 1: BA = mean over groups (2 + 1) / 2 = 1.5; token-mean and
    seq-mean-token-mean = (2 * 2 + 3 * 1) / 5 = 1.4. With equal group sizes all three agree."""
    mask = torch.ones(5, 2, dtype=torch.bool)
    loss_mat = torch.tensor([[2.0, 2.0]] * 2 + [[1.0, 1.0]] * 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1, 1])
    assert agg_loss(loss_mat, mask, "balanced", advantages=adv, group_index=gid).item() == pytest.approx(1.5)
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(1.4)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(1.4)
    # groups of 2 and 2 (drop one response of the second group): 1.5 everywhere
    keep = torch.tensor([0, 1, 2, 4])
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert agg_loss(loss_mat[keep], mask[keep], mode).item() == pytest.approx(1.5)
    assert agg_loss(loss_mat[keep], mask[keep], "balanced", advantages=adv[keep],
                    group_index=gid[keep]).item() == pytest.approx(1.5)


def test_balanced_all_zero_advantage_group_and_count_zero_adv():
    """Group 0: A = [+1, -1], per-token losses 3 and 1 (length 1 each); group 1: A = [0, 0].

    - ``ba_count_zero_adv=True``: group 1 counts in the mean over groups with contribution 0:
      ((1/2) 3 + (1/2) 1 + 0) / 2 = 1.0.
    - ``ba_count_zero_adv=False``: group 1 has G = 0 and is left out of the mean, exactly as if
      the zero-advantage responses had been filtered out: (1/2) 3 + (1/2) 1 = 2.0.
    """
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss_mat = torch.tensor([[3.0], [1.0], [5.0], [7.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1])
    kw = dict(advantages=adv, group_index=gid)
    assert agg_loss(loss_mat, mask, "balanced", **kw, ba_count_zero_adv=True).item() == pytest.approx(1.0)
    assert agg_loss(loss_mat, mask, "balanced", **kw, ba_count_zero_adv=False).item() == pytest.approx(2.0)
    filtered = agg_loss(loss_mat[:2], mask[:2], "balanced", advantages=adv[:2], group_index=gid[:2])
    assert filtered.item() == pytest.approx(2.0)
    # a zero-advantage response inside a mixed group: counted in G (True) or not (False)
    adv2 = torch.tensor([1.0, -1.0, 0.0, 1.0], dtype=torch.float64)
    gid2 = torch.tensor([0, 0, 0, 1])
    # True: group 0 G = 3: (1/3) 3 + (1/3) 1 = 4/3; group 1: 7; mean (4/3 + 7) / 2
    assert agg_loss(loss_mat, mask, "balanced", advantages=adv2, group_index=gid2).item() == pytest.approx((4 / 3 + 7) / 2)
    # False: group 0 G = 2: 2.0; group 1: 7; mean 4.5
    assert agg_loss(loss_mat, mask, "balanced", advantages=adv2, group_index=gid2,
                    ba_count_zero_adv=False).item() == pytest.approx(4.5)


# ---------------------------------------------------------------- ECHO on a batch with no valid token


def _all_masked(B=3, T=4):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    lp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)[:, None].expand(B, T).clone()
    return old, lp, adv, torch.zeros(B, T, dtype=torch.bool)


@pytest.mark.parametrize("batch_ratio", ["arith", "geo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_echo_all_masked_batch_is_a_no_op_in_one_call(batch_ratio, agg):
    # N = 0: R is defined as 1 (not 0/0 -> 0 for arith), so kappa = 1, no clip, loss 0, gradient 0
    old, lp, adv, mask = _all_masked()
    loss, m = compute_policy_loss("echo", old, lp, adv, mask, agg, {"batch_ratio": batch_ratio})
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert m["echo/R_batch"] == 1.0 and m["echo/kappa"] == 1.0 and m["echo/batch_clipped"] == 0.0


@pytest.mark.parametrize("batch_ratio", ["arith", "geo"])
def test_echo_all_masked_batch_is_a_no_op_through_compute_step_stats(batch_ratio):
    from echotrain.rl import compute_step_stats, split_micro_batches

    old, lp, adv, mask = _all_masked()
    batch = {"old_log_prob": old, "log_prob": lp.detach(), "advantages": adv, "response_mask": mask,
             "group_index": torch.tensor([0, 0, 1])}
    cfg = {"batch_ratio": batch_ratio}
    mbs = split_micro_batches(batch, [2, 1])
    step = compute_step_stats(mbs, loss_mode="echo", loss_agg_mode="token-mean", config=cfg)
    echo = step.loss_stats
    assert (echo.R, echo.kappa, echo.clipped, echo.grad_sum) == (1.0, 1.0, False, 0.0)
    for mb in mbs:
        lp_mb = mb["log_prob"].clone().requires_grad_(True)
        loss, m = compute_policy_loss("echo", mb["old_log_prob"], lp_mb, mb["advantages"], mb["response_mask"],
                                      "token-mean", cfg, step=step)
        loss.backward()
        assert loss.item() == 0.0 and math.isfinite(loss.item())
        assert torch.equal(lp_mb.grad, torch.zeros_like(lp_mb))
        assert m["echo/R_batch"] == 1.0 and m["echo/kappa"] == 1.0 and m["echo/batch_clipped"] == 0.0
