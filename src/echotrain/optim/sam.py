"""Sharpness-Aware Minimization (SAM) wrapping any ``torch.optim`` optimizer.

Foret, Kleiner, Mobahi, Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving
Generalization", ICLR 2021 (arXiv 2010.01412), eq. 2; adaptive SAM (ASAM) from Kwon et al.,
ICML 2021 (arXiv 2102.11600), eq. 9. One SAM step on a batch B:

    g     = grad L_B(w)
    e     = rho * T(w)^2 g / (|| T(w) g || + eps)      T(w) = I (SAM) or diag|w| (ASAM)
    g_sam = grad L_B(w + e)
    w     <- base_optimizer_update(w, g_sam)           (w itself is restored before the update)

The norm is the global L2 norm over every parameter that has a gradient, across all param
groups. A zero gradient gives e = 0 (the ``eps`` keeps the division finite).

Why our own class rather than ``pytorch_optimizer.SAM`` (4.1.0): the core is ~40 lines, and we
need three things it leaves to the caller — BatchNorm running statistics updated only in the
first pass, a gradient-scaler path where an inf/NaN in the first pass skips the whole step, and
wrapping an optimizer that is already built (the late-phase switch in
:mod:`echotrain.optim.late_sam` wraps the trainer's SGD without rebuilding it).

Usage (the closure computes the loss and its gradients at the current weights; ``step`` calls
it twice, once at ``w`` and once at ``w + e``, and zeroes the gradients before each call)::

    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9, model=model)
    for x, y in loader:
        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        loss = opt.step(closure)

Gradient clipping: pass ``max_grad_norm``; SAM clips g_sam (the second pass's gradient) to it
after unscaling (with a ``grad_scaler``) and before the base update. Clipping the first pass's g
would rescale it as a whole, which leaves e unchanged (only the direction of g enters e), so only
g_sam is clipped. Without a scaler, clipping at the end of the closure is the same thing; with a
scaler it is not possible there (the gradients are still scaled, and ``unscale_`` may only be
called once per optimizer and step), hence the argument.

Non-finite gradients (the rule of :mod:`echotrain.optim.finite`): without a scaler, a NaN/Inf
gradient in either pass raises ``FloatingPointError`` naming the parameter, with the weights back
at w and the base optimizer's state untouched; with a scaler the step is skipped instead.

Note: davda54/sam's ``step(closure)`` expects the first backward to be done *before* ``step``
and calls the closure once; ours calls it for both passes, like ``torch.optim.LBFGS`` calls its
closure as often as it needs. ``first_step`` / ``second_step`` are there for manual loops.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from echotrain.optim.registry import SAM_SETTINGS, register_optimizer
from echotrain.optim.finite import first_nonfinite_grad, nonfinite_grad_message

Closure = Callable[[], torch.Tensor]


@contextlib.contextmanager
def frozen_running_stats(model: nn.Module | None) -> Iterator[None]:
    """Run the body with the running statistics of every BatchNorm-like module frozen.

    The buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) of every
    ``_NormBase`` module (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm with
    ``track_running_stats=True``) are copied before the body and copied back after it, so the
    forward pass still normalises with the batch statistics (training mode is unchanged) but the
    running averages end exactly as they were. Used for SAM's second forward pass: the running
    statistics must reflect the weights ``w``, not the perturbed ``w + e`` (Foret et al. 2021,
    official code; momentum 0.1 and batch mean 1 leave running_mean 0.1 after one step, not 0.19).

    Args:
        model: the module tree to freeze; ``None`` makes this a no-op.
    """
    if model is None:
        yield
        return
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buf = getattr(module, name, None)
                if buf is not None:
                    saved.append((buf, buf.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


def _resolve_base(base_optimizer: Any) -> Any:
    """A registry name (``"sgd"``) becomes its class; classes and instances pass through."""
    if isinstance(base_optimizer, str):
        from echotrain.optim.registry import optimizer_class  # lazy: the registry imports us lazily

        return optimizer_class(base_optimizer)
    return base_optimizer


class SAM(torch.optim.Optimizer):
    """Sharpness-Aware Minimization around a base optimizer (Foret et al. 2021, eq. 2).

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim`` optimizer. Pass
            ``None`` when ``base_optimizer`` is an already-built optimizer (its groups are used).
        base_optimizer: the optimizer that applies the update with the SAM gradient: a
            ``torch.optim.Optimizer`` subclass (built here on ``params`` with ``**base_kwargs``),
            a name from :data:`echotrain.optim.registry.OPTIMIZERS` (``"sgd"``), or an optimizer
            instance (wrapped as it is, its state and param groups shared).
        rho: neighbourhood radius (L2 ball), >= 0. Foret et al. use 0.05 on CIFAR-10; ASAM
            needs about 10x larger (Kwon et al. use 0.5-2.0). Can differ per param group.
        adaptive: ASAM: scale the perturbation by |w| (Kwon et al. 2021, eq. 9).
        eps: added to the gradient norm, > 0; keeps a zero gradient from giving NaN.
        model: if given, the running statistics of its BatchNorm modules are frozen during the
            second forward pass of :meth:`step` (see :func:`frozen_running_stats`).
        max_grad_norm: clip the global L2 norm of the SAM gradient g_sam to this value in
            :meth:`step`, after unscaling when a ``grad_scaler`` is given (None or 0: no
            clipping). See the module docstring for why only g_sam.
        **base_kwargs: passed to ``base_optimizer`` when it is a class or a name (``lr``,
            ``momentum``, ``weight_decay`` ...).

    The param groups and the state are the base optimizer's own (shared objects), so an LR
    scheduler built on either object changes both, and ``state_dict()`` holds the base
    optimizer's state (momentum buffers ...) plus ``rho``/``adaptive`` in each group.

    Raises:
        ValueError: ``rho`` (or a param group's ``rho``) negative or not finite; ``eps`` not
            positive; ``max_grad_norm`` negative or not finite; ``params`` given together with an optimizer instance that does not hold
            exactly those parameters; ``base_kwargs`` given with an instance.
    """

    def __init__(
        self,
        params: Iterable[Any] | None,
        base_optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | str,
        rho: float = 0.05,
        adaptive: bool = False,
        eps: float = 1e-12,
        model: nn.Module | None = None,
        max_grad_norm: float | None = None,
        **base_kwargs: Any,
    ) -> None:
        if max_grad_norm is not None and not (0.0 <= max_grad_norm < float("inf")):
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be None or a finite number >= 0")
        if not (rho >= 0.0 and rho < float("inf")):
            raise ValueError(f"rho={rho!r} must be finite and >= 0")
        if not eps > 0.0:
            raise ValueError(f"eps={eps!r} must be > 0")
        base_optimizer = _resolve_base(base_optimizer)
        defaults = dict(rho=rho, adaptive=adaptive)
        if isinstance(base_optimizer, torch.optim.Optimizer):
            if base_kwargs:
                raise ValueError(
                    f"base_kwargs {sorted(base_kwargs)} cannot be applied to an already-built "
                    "base_optimizer; set them on that optimizer instead"
                )
            if params is not None:
                given = {id(p) for p in _flatten_params(params)}
                held = {id(p) for g in base_optimizer.param_groups for p in g["params"]}
                if given != held:
                    raise ValueError(
                        "params must be None or exactly the parameters of the base_optimizer instance"
                    )
            base = base_optimizer
            for group in base.param_groups:
                for key, value in defaults.items():
                    group.setdefault(key, value)
            super().__init__(base.param_groups, defaults)
        else:
            if params is None:
                raise ValueError("params is None but base_optimizer is a class, not an optimizer instance")
            super().__init__(params, defaults)
            base = base_optimizer(self.param_groups, **base_kwargs)
        self.base_optimizer = base
        # Share the groups and the state: one source of truth for lr, momentum buffers, saving.
        self.param_groups = base.param_groups
        for i, group in enumerate(self.param_groups):
            if not (group["rho"] >= 0.0 and group["rho"] < float("inf")):
                raise ValueError(f"rho={group['rho']!r} of param group {i} must be finite and >= 0")
        self.state = base.state
        self.defaults.update(base.defaults)
        self.model = model
        self.eps = eps
        self.max_grad_norm = max_grad_norm or None
        # w before the perturbation, kept outside `state` so it never reaches a checkpoint.
        self._saved_w: dict[torch.Tensor, torch.Tensor] = {}

    # --- the two halves of a SAM step -------------------------------------------------------

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm || T(w) g || over all params with a gradient (a 0-d tensor).

        T(w) = |w| in groups with ``adaptive=True``, the identity otherwise. 0 if no gradient.
        Computed in the gradients' dtype when they all share one of float32/float64, in float32
        for bfloat16/float16, and in float64 when the dtypes are mixed (so a float64 model gets
        a float64-exact perturbation).
        """
        grads = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        dtypes = {p.grad.dtype for _, p in grads}
        if len(dtypes) > 1:
            dtype = torch.float64
        else:
            dtype = torch.float64 if dtypes == {torch.float64} else torch.float32
        device = grads[0][1].grad.device
        norms = []
        for group, p in grads:
            g = p.grad.to(dtype)
            if group["adaptive"]:
                g = g * p.detach().to(dtype).abs()
            norms.append(torch.linalg.vector_norm(g).to(device))
        return torch.linalg.vector_norm(torch.stack(norms))

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> torch.Tensor:
        """Move to w + e, e = rho T(w)^2 g / (||T(w) g|| + eps), with g the current ``.grad``.

        Saves w so that :meth:`second_step` restores it exactly (a copy, not w + e - e).

        Returns:
            the gradient norm ||T(w) g|| (0-d fp32 tensor).

        Raises:
            FloatingPointError: the gradient norm is NaN or Inf (with mixed precision use
                ``step(closure, grad_scaler=...)``, which skips such steps instead).
            RuntimeError: called again before :meth:`second_step` / :meth:`restore` (the saved
                w would be lost).
        """
        if self._saved_w:
            raise RuntimeError("first_step called twice without second_step(): the weights are still perturbed")
        norm = self.grad_norm()
        if not torch.isfinite(norm):
            hit = first_nonfinite_grad(self.param_groups)
            where = nonfinite_grad_message("SAM first_step", hit) if hit else "SAM first_step"
            raise FloatingPointError(
                f"{where}; the gradient norm is {norm.item()}; pass grad_scaler= to step() to skip such steps"
            )
        for group in self.param_groups:
            scale = group["rho"] / (norm + self.eps)  # in the norm's dtype (see grad_norm)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._saved_w[p] = p.detach().clone()
                e = p.grad.to(scale.dtype) * scale.to(device=p.device)
                if group["adaptive"]:
                    e = e * p.detach().to(scale.dtype).square()
                p.add_(e.to(p.dtype))
        if zero_grad:
            self.zero_grad()
        return norm

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the weights w saved by :meth:`first_step` (no-op if nothing is saved)."""
        for p, w in self._saved_w.items():
            p.copy_(w)
        self._saved_w.clear()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Restore w and step the base optimizer with the gradient now in ``.grad`` (g_sam).

        Raises:
            FloatingPointError: a gradient is NaN/Inf (:mod:`echotrain.optim.finite`); w is
                restored and the base optimizer has not stepped.
        """
        self.restore()
        hit = first_nonfinite_grad(self.param_groups)
        if hit is not None:
            raise FloatingPointError(nonfinite_grad_message("SAM second_step (gradient at w + e)", hit))
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self) -> None:
        """Clip the global L2 norm of ``.grad`` to ``max_grad_norm`` (no-op when it is None)."""
        if self.max_grad_norm:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    # --- the whole step ---------------------------------------------------------------------

    def step(self, closure: Closure | None = None, grad_scaler: Any | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """One SAM step: closure at w, perturb, closure at w + e, restore, base update.

        Args:
            closure: computes the loss on the batch, calls ``backward`` (on
                ``grad_scaler.scale(loss)`` when a scaler is used) and returns the loss; it need
                not zero the gradients (done here before each call). Called twice, on the same
                batch; BatchNorm statistics are frozen on the second call when ``model`` was
                given.
            grad_scaler: a ``torch.amp.GradScaler``: the gradients of each pass are unscaled;
                an inf/NaN in the first pass skips the step (weights untouched), one in the
                second pass skips the base update (weights restored). Call
                ``grad_scaler.update()`` after this, as usual (the scale is reduced once).
                ``max_grad_norm`` then clips the unscaled g_sam.

        Returns:
            the closure's loss at w (first pass).

        Raises:
            ValueError: ``closure`` is None.
            FloatingPointError: without a scaler, a NaN/Inf gradient in either pass (weights
                back at w, base optimizer not stepped).
            Whatever the closure raises; if it raises in the second pass, w is restored first.
        """
        if closure is None:
            raise ValueError("closure is required: SAM re-evaluates the loss at the perturbed weights")
        closure = torch.enable_grad()(closure)
        self.zero_grad()
        loss = closure()
        if grad_scaler is not None:
            grad_scaler.unscale_(self)  # records found_inf for this step, read by update()
            if not torch.isfinite(self.grad_norm()):
                self.zero_grad()
                return loss
        self.first_step(zero_grad=True)
        try:
            with frozen_running_stats(self.model):
                closure()
        except BaseException:
            self.restore()  # never leave the weights at w + e (the next step could not start)
            raise
        self.restore()
        self.base_update(grad_scaler, "SAM step (gradient at w + e)")
        return loss

    def base_update(self, grad_scaler: Any | None, where: str) -> None:
        """Step the base optimizer with the gradient now in ``.grad``, clipped to ``max_grad_norm``.

        Without a scaler a NaN/Inf gradient raises (nothing written); with one the gradients are
        unscaled first and the scaler skips the step on an inf/NaN.

        Args:
            grad_scaler: optional ``torch.amp.GradScaler``.
            where: names the step in the ``FloatingPointError`` message.

        Raises:
            FloatingPointError: without a scaler, a NaN/Inf gradient (:mod:`echotrain.optim.finite`).
        """
        if grad_scaler is None:
            hit = first_nonfinite_grad(self.param_groups)
            if hit is not None:
                raise FloatingPointError(nonfinite_grad_message(where, hit))
            self.clip_grad_norm_()
            self.base_optimizer.step()
        else:
            # The scaler allows one unscale_ per optimizer per update(); SAM's second pass is
            # unscaled and checked through the base optimizer, which has its own record.
            grad_scaler.unscale_(self.base_optimizer)
            self.clip_grad_norm_()  # on unscaled gradients; an inf makes them NaN, and step skips
            grad_scaler.step(self.base_optimizer)

    # --- saving -----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`; keeps the groups/state shared with the base."""
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state


def _flatten_params(params: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            ps = item["params"]
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            out.append(item)
    return out


register_optimizer("sam", "echotrain.optim.sam:SAM", takes=SAM_SETTINGS, wraps_base=True)
