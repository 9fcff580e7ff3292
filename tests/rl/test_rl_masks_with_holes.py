"""Every objective on response masks with holes (multi-turn episodes: 0 on the environment's
tokens inside a response, docs/design/environments.md) is exact.

For every registered policy loss x aggregation mode (enumerated from the registries):

* the loss and the gradient of a batch whose masks have holes equal those of the same model tokens
  packed to the left (no holes), at the same width: an environment token counts in no sum, no
  length |o_i| (GSPO's sequence ratio, seq-mean-token-mean, BA's counts), no batch statistic
  (ECHO's R, Clip-Cov's top-k) and gets no gradient;
* micro-batches of the holed batch equal the big batch (the step statistics see the holes too).

The KL penalty and the behaviour-policy corrections are checked the same way.
"""

from __future__ import annotations

import pytest
import torch

from echotrain import rl
from echotrain.rl import compute_policy_loss, compute_step_stats, split_micro_batches
from tests.rl.conftest import make_batch
from tests.rl.test_rl_losses_exactness import CFG

B, T_MODEL, T = 16, 7, 12
#: losses whose token selection is a pseudo-random function of the token's column (Clip-Cov's
#: hash of old_log_prob bits and position, echotrain.rl.losses.covariance): a holed layout draws
#: another, equally uniform, subset, so only the no-gradient-on-holes part of the layout test applies
POSITION_KEYED = {"clip_cov"}


def _holed(seed: int = 0) -> tuple[dict, dict, torch.Tensor]:
    """``(compact, holed, where)``: a batch of ``T_MODEL`` model tokens per row (ragged, one empty
    row) and the same tokens spread over ``T`` columns with runs of environment tokens between
    them (1-3 per gap, random, the old log-probs there random garbage); ``where`` (B, T_MODEL)
    is the column of each model token in the holed layout."""
    b = make_batch(seed, B=B, T=T_MODEL, noise=0.5)
    g = torch.Generator().manual_seed(seed + 100)
    where = torch.zeros(B, T_MODEL, dtype=torch.long)
    holed = {k: torch.zeros(B, T, dtype=v.dtype) for k, v in b.items() if k not in ("group_index",)}
    for k in ("old_log_prob", "log_prob"):
        holed[k] = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5  # garbage at the holes
    holed["response_mask"] = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        col = int(torch.randint(0, 2, (1,), generator=g))  # a response may start with a hole
        for t in range(T_MODEL):
            where[i, t] = col
            col += 1 + (int(torch.randint(1, 3, (1,), generator=g)) if t in (1, 3) else 0)  # two holes per row
        assert col <= T + 1
    for i in range(B):
        for t in range(T_MODEL):
            c = int(where[i, t])
            if c >= T:
                continue
            for k in ("old_log_prob", "advantages", "response_mask"):
                holed[k][i, c] = b[k][i, t]
            holed["log_prob"][i, c] = b["log_prob"][i, t].detach()
            if not b["response_mask"][i, t]:
                holed["old_log_prob"][i, c] = -2.0
    holed["advantages"] = holed["advantages"] * holed["response_mask"]  # as the trainer broadcasts them
    holed["group_index"] = b["group_index"]
    compact = {k: (F_pad(v, T) if v.dim() == 2 else v) for k, v in b.items()}
    compact["log_prob"] = compact["log_prob"].detach()
    return compact, holed, where


def F_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad (B, t) to (B, width) with zeros (False for masks)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _loss_and_grad(loss_mode, agg, batch):
    lp = batch["log_prob"].clone().requires_grad_(True)
    mb = {**batch, "log_prob": lp}
    step = compute_step_stats([{**mb, "log_prob": lp.detach()}], loss_mode=loss_mode, loss_agg_mode=agg, config=CFG)
    loss, _ = compute_policy_loss(loss_mode, mb["old_log_prob"], lp, mb["advantages"], mb["response_mask"], agg, CFG,
                                  group_index=mb["group_index"], step=step)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("agg", list(rl.AGG_MODES))
@pytest.mark.parametrize("loss_mode", list(rl.POLICY_LOSSES))
def test_holes_change_nothing_but_the_layout(loss_mode, agg):
    compact, holed, where = _holed()
    l_c, g_c = _loss_and_grad(loss_mode, agg, compact)
    l_h, g_h = _loss_and_grad(loss_mode, agg, holed)
    mask = holed["response_mask"]
    assert float(g_h[~mask].abs().sum()) == 0.0  # no gradient on an environment token
    if loss_mode in POSITION_KEYED:
        return
    torch.testing.assert_close(l_h, l_c, rtol=1e-10, atol=1e-12)
    moved = torch.zeros_like(g_h)
    moved.scatter_(1, where.clamp(max=T - 1), g_c[:, :T_MODEL])
    torch.testing.assert_close(g_h * mask, moved * mask, rtol=1e-10, atol=1e-12)
    assert g_c.abs().sum() > 0  # not vacuous


