"""TRL 1.16's loss types luspo, vespo, cispo and sapo against hand-computed tables.

The tables are worked out from TRL's ``GRPOTrainer._compute_loss`` (read in the installed
source); VESPO's weight is also compared with TRL's own static ``get_gamma_weights``.
"""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.rl import compute_policy_loss

F64 = torch.float64


def _run(loss_mode, old, lp, adv, mask, agg=None, **cfg):
    lp = torch.tensor(lp, dtype=F64, requires_grad=True)
    args = (torch.tensor(old, dtype=F64), lp, torch.tensor(adv, dtype=F64), torch.tensor(mask, dtype=torch.bool))
    loss, metrics = compute_policy_loss(loss_mode, *args, agg or "token-mean", cfg) if agg else \
        compute_policy_loss(loss_mode, *args, config=cfg)
    loss.backward()
    return loss.item(), lp.grad, metrics


def test_luspo_is_length_scaled_gspo():
    """Two responses, lengths 2 and 1, log rho = (0.1, 0.3) and (-0.5,); A = (+1, -1); eps 0.2/0.28.
    s_1 = e^0.2 = 1.2214 (in band), s_2 = e^-0.5 = 0.6065 < 0.8, A < 0: clipped at 0.8.
    TRL: ((2 * -s_1 * 1) + (1 * 0.8))/2 = -s_1 + 0.4; gradient: row 1 d/d lp_t = -(2 / 2) s_1 / 2 = -s_1/2;
    row 2 clipped: 0."""
    old = [[-1.0, -1.0], [-2.0, -2.0]]
    lp = [[-0.9, -0.7], [-2.5, -9.0]]
    value, grad, _ = _run("luspo", old, lp, [[1.0, 1.0], [-1.0, -1.0]], [[1, 1], [1, 0]], "seq-mean-token-sum",
                          clip_ratio_low=0.2, clip_ratio_high=0.28)
    s1 = math.exp(0.2)
    assert value == pytest.approx(-s1 + 0.4, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-s1 / 2, -s1 / 2], [0.0, 0.0]], dtype=F64))


def test_vespo_weight_matches_trls_get_gamma_weights_and_the_table():
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], dtype=F64)
    lp = torch.tensor([[-0.9, -0.8, -5.0], [-2.4, -2.3, -7.0]], dtype=F64)  # log w = 0.3 and -0.7 (3rd token masked)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[2.0], [-1.0]], dtype=F64)
    phi_trl = trl.GRPOTrainer.get_gamma_weights(adv, lp - old, mask.to(F64), None, 2.0, 3.0, 3.0, 2.0)  # (B, 1)
    phi = [math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3)), math.exp(2 + 3 * -0.7 - 2 * math.exp(-0.7))]
    torch.testing.assert_close(phi_trl.squeeze(-1), torch.tensor(phi, dtype=F64))
    value, grad, m = _run("vespo", old.tolist(), lp.tolist(), adv.expand(2, 3).tolist(), mask.tolist())
    # token-mean over 4 tokens of -phi A log pi (TRL normalises vespo by the batch's token count)
    expected = -(phi[0] * 2 * (-0.9 - 0.8) + phi[1] * -1 * (-2.4 - 2.3)) / 4
    assert value == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-phi[0] * 2 / 4] * 2 + [0.0], [phi[1] / 4] * 2 + [0.0]], dtype=F64))
    assert m["pg_vespo_phi"] == pytest.approx((phi[0] + phi[1]) / 2)


def test_luspo_default_aggregation_is_seq_mean_token_sum():
    from echotrain.rl import POLICY_LOSSES

    import inspect

    assert inspect.signature(POLICY_LOSSES["luspo"]).parameters["loss_agg_mode"].default == "seq-mean-token-sum"


def test_vespo_weight_is_one_on_policy():
    _, grad, m = _run("vespo", [[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, 1.0]], [[1, 1]])
    assert m["pg_vespo_phi"] == pytest.approx(1.0)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5]], dtype=F64))


def test_cispo_trl_form_caps_from_above_only():
    """TRL: w = min(rho, epsilon_high) detached, loss = -w A log pi, token-mean. epsilon_high = 5
    (ScaleRL) is clip_ratio_high = 4 with cispo_lower_clip=False. rho = (e^2 = 7.39 -> 5, e^-2 = 0.135
    kept: TRL has no floor; verl's two-sided form would raise it to 1 - eps_low)."""
    old = [[-3.0, -1.0]]
    lp = [[-1.0, -3.0]]
    value, grad, m = _run("cispo", old, lp, [[1.0, 1.0]], [[1, 1]], clip_ratio_high=4.0, cispo_lower_clip=False)
    w = [5.0, math.exp(-2)]
    assert value == pytest.approx(-(w[0] * -1.0 + w[1] * -3.0) / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-w[0] / 2, -w[1] / 2]], dtype=F64))
    assert m["pg_clipfrac_high"] == 0.5 and m["pg_clipfrac_low"] == 0.0
    _, grad_verl_form, _ = _run("cispo", old, lp, [[1.0, 1.0]], [[1, 1]], clip_ratio_low=0.2, clip_ratio_high=4.0)
    torch.testing.assert_close(grad_verl_form, torch.tensor([[-5.0 / 2, -0.8 / 2]], dtype=F64))


def test_sapo_gate_table():
    """f(rho) = sigmoid(tau (rho - 1)) 4 / tau, tau_pos = 1 (A > 0), tau_neg = 1.05 (A <= 0);
    seq-mean-token-mean (TRL's grpo normaliser for sapo). rho = 1: f = 2 / tau, df/dlog rho = 1."""
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    lp = [[-1.0, -0.5], [-1.0, -1.0]]
    value, grad, _ = _run("sapo", old, lp, [[1.0, 1.0], [-2.0, -2.0]], [[1, 1], [1, 0]], "seq-mean-token-mean")
    sig = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))
    row1 = -(2.0 + sig * 4) / 2
    row2 = 2 * 2 / 1.05
    assert value == pytest.approx((row1 + row2) / 2, rel=1e-12)
    expected = [[-1 / 4, -4 * sig * (1 - sig) * math.exp(0.5) / 4], [2 / 2, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64))
