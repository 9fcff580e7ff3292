"""Every registered policy loss is exact under micro-batches and (emulated) ranks.

One big batch (``step=None``) vs random micro-batch splits through ``compute_step_stats`` /
``compute_policy_loss(..., step=)``: the summed losses and gradients equal the big batch's, for
every aggregation mode, including the losses with batch-global statistics (Clip-Cov, KL-Cov).
"""

from __future__ import annotations

import pytest
import torch

from echotrain import rl
from echotrain.rl import compute_policy_loss, compute_step_stats, split_micro_batches, step_agg_loss
from tests.rl.conftest import make_batch

CFG = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, norm_constant=7.0, dro_beta=0.5,
           kl_cov_ratio=0.1, clip_cov_ratio=0.05, clip_cov_lb=-0.05, clip_cov_ub=0.5)


def _big_and_split(loss_mode, agg, sizes, seed=0, B=24, T=7):
    b = make_batch(seed, B=B, T=T, noise=0.5)
    lp = b["log_prob"].detach()
    lp1 = lp.clone().requires_grad_(True)
    big, _ = compute_policy_loss(loss_mode, b["old_log_prob"], lp1, b["advantages"], b["response_mask"], agg, CFG,
                                 group_index=b["group_index"])
    big.backward()
    lp2 = lp.clone().requires_grad_(True)
    batch = {**{k: v for k, v in b.items() if k != "log_prob"}, "log_prob": lp2}
    mbs = split_micro_batches(batch, sizes)
    stat_mbs = [{**mb, "log_prob": mb["log_prob"].detach()} for mb in mbs]  # the no-grad pre-pass
    step = compute_step_stats(stat_mbs, loss_mode=loss_mode, loss_agg_mode=agg, config=CFG)
    total = 0.0
    for mb in mbs:
        loss, _ = compute_policy_loss(loss_mode, mb["old_log_prob"], mb["log_prob"], mb["advantages"],
                                      mb["response_mask"], agg, CFG, group_index=mb["group_index"], step=step)
        loss.backward()
        total = total + loss.detach()
    return big.detach(), lp1.grad, total, lp2.grad


@pytest.mark.parametrize("agg", list(rl.AGG_MODES))
@pytest.mark.parametrize("loss_mode", list(rl.POLICY_LOSSES))
def test_micro_batches_equal_one_big_batch(loss_mode, agg):
    g = torch.Generator().manual_seed(hash((loss_mode, agg)) % 10_000)
    cuts = sorted(torch.randint(0, 25, (3,), generator=g).tolist())
    sizes = [cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], 24 - cuts[2]]  # random, possibly empty pieces
    big, g_big, total, g_split = _big_and_split(loss_mode, agg, sizes)
    torch.testing.assert_close(total, big, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_split, g_big, rtol=1e-10, atol=1e-12)
    assert g_big.abs().sum() > 0  # not vacuous


@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_covariance_selection_is_the_steps_not_the_micro_batchs(loss_mode):
    """The selected tokens of each micro-batch (with the step's stats) are those of the big batch."""
    b = make_batch(3, B=24, T=7, noise=0.5)
    lp = b["log_prob"].detach()
    cfg = rl.as_policy_loss_config(CFG)
    _, m_big = compute_policy_loss(loss_mode, b["old_log_prob"], lp, b["advantages"], b["response_mask"], "token-mean", cfg)
    mbs = split_micro_batches({**b, "log_prob": lp}, [5, 11, 8])
    step = compute_step_stats(mbs, loss_mode=loss_mode, loss_agg_mode="token-mean", config=cfg)
    chosen = 0.0
    for mb in mbs:
        _, m = compute_policy_loss(loss_mode, mb["old_log_prob"], mb["log_prob"], mb["advantages"], mb["response_mask"],
                                   "token-mean", cfg, step=step)
        chosen += m["pg_covfrac"] * float(mb["response_mask"].sum())
    n = float(b["response_mask"].sum())
    assert chosen == pytest.approx(m_big["pg_covfrac"] * n) and chosen == step.loss_stats.num_selected
    ratio = CFG["kl_cov_ratio"] if loss_mode == "kl_cov" else CFG["clip_cov_ratio"]
    assert chosen == max(1, int(ratio * n))


def test_emulated_ranks_are_exact_for_kl_cov():
    """Two ranks (threads of one process, the all-reduce emulated by reduce_fn) select the step's
    top-k and give the big batch's gradient."""
    import threading

    b = make_batch(4, B=16, T=7, noise=0.5)
    lp = b["log_prob"].detach()
    lp1 = lp.clone().requires_grad_(True)
    big, _ = compute_policy_loss("kl_cov", b["old_log_prob"], lp1, b["advantages"], b["response_mask"], "token-mean", CFG)
    big.backward()
    shards = [split_micro_batches({**b, "log_prob": lp}, [7, 9])[r] for r in range(2)]
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def reduce_for(rank):
        def reduce(t, op):
            slots[rank] = t.clone()
            barrier.wait()
            both = torch.stack([slots[0], slots[1]])
            out = both.sum(0) if op == "sum" else both.max(0).values
            barrier.wait()
            return out
        return reduce

    def run(rank):
        sh = shards[rank]
        step = compute_step_stats([sh], loss_mode="kl_cov", loss_agg_mode="token-mean", config=CFG,
                                  reduce_fn=reduce_for(rank))
        x = sh["log_prob"].clone().requires_grad_(True)
        loss, _ = compute_policy_loss("kl_cov", sh["old_log_prob"], x, sh["advantages"], sh["response_mask"],
                                      "token-mean", CFG, step=step)
        loss.backward()
        results[rank] = (loss.detach(), x.grad)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    torch.testing.assert_close(results[0][0] + results[1][0], big.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), lp1.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sizes", [[24], [1] * 24, [0, 10, 0, 14]])
def test_token_sum_is_exact_and_is_the_plain_sum(sizes):
    b = make_batch(5, B=24, T=7)
    loss_mat = torch.randn(24, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = b["response_mask"]
    whole = rl.agg_loss(loss_mat, mask, "token-sum")
    assert whole.item() == pytest.approx(float(loss_mat[mask].sum()), rel=1e-12)
    mbs = split_micro_batches({**b, "loss_mat": loss_mat}, sizes)
    step = compute_step_stats(mbs, loss_mode="vanilla", loss_agg_mode="token-sum")
    parts = sum(float(step_agg_loss(mb["loss_mat"], mb["response_mask"], step)) for mb in mbs)
    assert parts == pytest.approx(whole.item(), rel=1e-12)


def test_clip_cov_and_kl_cov_declare_the_pre_pass():
    assert {"clip_cov", "kl_cov"} <= set(rl.PREPASS_LOSS_MODES)
    b = make_batch(0)
    mbs = split_micro_batches({k: v for k, v in b.items() if k != "log_prob"}, 4)
    with pytest.raises(ValueError, match="no 'log_prob'"):
        compute_step_stats(mbs, loss_mode="kl_cov", loss_agg_mode="token-mean")
