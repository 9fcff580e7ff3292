"""On-policy distillation's divergence (echotrain.rl.distill): hand values, the closed-form gradient
of the reverse KL, TRL parity (GKDTrainer.generalized_jsd_loss) in float64, the top-k variant."""

from __future__ import annotations

import math

import pytest
import torch

from echotrain.rl.distill import distill_token_divergence, generalized_jsd, teacher_top_k, top_k_divergence

S = [0.5, 0.25, 0.25]  # student probabilities
T = [0.25, 0.25, 0.5]  # teacher probabilities


def _log(p):
    return torch.tensor(p, dtype=torch.float64).log()


def test_hand_values_reverse_forward_and_jsd():
    # KL(S || T) = 0.5 ln 2 + 0.25 ln 1 + 0.25 ln 0.5 = 0.25 ln 2; KL(T || S) = 0.25 ln 0.5 + 0.5 ln 2 = 0.25 ln 2
    ln2 = math.log(2)
    assert generalized_jsd(_log(S), _log(T), 1.0).item() == pytest.approx(0.25 * ln2, abs=1e-15)
    assert generalized_jsd(_log(S), _log(T), 0.0).item() == pytest.approx(0.25 * ln2, abs=1e-15)
    # beta = 0.5: M = (0.375, 0.25, 0.375); JSD = 0.5 KL(T||M) + 0.5 KL(S||M), by hand:
    m = [0.375, 0.25, 0.375]
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))  # noqa: E731
    want = 0.5 * kl(T, m) + 0.5 * kl(S, m)
    assert generalized_jsd(_log(S), _log(T), 0.5).item() == pytest.approx(want, abs=1e-15)
    # beta = 0.2: M = 0.8 S + 0.2 T, weights 0.2 on KL(T||M), 0.8 on KL(S||M) (TRL's weighting)
    m = [0.8 * a + 0.2 * b for a, b in zip(S, T)]
    assert generalized_jsd(_log(S), _log(T), 0.2).item() == pytest.approx(0.2 * kl(T, m) + 0.8 * kl(S, m), abs=1e-15)
    # equal distributions: 0 for every beta
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(_log(S), _log(S), beta).item() == pytest.approx(0.0, abs=1e-15)


def test_reverse_kl_gradient_is_closed_form():
    """d KL(softmax(z) || t) / dz_j = s_j (log s_j - log t_j - KL)."""
    torch.manual_seed(0)
    z = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    t = torch.log_softmax(torch.randn(2, 3, 7, dtype=torch.float64), -1)
    s = torch.log_softmax(z, -1)
    kl = generalized_jsd(s, t, 1.0)
    kl.sum().backward()
    with torch.no_grad():
        want = s.exp() * (s - t - kl.unsqueeze(-1))
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_trl_parity_float64(beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    torch.manual_seed(1)
    student = torch.randn(3, 5, 11, dtype=torch.float64)
    teacher = torch.randn(3, 5, 11, dtype=torch.float64)
    # TRL: sum over the vocabulary and the valid positions, divided by the number of valid positions
    labels = torch.zeros(3, 5, dtype=torch.long)
    labels[1, 3:] = -100
    trl = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, reduction="batchmean")
    ours = generalized_jsd(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1), beta)
    valid = labels != -100
    torch.testing.assert_close(ours[valid].sum() / valid.sum(), trl, rtol=0, atol=1e-12)


def test_top_k_hand_value_and_full_k_is_exact():
    # teacher top-2 of T = tokens 2 (0.5) and one of the 0.25s; renormalised over them: (2/3, 1/3)
    s, t = _log([0.5, 0.2, 0.3]).view(1, 1, 3), _log([0.2, 0.3, 0.5]).view(1, 1, 3)
    values, idx = teacher_top_k(t, 2)
    assert idx.tolist() == [[[2, 1]]]
    s_k, t_k = [0.3 / 0.5, 0.2 / 0.5], [0.5 / 0.8, 0.3 / 0.8]
    want = sum(a * math.log(a / b) for a, b in zip(s_k, t_k))
    got = top_k_divergence(s, values, idx, 1.0)
    assert got.item() == pytest.approx(want, abs=1e-15)
    # k = V: the exact divergence
    torch.manual_seed(2)
    s = torch.log_softmax(torch.randn(2, 4, 9, dtype=torch.float64), -1)
    t = torch.log_softmax(torch.randn(2, 4, 9, dtype=torch.float64), -1)
    for beta in (0.0, 0.5, 1.0):
        v, i = teacher_top_k(t, 9)
        torch.testing.assert_close(top_k_divergence(s, v, i, beta), generalized_jsd(s, t, beta), rtol=0, atol=1e-12)
        torch.testing.assert_close(distill_token_divergence(s, beta=beta, teacher_values=v, teacher_indices=i),
                                   distill_token_divergence(s, beta=beta, teacher_log_prob=t), rtol=0, atol=1e-12)


def test_errors_name_the_problem():
    s = _log(S).view(1, 1, 3)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(s, s, 1.5)
    with pytest.raises(ValueError, match="must match"):
        generalized_jsd(s, s[..., :2], 1.0)
    with pytest.raises(ValueError, match="1 <= k <= vocabulary size 3"):
        teacher_top_k(s, 4)
    with pytest.raises(ValueError, match="exactly one"):
        distill_token_divergence(s, beta=1.0)
