"""KL estimators between the policy and a reference policy, per token (design §6).

With x = ref_log_prob - log_prob = log(pi_ref / pi) on tokens sampled from pi
(J. Schulman, "Approximating KL divergence", 2020):

- ``k1`` = -x: unbiased for KL(pi || pi_ref); as a *loss* its gradient d log pi has expectation
  0, so use it as a reward penalty, not a loss term.
- ``k2`` = x^2 / 2: biased value; as a loss its gradient (log pi - log pi_ref) d log pi is
  unbiased for grad KL(pi || pi_ref) (reverse KL).
- ``k3`` = exp(x) - x - 1 (GRPO's estimator, DeepSeekMath Eq. 4): unbiased, non-negative
  value; as a loss its gradient (1 - pi_ref / pi) d log pi has expectation grad KL(pi_ref || pi)
  (forward KL).

For k2 and k3, x is clamped to +-``clamp`` *before* ``exp`` / the square, so that value and
gradient are finite for extreme inputs (clamping only the output hides the overflow and still
gives NaN gradients); outside the clamp the gradient is 0. This also keeps NaN/Inf log-probs at
padding positions from sending a NaN gradient (0 * inf) back through the masked aggregation.
"""

from __future__ import annotations

from typing import Callable

import torch

from echotrain.registry import Registry
from echotrain.rl.validation import check_choice, check_same_shape, check_tensor

KlEstimatorFn = Callable[[torch.Tensor, float], torch.Tensor]
#: ``kl_penalty`` name -> ``fn(x, clamp) -> (B, T)`` per-token estimate, x = ref_log_prob - log_prob.
KL_ESTIMATOR_REGISTRY: Registry[KlEstimatorFn] = Registry("KL estimator", "kl_penalty")
#: The registered KL estimator names (a live view of :data:`KL_ESTIMATOR_REGISTRY`).
KL_ESTIMATORS = KL_ESTIMATOR_REGISTRY.names()


def register_kl_estimator(name: str) -> Callable[[KlEstimatorFn], KlEstimatorFn]:
    """Decorator: register ``fn(x, clamp) -> (B, T)`` as ``kl_penalty=name``.

    ``x`` = ref_log_prob - log_prob, unclamped, in ``log_prob``'s dtype; ``clamp`` (> 0) is the
    bound the estimator should apply before any ``exp`` or power (see the module docstring).

    Raises:
        ValueError: ``name`` is already registered.
    """
    return KL_ESTIMATOR_REGISTRY.register(name)


def kl_penalty(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str = "k3", clamp: float = 20.0
) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)`` in the dtype of ``log_prob`` (nats).

    Args:
        log_prob: ``(B, T)`` log pi of the sampled tokens (carries grad).
        ref_log_prob: ``(B, T)`` log pi_ref of the same tokens.
        kl_penalty: "k1", "k2" or "k3" (verl's argument name).
        clamp: bound on |x| before ``exp`` / the square (k2 and k3).

    Raises:
        ValueError: unknown estimator (lists the valid ones), shape mismatch, clamp <= 0.
    """
    check_choice("kl_penalty", kl_penalty, KL_ESTIMATORS)
    check_tensor("log_prob", log_prob)
    check_tensor("ref_log_prob", ref_log_prob)
    check_same_shape("log_prob", log_prob, ref_log_prob=ref_log_prob)
    if not clamp > 0:
        raise ValueError(f"clamp must be > 0, got {clamp}")
    return KL_ESTIMATOR_REGISTRY[kl_penalty](ref_log_prob - log_prob, clamp)


@register_kl_estimator("k1")
def _k1(x: torch.Tensor, clamp: float) -> torch.Tensor:
    """-x: gradient -1 * upstream, finite even where x is not (no clamp needed)."""
    return -x


@register_kl_estimator("k2")
def _k2(x: torch.Tensor, clamp: float) -> torch.Tensor:
    """x^2 / 2 of the clamped x."""
    return 0.5 * x.clamp(-clamp, clamp).square()


@register_kl_estimator("k3")
def _k3(x: torch.Tensor, clamp: float) -> torch.Tensor:
    """exp(x) - x - 1 of the clamped x; expm1 keeps it >= 0 for tiny x in fp32."""
    x = x.clamp(-clamp, clamp)
    return torch.expm1(x) - x
