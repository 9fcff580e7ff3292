"""Sharpness measures against closed forms and the dense Hessian."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from echotrain.optim.sharpness import (
    HessianOperator,
    hessian_trace,
    model_loss_fn,
    sam_sharpness,
    top_hessian_eigenvalue,
)

# A quadratic L(w) = 0.5 * sum_i h_i w_i^2 + c . w over two tensors: Hessian diag(h).
H1 = torch.tensor([[0.5, 2.0, 3.0], [1.0, 4.0, 0.25]])
H2 = torch.tensor([5.5, -1.0])
LAMBDA_MAX = 5.5
TRACE = float(H1.sum() + H2.sum())  # 15.25


def _quadratic():
    torch.manual_seed(0)
    w1 = torch.randn(2, 3, requires_grad=True)
    w2 = torch.randn(2, requires_grad=True)
    c = torch.randn(8)

    def loss_fn():
        return 0.5 * (H1 * w1**2).sum() + 0.5 * (H2 * w2**2).sum() + (c[:6] * w1.flatten()).sum() + (c[6:] * w2).sum()

    return loss_fn, [w1, w2], c


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_top_eigenvalue_of_diagonal_quadratic_to_1e4(method):
    loss_fn, params, c = _quadratic()
    res = top_hessian_eigenvalue(loss_fn, params, method=method, max_iter=200, tol=1e-7, seed=1)
    assert res.converged
    assert abs(res.eigenvalue - LAMBDA_MAX) < 1e-4
    # the eigenvector is e_{w2[0]} up to sign
    assert abs(abs(float(res.eigenvector[1][0])) - 1.0) < 1e-3
    assert float(res.eigenvector[0].abs().max()) < 1e-2


def test_trace_of_diagonal_quadratic_is_exact():
    # For a diagonal H every Rademacher sample v^T H v equals tr(H): the stated tolerance is
    # float32 rounding, 1e-5 relative.
    loss_fn, params, c = _quadratic()
    res = hessian_trace(loss_fn, params, samples=10, seed=3)
    assert res.trace == pytest.approx(TRACE, rel=1e-5)
    assert res.std_error < 1e-5


def _mlp_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    return model, x, y


def _dense_hessian(model, x, y):
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    flat0 = torch.cat([p.detach().flatten() for p in params]).double()

    def f(flat):
        chunks = torch.split(flat, sizes)
        ws = {name: c.view(s).float() for (name, _), c, s in zip(model.named_parameters(), chunks, shapes)}
        out = torch.func.functional_call(model, ws, (x,))
        return F.cross_entropy(out, y).double()

    return torch.autograd.functional.hessian(f, flat0)


def test_eigenvalue_and_trace_of_mlp_match_dense_hessian():
    model, x, y = _mlp_problem()
    hess = _dense_hessian(model, x, y)
    evals = torch.linalg.eigvalsh(hess)
    loss_fn = model_loss_fn(model, F.cross_entropy, (x, y))
    res = top_hessian_eigenvalue(loss_fn, model.parameters(), max_iter=100, tol=1e-8)
    assert res.eigenvalue == pytest.approx(float(evals[-1]), rel=1e-4)
    tr = hessian_trace(loss_fn, model.parameters(), samples=400, seed=0)
    exact = float(torch.trace(hess))
    # Hutchinson is unbiased; allow 4 standard errors (and the std error itself must be sane)
    assert abs(tr.trace - exact) < 4 * tr.std_error
    var_one_sample = 2 * float((hess**2).sum() - (torch.diagonal(hess) ** 2).sum())
    assert tr.std_error == pytest.approx(math.sqrt(var_one_sample / 400), rel=0.3)


def test_hessian_vector_product_matches_dense_hessian():
    model, x, y = _mlp_problem()
    hess = _dense_hessian(model, x, y)
    op = HessianOperator(model_loss_fn(model, F.cross_entropy, (x, y)), model.parameters())
    torch.manual_seed(1)
    v = [torch.randn_like(p) for p in op.params]
    hv = torch.cat([t.flatten() for t in op.matvec(v)]).double()
    expected = hess @ torch.cat([t.flatten() for t in v]).double()
    torch.testing.assert_close(hv, expected, rtol=1e-4, atol=1e-6)


def test_sam_sharpness_closed_form_on_quadratic():
    # L(w + e) - L(w) = g.e + 0.5 e^T H e with e = rho g/||g||, g = H w + c
    loss_fn, params, c = _quadratic()
    w1, w2 = (p.detach().clone() for p in params)
    g = torch.cat([(H1 * w1).flatten() + c[:6], H2 * w2 + c[6:]])
    h = torch.cat([H1.flatten(), H2])
    rho = 0.1
    e = rho * g / g.norm()
    expected = float(g @ e + 0.5 * (h * e * e).sum())
    assert sam_sharpness(loss_fn, params, rho=rho) == pytest.approx(expected, rel=1e-4)
    assert torch.equal(params[0].detach(), w1) and torch.equal(params[1].detach(), w2)  # restored


def test_sam_sharpness_zero_gradient_is_zero():
    w = torch.zeros(3, requires_grad=True)
    assert sam_sharpness(lambda: (w**2).sum(), [w]) == 0.0


def test_model_loss_fn_uses_eval_mode_and_restores_training_flag():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 1))
    model.train()
    x, y = torch.randn(10, 3), torch.randn(10, 1)
    loss_fn = model_loss_fn(model, F.mse_loss, [(x[:4], y[:4]), (x[4:], y[4:])])
    a, b = loss_fn(), loss_fn()
    assert torch.equal(a, b)  # dropout off
    assert model.training and model[1].training
    with torch.no_grad():
        model.eval()
        full = F.mse_loss(model(x), y)
    torch.testing.assert_close(a, full)  # size-weighted mean over the batches


def test_bad_inputs_raise_clear_errors():
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="method"):
        top_hessian_eigenvalue(lambda: (w**2).sum(), [w], method="arnoldi")
    with pytest.raises(ValueError, match="0-d"):
        top_hessian_eigenvalue(lambda: w**2, [w])
    with pytest.raises(ValueError, match="non-finite"):
        hessian_trace(lambda: (w * float("nan")).sum(), [w])
    with pytest.raises(ValueError, match="requires_grad"):
        hessian_trace(lambda: (w**2).sum(), [torch.ones(2)])
    with pytest.raises(ValueError, match="samples"):
        hessian_trace(lambda: (w**2).sum(), [w], samples=0)
    with pytest.raises(ValueError, match="rho"):
        sam_sharpness(lambda: (w**2).sum(), [w], rho=-1.0)
    with pytest.raises(ValueError, match="empty"):
        model_loss_fn(nn.Linear(2, 1), F.mse_loss, [])
