"""Sharpness of the training loss: top Hessian eigenvalue, Hessian trace, SAM sharpness.

The measures used by Zhou, Wang, Mao et al. (ICLR 2025, arXiv 2410.10373) to compare SGD, SAM
and late-phase SAM, after Foret et al. (ICLR 2021, Sec. 4.2) and Yao et al., "PyHessian"
(IEEE BigData 2020, arXiv 1912.07145):

- lambda_max(H), H = d^2 L / dw^2 on a fixed data subset in eval mode, by Lanczos (default) or
  power iteration on Hessian-vector products Hv = d(g . v)/dw (double backprop, Pearlmutter 1994).
- tr(H) by Hutchinson's estimator E_v[v^T H v], v with i.i.d. Rademacher entries (Hutchinson 1990).
- first-order SAM sharpness L(w + rho g/||g||) - L(w) (Foret et al. 2021, eq. 1 with the
  first-order solution of the inner max).

Every function takes ``loss_fn``, a callable returning the scalar loss on a *fixed* data subset
(build one for a model with :func:`model_loss_fn`, which also switches to eval mode), and the
parameters ``params`` the Hessian is taken over. The gradient graph is built once per call and
reused for every Hessian-vector product, so the data subset must fit in memory at once.

Why not depend on PyHessian (0.1, 2021): it does run on torch 2.13 CPU with ``cuda=False``, but
it is unmaintained since 2021, draws its random vectors from the global RNG (no seed argument),
uses ``backward(create_graph=True)`` (which leaves a graph on ``.grad``; torch warns about the
reference cycle), its trace stopping rule divides by the signed running mean (wrong for a
negative trace), and it has no Lanczos for the top eigenvalue (power iteration only, relative
tolerance 1e-3 by default). The algorithms are short; ours are ~150 lines and tested against
the dense Hessian from ``torch.autograd.functional.hessian``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

LossFn = Callable[[], torch.Tensor]


# --- building a loss on a fixed subset --------------------------------------------------------


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the body and restore every module's training flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.train(flag)


def model_loss_fn(
    model: nn.Module,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    data: tuple[torch.Tensor, torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> LossFn:
    """A ``loss_fn`` for the functions below: the mean loss of ``model`` on a fixed subset, eval mode.

    Args:
        model: the network; it is put in eval mode during each call (dropout off, BatchNorm on
            its running statistics) and restored after.
        criterion: mean-reduced loss, ``criterion(model(x), y) -> 0-d tensor``.
        data: one ``(inputs, targets)`` pair, or a list of pairs whose losses are averaged
            weighted by batch size (``len(inputs)``), so the result is the mean over all examples.

    Raises:
        ValueError: ``data`` is empty.
    """
    batches = [data] if isinstance(data, tuple) else list(data)
    if not batches:
        raise ValueError("data is empty: give at least one (inputs, targets) batch")
    total = float(sum(len(x) for x, _ in batches))

    def loss_fn() -> torch.Tensor:
        with eval_mode(model):
            return sum(criterion(model(x), y) * (len(x) / total) for x, y in batches)  # type: ignore[return-value]

    return loss_fn


# --- Hessian-vector products ------------------------------------------------------------------


def _as_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    ps = [p for p in params if p.requires_grad]
    if not ps:
        raise ValueError("params holds no tensor with requires_grad=True")
    return ps


def _checked_loss(loss_fn: LossFn) -> torch.Tensor:
    loss = loss_fn()
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-d tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
    if not torch.isfinite(loss):
        raise ValueError(f"loss_fn returned a non-finite loss ({loss.item()})")
    return loss


class HessianOperator:
    """v -> Hv for the Hessian of ``loss_fn`` w.r.t. ``params``, at the current weights.

    Builds the gradient graph once (forward + backward with ``create_graph=True``); each
    :meth:`matvec` is then one extra backward pass. Vectors are lists of tensors shaped like
    ``params``.

    Raises:
        ValueError: ``params`` has no trainable tensor; ``loss_fn`` returns a non-scalar or
            non-finite loss.
    """

    def __init__(self, loss_fn: LossFn, params: Iterable[torch.Tensor]) -> None:
        self.params = _as_params(params)
        with torch.enable_grad():
            self.loss = _checked_loss(loss_fn)
            grads = torch.autograd.grad(self.loss, self.params, create_graph=True, allow_unused=True)
        self.grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]

    def matvec(self, v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Hv, one tensor per parameter (zeros where the loss does not depend on it)."""
        live = [(g, x) for g, x in zip(self.grads, v) if g.requires_grad]
        if not live:
            return [torch.zeros_like(p) for p in self.params]
        with torch.enable_grad():
            hv_live = torch.autograd.grad(
                [g for g, _ in live], self.params, grad_outputs=[x for _, x in live],
                retain_graph=True, allow_unused=True,
            )
        return [torch.zeros_like(p) if h is None else h.detach() for p, h in zip(self.params, hv_live)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _norm(a: Sequence[torch.Tensor]) -> float:
    return math.sqrt(_dot(a, a))


def _axpy(alpha: float, x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [yi + alpha * xi for xi, yi in zip(x, y)]


def _scale(alpha: float, x: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [alpha * xi for xi in x]


def _randn_like(params: Sequence[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p) for p in params]


# --- top eigenvalue ---------------------------------------------------------------------------


@dataclass
class EigenResult:
    """Result of :func:`top_hessian_eigenvalue`.

    Attributes:
        eigenvalue: the estimate of lambda_max (units of the loss per squared parameter unit).
        eigenvector: unit-norm estimate of its eigenvector, tensors shaped like ``params``.
        iterations: Hessian-vector products used.
        converged: whether the stopping rule was met before ``max_iter``.
    """

    eigenvalue: float
    eigenvector: list[torch.Tensor]
    iterations: int
    converged: bool


def top_hessian_eigenvalue(
    loss_fn: LossFn,
    params: Iterable[torch.Tensor],
    method: str = "lanczos",
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
) -> EigenResult:
    """The largest eigenvalue of the Hessian of ``loss_fn`` w.r.t. ``params``.

    Args:
        loss_fn: scalar loss on a fixed data subset (:func:`model_loss_fn`).
        params: the tensors the Hessian is taken over (typically ``model.parameters()``).
        method: ``"lanczos"`` (default): Lanczos with full reorthogonalisation; returns the
            algebraically largest Ritz value, stopping when its residual bound
            ``|beta_k s_k|`` <= ``tol * |theta|`` or the Krylov space is exhausted; needs
            ``max_iter`` stored vectors. ``"power"``: power iteration, stopping when the
            Rayleigh quotient changes by <= ``tol * |lambda|``; finds the eigenvalue of largest
            *magnitude* (the same as lambda_max near a minimum, where H is almost PSD).
        max_iter: at most this many Hessian-vector products, >= 1.
        tol: relative tolerance, > 0.
        seed: seeds the random start vector (CPU generator), so results are reproducible.

    Returns:
        :class:`EigenResult`.

    Raises:
        ValueError: unknown ``method``; ``max_iter`` < 1; ``tol`` <= 0; bad ``loss_fn``/``params``.
    """
    if method not in ("lanczos", "power"):
        raise ValueError(f"method={method!r} is unknown; valid: ['lanczos', 'power']")
    if max_iter < 1:
        raise ValueError(f"max_iter={max_iter!r} must be >= 1")
    if not tol > 0:
        raise ValueError(f"tol={tol!r} must be > 0")
    op = HessianOperator(loss_fn, params)
    gen = torch.Generator().manual_seed(seed)
    v = _randn_like(op.params, gen)
    v = _scale(1.0 / _norm(v), v)
    if method == "power":
        return _power(op, v, max_iter, tol)
    return _lanczos(op, v, max_iter, tol)


def _power(op: HessianOperator, v: list[torch.Tensor], max_iter: int, tol: float) -> EigenResult:
    lam_prev = None
    for it in range(1, max_iter + 1):
        hv = op.matvec(v)
        lam = _dot(v, hv)  # Rayleigh quotient, ||v|| = 1
        norm = _norm(hv)
        if norm == 0.0:  # Hv = 0: v is in the null space; all eigenvalues seen are 0
            return EigenResult(0.0, v, it, True)
        v = _scale(1.0 / norm, hv)
        if lam_prev is not None and abs(lam - lam_prev) <= tol * abs(lam):
            return EigenResult(lam, v, it, True)
        lam_prev = lam
    return EigenResult(lam, v, max_iter, False)


def _lanczos(op: HessianOperator, q: list[torch.Tensor], max_iter: int, tol: float) -> EigenResult:
    qs: list[list[torch.Tensor]] = [q]
    alphas: list[float] = []
    betas: list[float] = []
    converged = False
    for j in range(max_iter):
        w = op.matvec(qs[j])
        alphas.append(_dot(w, qs[j]))
        # Full reorthogonalisation against every Lanczos vector (twice: "twice is enough").
        for _ in range(2):
            for qi in qs:
                w = _axpy(-_dot(w, qi), qi, w)
        beta = _norm(w)
        k = len(alphas)
        t = torch.zeros(k, k, dtype=torch.float64)
        t[range(k), range(k)] = torch.tensor(alphas, dtype=torch.float64)
        if k > 1:
            off = torch.tensor(betas, dtype=torch.float64)
            t[range(k - 1), range(1, k)] = off
            t[range(1, k), range(k - 1)] = off
        evals, evecs = torch.linalg.eigh(t)
        theta, s = float(evals[-1]), evecs[:, -1]
        residual = abs(beta * float(s[-1]))
        scale = max(abs(a) for a in alphas) or 1.0
        if beta <= 1e-10 * scale or residual <= tol * max(abs(theta), 1e-30):
            converged = True
            break
        if j + 1 < max_iter:
            betas.append(beta)
            qs.append(_scale(1.0 / beta, w))
    vec = [torch.zeros_like(p) for p in op.params]
    for coef, qi in zip(s.tolist(), qs):
        vec = _axpy(coef, qi, vec)
    return EigenResult(theta, vec, len(alphas), converged)


# --- trace ------------------------------------------------------------------------------------


@dataclass
class TraceResult:
    """Result of :func:`hessian_trace`: the estimate, its standard error and the sample count."""

    trace: float
    std_error: float
    samples: int


def hessian_trace(
    loss_fn: LossFn,
    params: Iterable[torch.Tensor],
    samples: int = 100,
    seed: int = 0,
) -> TraceResult:
    """Hutchinson's estimate of tr(H): the mean of v^T H v over Rademacher vectors v.

    Unbiased; the variance of one sample is 2 * sum_{i != j} H_ij^2 (zero for a diagonal H,
    where every sample is exact). ``std_error`` is the sample std / sqrt(samples) (0 for one
    sample), so the true trace lies within a few standard errors.

    Args:
        loss_fn, params: as for :func:`top_hessian_eigenvalue`.
        samples: number of random vectors (Hessian-vector products), >= 1.
        seed: seeds the Rademacher vectors (CPU generator).

    Raises:
        ValueError: ``samples`` < 1; bad ``loss_fn``/``params``.
    """
    if samples < 1:
        raise ValueError(f"samples={samples!r} must be >= 1")
    op = HessianOperator(loss_fn, params)
    gen = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(samples):
        v = [(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p) for p in op.params]
        values.append(_dot(v, op.matvec(v)))
    vals = torch.tensor(values, dtype=torch.float64)
    se = float(vals.std(unbiased=True) / math.sqrt(samples)) if samples > 1 else 0.0
    return TraceResult(float(vals.mean()), se, samples)


# --- SAM sharpness ----------------------------------------------------------------------------


def sam_sharpness(loss_fn: LossFn, params: Iterable[torch.Tensor], rho: float = 0.05) -> float:
    """First-order SAM sharpness L(w + rho g/||g||) - L(w), g = grad L(w) (Foret et al. 2021).

    The weights are restored exactly afterwards. A zero gradient gives 0.0.

    Args:
        loss_fn, params: as for :func:`top_hessian_eigenvalue`.
        rho: radius, finite and >= 0.

    Raises:
        ValueError: bad ``rho``; bad ``loss_fn``/``params``; non-finite gradient.
    """
    if not (0.0 <= rho < float("inf")):
        raise ValueError(f"rho={rho!r} must be finite and >= 0")
    ps = _as_params(params)
    with torch.enable_grad():
        loss = _checked_loss(loss_fn)
        grads = torch.autograd.grad(loss, ps, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(ps, grads)]
    norm = _norm(grads)
    if not math.isfinite(norm):
        raise ValueError(f"the gradient norm is {norm}; cannot perturb")
    if norm == 0.0:
        return 0.0
    saved = [p.detach().clone() for p in ps]
    try:
        with torch.no_grad():
            for p, g in zip(ps, grads):
                p.add_(g, alpha=rho / norm)
            perturbed = _checked_loss(loss_fn)
    finally:
        with torch.no_grad():
            for p, w in zip(ps, saved):
                p.copy_(w)
    return float(perturbed.detach()) - float(loss.detach())