@pytest.mark.parametrize("agg", list(rl.AGG_MODES))
@pytest.mark.parametrize("loss_mode", list(rl.POLICY_LOSSES))
def test_micro_batches_of_holed_masks_equal_one_big_batch(loss_mode, agg):
    _, b, _ = _holed(seed=1)
    big, g_big = _loss_and_grad(loss_mode, agg, b)
    lp = b["log_prob"].clone().requires_grad_(True)
    mbs = split_micro_batches({**b, "log_prob": lp}, [5, 0, 7, 4])
    step = compute_step_stats([{**mb, "log_prob": mb["log_prob"].detach()} for mb in mbs], loss_mode=loss_mode,
                              loss_agg_mode=agg, config=CFG)
    total = 0.0
    for mb in mbs:
        loss, _ = compute_policy_loss(loss_mode, mb["old_log_prob"], mb["log_prob"], mb["advantages"],
                                      mb["response_mask"], agg, CFG, group_index=mb["group_index"], step=step)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, big, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.grad, g_big, rtol=1e-10, atol=1e-12)
    assert g_big.abs().sum() > 0


@pytest.mark.parametrize("estimator", list(rl.KL_ESTIMATORS))
@pytest.mark.parametrize("agg", list(rl.AGG_MODES))
def test_kl_penalty_on_holed_masks(estimator, agg):
    """The KL term's value (kl_penalty then agg_loss, as the update computes it) ignores the holes."""
    compact, holed, _ = _holed(seed=2)
    ref_c, ref_h = compact["old_log_prob"] - 0.3, holed["old_log_prob"] - 0.3
    ref_h = torch.where(holed["response_mask"], ref_h, torch.full_like(ref_h, -30.0))  # garbage at the holes
    kl_c = rl.agg_loss(rl.kl_penalty(compact["log_prob"], ref_c, estimator), compact["response_mask"], agg,
                       advantages=compact["advantages"],
                       group_index=compact["group_index"], norm_constant=7.0)
    kl_h = rl.agg_loss(rl.kl_penalty(holed["log_prob"], ref_h, estimator), holed["response_mask"], agg,
                       advantages=holed["advantages"],
                       group_index=holed["group_index"], norm_constant=7.0)
    torch.testing.assert_close(kl_h, kl_c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(__import__("echotrain.rl.correction_names", fromlist=["x"]).ROLLOUT_CORRECTIONS))
def test_rollout_corrections_on_holed_masks(name):
    """Every registered behaviour-policy correction: the kept tokens, the IS weights and the
    step's metrics of a holed batch are those of the same model tokens without holes."""
    from echotrain.rl import PolicyLossConfig, apply_rollout_correction

    compact, holed, where = _holed(seed=3)
    g = torch.Generator().manual_seed(7)
    noise = 0.4 * torch.randn(B, T_MODEL, generator=g, dtype=torch.float64)
    roll_c = compact["old_log_prob"].clone()
    roll_c[:, :T_MODEL] += noise
    roll_h = -torch.rand(B, T, generator=g, dtype=torch.float64) * 9  # garbage at the holes
    for i in range(B):
        for t in range(T_MODEL):
            if where[i, t] < T:
                roll_h[i, where[i, t]] = roll_c[i, t]
    cfg = PolicyLossConfig(rollout_correction=name)
    out_c = apply_rollout_correction(compact["old_log_prob"], roll_c, compact["advantages"], compact["response_mask"], cfg)
    out_h = apply_rollout_correction(holed["old_log_prob"], roll_h, holed["advantages"], holed["response_mask"], cfg)
    cols = where.clamp(max=T - 1)
    m = compact["response_mask"][:, :T_MODEL]
    assert torch.equal(out_h.response_mask.gather(1, cols)[m], out_c.response_mask[:, :T_MODEL][m])
    torch.testing.assert_close(out_h.rollout_is_weights.gather(1, cols)[m], out_c.rollout_is_weights[:, :T_MODEL][m],
                               rtol=1e-10, atol=1e-12)
    assert not out_h.response_mask[~holed["response_mask"]].any()
    assert out_h.metrics == pytest.approx(out_c.metrics, rel=1e-9, abs=1e-12)
