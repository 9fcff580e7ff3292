"""Score-function losses with a detached weight: GPG, CISPO, DRO and VESPO.

Each is l_{i,t} = -sg(w_{i,t}) A_{i,t} log pi(o_{i,t}) (+ a penalty for DRO), aggregated with
``loss_agg_mode`` (:func:`~echotrain.rl.losses.common.score_function_loss`); the weight is what
tells them apart. All are per-token (or per-sequence) functions of one response, so micro-batch
exactness needs only the aggregation's step statistics.
"""

from __future__ import annotations

import math

import torch

from echotrain.metrics import declare_metric
from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import check_bool, check_non_negative, check_positive, loss_setting
from echotrain.rl.losses.common import masked_log_prob, ppo_kl, score_function_loss, token_share
from echotrain.rl.objectives import PreparedInputs, prepared_policy_loss, register_policy_loss


@register_policy_loss("gpg", metrics=("ppo_kl",), reads=())
@prepared_policy_loss("token-mean")
def compute_policy_loss_gpg(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG: plain policy gradient, l_{i,t} = -A_{i,t} log pi(o_{i,t}) (Chu et al., arXiv 2504.02546, Eq. 6).

    No ratio, no clip: the gradient is -A grad log pi (on-policy REINFORCE). The paper's own
    advantage rescaling (alpha = B / B_valid) is an advantage estimator, not part of this loss.
    Default ``loss_agg_mode`` ``token-mean`` (verl's). Inputs: ``old_log_prob``, ``log_prob``
    ``(B, T)`` float, ``advantages`` ``(B, T)`` or ``(B,)``, ``response_mask`` ``(B, T)``; verl's
    signature (:func:`~echotrain.rl.objectives.prepared_policy_loss`); returns ``(loss 0-d,
    metrics)`` with ``ppo_kl``; errors as :func:`~echotrain.rl.compute_policy_loss`.
    """
    loss_mat = score_function_loss(torch.ones_like(x.log_ratio), x.advantages, x.log_prob, x.mask)
    return weighted_sum(loss_mat, x.mask, x.seq_weights), {"ppo_kl": ppo_kl(x.log_ratio, x.mask)}


#: CISPO's setting (a flat key)
CISPO_SETTINGS = {
    "cispo_lower_clip": loss_setting(
        True, "CISPO (MiniMax-M1, arXiv 2506.13585 Eq. 4-5): clip the detached IS weight from below too, "
        "sg(clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high)) (true, verl's cispo: the default) or only from above, "
        "sg(min(rho, 1 + clip_ratio_high)) (false: TRL's cispo and the paper, which sets no lower bound). TRL's "
        "epsilon_high is the cap itself (ScaleRL, arXiv 2510.13786, recommends 5.0 = clip_ratio_high 4.0).",
        check_bool, flat=True),
}


@register_policy_loss("cispo", metrics=("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ppo_kl"),
                      reads=("clip_ratio_low", "clip_ratio_high", "cispo_lower_clip"), settings=CISPO_SETTINGS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_cispo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: clip the detached IS weight, keep every token's gradient (MiniMax-M1, arXiv 2506.13585, Eq. 4-5).

    l_{i,t} = -sg(r^_{i,t}) A_{i,t} log pi(o_{i,t}) with r^ = clip(rho, 1 - eps_low, 1 + eps_high)
    (``cispo_lower_clip=True``, verl's ``cispo``, the default) or r^ = min(rho, 1 + eps_high)
    (``cispo_lower_clip=False``: the paper's choice of no lower bound, and TRL's ``cispo``, whose
    ``epsilon_high`` is the cap 1 + eps_high itself). Unlike PPO, a clipped token still gets the
    gradient r^ A grad log pi. Default ``loss_agg_mode`` ``token-mean`` (verl's default; the
    paper's and TRL's normaliser is the batch token count, i.e. token-mean too). Metrics:
    ``pg_clipfrac`` (weight clipped), ``pg_clipfrac_high`` / ``pg_clipfrac_low`` (above / below),
    ``ppo_kl``. Shapes, signature and errors as :func:`compute_policy_loss_gpg`.
    """
    cfg = x.cfg
    ratio = torch.exp(x.log_ratio)
    high_cap = 1.0 + cfg.clip_ratio_high
    low_cap = 1.0 - cfg.clip_ratio_low if cfg.cispo_lower_clip else None
    weight = torch.clamp(ratio.detach(), min=low_cap, max=high_cap)
    loss_mat = score_function_loss(weight, x.advantages, x.log_prob, x.mask)
    high = ratio.detach() > high_cap
    low = ratio.detach() < low_cap if low_cap is not None else torch.zeros_like(high)
    h, lo = token_share(high, x.mask), token_share(low, x.mask)
    metrics = {"pg_clipfrac": h + lo, "pg_clipfrac_high": h, "pg_clipfrac_low": lo, "ppo_kl": ppo_kl(x.log_ratio, x.mask)}
    return weighted_sum(loss_mat, x.mask, x.seq_weights), metrics


#: DRO's setting (a flat key, verl's name)
DRO_SETTINGS = {
    "dro_beta": loss_setting(
        0.1, "DRO (verl's dro: REINFORCE with a quadratic log-ratio penalty, l = -(A log pi - beta/2 (log rho)^2)): "
        "beta > 0. verl has no default (it requires the key); 0.1 is ours, provisional: with unit-scale advantages "
        "it pulls back only when |log rho| approaches 10 A.",
        check_positive, flat=True),
}


@register_policy_loss("dro", metrics=("ppo_kl",), reads=("dro_beta",), settings=DRO_SETTINGS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_dro(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO as verl 0.9.1 defines it: l_{i,t} = -(A_{i,t} log pi(o_{i,t}) - (beta / 2) (log rho_{i,t})^2).

    REINFORCE plus a quadratic penalty on the log-ratio to the old policy, the per-token form of
    the KL-regularised square loss of Direct Reward Optimisation (Richemond et al., arXiv
    2405.19107, Eq. 5, with the old policy in place of the reference); gradient
    -(A - beta log rho) grad log pi. ``beta`` = ``dro_beta`` (> 0; verl has no default, ours 0.1).
    log rho is clamped to +-``log_ratio_clamp`` (verl does not clamp here). Default
    ``loss_agg_mode`` ``token-mean``. Shapes, signature and errors as
    :func:`compute_policy_loss_gpg`.
    """
    beta = x.cfg.dro_beta
    lp = masked_log_prob(x.log_prob, x.mask)
    loss_mat = -(lp * x.advantages - 0.5 * beta * x.log_ratio.square())
    return weighted_sum(loss_mat, x.mask, x.seq_weights), {"ppo_kl": ppo_kl(x.log_ratio, x.mask)}


#: log(1e-8): VESPO's floor on the sequence log-ratio (TRL's, "to match the original implementation").
VESPO_LOG_W_MIN = math.log(1e-8)


def vespo_weights(x: PreparedInputs) -> torch.Tensor:
    """VESPO's detached gamma weight phi ``(B, T)`` (arXiv 2602.10693; TRL's ``get_gamma_weights``).

    log w_i = clamp(sum_t log rho_{i,t}, log 1e-8, 20) (the sequence ratio is the *product* of
    the token ratios, not GSPO's geometric mean); phi = exp(lambda + k log w - lambda w), so
    phi(1) = 1, with (k, lambda) = (``vespo_k_pos``, ``vespo_lambda_pos``) where A >= 0 and the
    ``_neg`` pair where A < 0; non-finite phi -> 0 (as TRL).
    """
    cfg = x.cfg
    log_w = x.log_ratio.detach().to(torch.float64).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, 20.0)
    nonneg = x.advantages.detach() >= 0
    k = torch.where(nonneg, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(nonneg, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


#: the metric VESPO adds
VESPO_METRICS = (
    declare_metric("pg_vespo_phi", reduce="token_mean", unit="weight (1 = on-policy)", when="loss_mode=vespo",
                   help="vespo: mean gamma weight phi(w) over valid tokens"),
)


#: VESPO's settings (flat keys, TRL's names)
VESPO_SETTINGS = {
    "vespo_k_pos": loss_setting(
        2.0, "VESPO (arXiv 2602.10693) power k of the gamma weight phi(w) = e^lambda w^k e^(-lambda w) for A >= 0 "
        "(w: the sequence IS ratio). TRL's name and default 2.0.",
        check_non_negative, flat=True),
    "vespo_lambda_pos": loss_setting(
        3.0, "VESPO decay lambda for A >= 0 (TRL default 3.0).",
        check_positive, flat=True),
    "vespo_k_neg": loss_setting(
        3.0, "VESPO power k for A < 0 (TRL default 3.0).",
        check_non_negative, flat=True),
    "vespo_lambda_neg": loss_setting(
        2.0, "VESPO decay lambda for A < 0 (TRL default 2.0).",
        check_positive, flat=True),
}


@register_policy_loss("vespo", metrics=("pg_vespo_phi", "ppo_kl"), settings=VESPO_SETTINGS,
                      reads=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"))
@prepared_policy_loss("token-mean")
def compute_policy_loss_vespo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """VESPO: a smooth gamma weight of the sequence IS ratio instead of a clip (arXiv 2602.10693; TRL 1.16).

    l_{i,t} = -sg(phi_i) A_{i,t} log pi(o_{i,t}), phi = e^lambda w^k e^(-lambda w) of the sequence
    ratio w_i = prod_t rho_{i,t} (:func:`vespo_weights`): phi(1) = 1, it falls off both for
    w << 1 (power k) and w >> 1 (decay lambda), asymmetrically for A >= 0 / A < 0. Default
    ``loss_agg_mode`` ``token-mean`` (TRL normalises ``vespo`` by the batch's token count).
    Metrics: ``pg_vespo_phi`` (mean phi over valid tokens), ``ppo_kl``. Shapes, signature and
    errors as :func:`compute_policy_loss_gpg`.
    """
    phi = vespo_weights(x)
    loss_mat = score_function_loss(phi, x.advantages, x.log_prob, x.mask)
    with torch.no_grad():
        phi_mean = float(torch.where(x.mask, phi, 0).sum() / x.mask.sum().clamp(min=1))
    return weighted_sum(loss_mat, x.mask, x.seq_weights), {"pg_vespo_phi": phi_mean, "ppo_kl": ppo_kl(x.log_ratio, x.mask)}
