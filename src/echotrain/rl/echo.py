"""ECHO's math, all of it: the batch ratio R, kappa, the rescaled token ratios, the token loss,
the step statistics (no-grad pre-pass sums, R, kappa, the gradient sum S) and the micro-batch
share of kappa's gradient (docs/design/objectives.md §4; the paper's equations are not public).

Our formulation: R = exp(mean log rho) (``geo``) or mean rho (``arith``) over the step's N valid
tokens; kappa = clip(R, 1 - eps_b_low, 1 + eps_b_high) / R; rho~ = kappa rho; l_{i,t} =
-min(rho~ A, clip(rho~, 1 - eps_low, 1 + eps_high) A), aggregated. The open choices are flags
(:func:`echo_token_loss`): ``echo_token_clip`` ("ppo" above, "none": l = -rho~ A, "truncate":
truncated weight min(rho~, c)) and ``echo_pessimistic`` (l = max(l(rho), l(rho~)) per token when
the batch clip fires). R comes from one function, :func:`batch_ratio`, whether the step is one
tensor (the loss's own path) or micro-batches and ranks (:data:`ECHO_STEP_STATS`, run by
:func:`echotrain.rl.compute_step_stats`). The registered loss is ``compute_policy_loss_echo`` in
:mod:`echotrain.rl.objectives`, which calls :func:`echo_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from echotrain.metrics import declare_metric
from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import (
    BATCH_RATIOS,
    ECHO_DEFAULT_BATCH_BAND,
    ECHO_TOKEN_CLIPS,
    PolicyLossConfig,
    check_bool,
    check_clip_width,
    loss_setting,
)
from echotrain.rl.step import LossStepStats, ReduceFn, StepBatch, StepStats, seq_weights
from echotrain.rl.surrogate import clamped_log_ratio, ppo_clip_loss


def _token_cap_check(v: object) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 1
    return None if ok else "must be a finite float >= 1 (the truncation cap on rho~; c < 1 would truncate on-policy tokens)"


#: ECHO's settings, declared with its registration (``register_policy_loss("echo", settings=...)``);
#: flat keys (``batch_clip_low=0.02``), as they were PolicyLossConfig fields before.
ECHO_SETTINGS = {
    "batch_clip_low": loss_setting(
        ECHO_DEFAULT_BATCH_BAND[0], "ECHO batch band eps_b_low: R_batch floor 1 - eps_b_low. No published value; "
        "ours (echotrain.rl.ECHO_DEFAULT_BATCH_BAND): with geo R, 1 - R estimates the step's KL, so the band bounds "
        "it; a PPO-sized 0.2 would never fire. The logged echo/R_batch_min/max show how often it does "
        "(docs/benchmarks.md, trainer section). Provisional.", check_clip_width("R floor 1 - eps_b_low > 0"),
        flat=True),
    "batch_clip_high": loss_setting(
        ECHO_DEFAULT_BATCH_BAND[1], "ECHO batch band eps_b_high: R_batch ceiling 1 + eps_b_high (ours, see "
        "batch_clip_low).", check_clip_width(), flat=True),
    "batch_ratio": loss_setting(
        "geo", "ECHO batch ratio: geo = exp(mean log rho) (estimates -KL drift; default) or arith = mean rho (the "
        "abstract's \"average importance sampling ratio\").", choices=BATCH_RATIOS, flat=True),
    "detach_kappa": loss_setting(
        False, "ECHO: detach kappa = R_bar/R (uniform rescaling, no L/R baseline term). Default False.", check_bool,
        flat=True),
    "echo_pessimistic": loss_setting(
        False, "ECHO: apply the batch factor kappa only where it lowers the surrogate, per token J = min(J(rho), "
        "J(kappa*rho)) (PPO's min one level up), so a batch ratio outside the band still pulls back. Default False "
        "(symmetric rescaling: with R outside the band and every token moving the same way the gradient can "
        "vanish); an open choice, see docs/design/objectives.md §4.", check_bool, flat=True),
    "echo_token_clip": loss_setting(
        "ppo", "ECHO token-level term on top of the batch clip: ppo (PPO/DAPO token clip with clip_ratio_low/high "
        "and clip_ratio_c; default), none (batch clip only: J = rho~ A), truncate (truncated importance weight "
        "min(rho~, echo_token_cap), no PPO clip; the gradient keeps flowing). clip_ratio_* apply only to ppo. Open "
        "choice, see docs/design/objectives.md §4.", choices=ECHO_TOKEN_CLIPS, flat=True),
    "echo_token_cap": loss_setting(
        2.0, "ECHO echo_token_clip=truncate: cap c >= 1 on the rescaled token ratio rho~ (truncated IS; 2.0 as in "
        "Yao et al. 2025, \"Your efficient RL framework secretly brings you off-policy RL training\"). Unused by "
        "the other token clips.", _token_cap_check, flat=True),
}


@dataclass(frozen=True)
class EchoStats:
    """ECHO's step-global batch statistics (docs/design/objectives.md §4); ``step.loss_stats``."""

    R: float  # batch ratio over all valid tokens of the step
    R_bar: float  # clip(R, 1 - eps_b_low, 1 + eps_b_high)
    kappa: float  # R_bar / R (1 inside the band)
    clipped: bool  # R outside the band
    num_tokens: float  # N, valid tokens of the step
    grad_sum: float  # S = sum_{i,t} w_{i,t} rho_{i,t} dl/drho~ (0 unless clipped and kappa not detached);
    # dl/drho~ of the configured token term (echo_token_clip), 0 where the pessimistic min chose rho


def batch_ratio(
    log_ratio_sum: torch.Tensor, ratio_sum: torch.Tensor | None, num_tokens: float | torch.Tensor, kind: str
) -> torch.Tensor:
    """ECHO's batch ratio R (0-d float64; 1 when there are no valid tokens) (design §4, step 1).

    ``geo``: R = exp(log_ratio_sum / N); ``arith``: R = ratio_sum / N, from the float64 sums of
    log rho and of rho over the step's N = ``num_tokens`` valid tokens (``ratio_sum`` may be
    None for ``geo``). ``num_tokens`` is a float (the step statistics) or a 0-d tensor (one
    tensor's count: no host sync). The sums carry gradient when the caller's do. Summed in
    float64 whatever the input dtype: in bfloat16 R would be rounded to steps of 2^-8..2^-7,
    coarser than the batch band.
    """
    if isinstance(num_tokens, torch.Tensor):
        n = num_tokens.clamp(min=1).to(torch.float64)
        empty = (num_tokens == 0).to(torch.float64)
    else:
        n = max(float(num_tokens), 1.0)
        empty = float(num_tokens == 0)
    if kind == "geo":
        return torch.exp(log_ratio_sum / n)
    return ratio_sum / n + empty


def batch_kappa(R: torch.Tensor, batch_clip_low: float, batch_clip_high: float) -> tuple[torch.Tensor, bool]:
    """kappa = clip(R, 1 - eps_b_low, 1 + eps_b_high) / R and whether the clip is active.

    Inside the band kappa is the constant 1 (no gradient), so ECHO's gradient is exactly the
    token-PPO gradient there; outside, d kappa = -(kappa / R) dR (design §4, step 2).
    """
    lo, hi = 1.0 - batch_clip_low, 1.0 + batch_clip_high
    r = float(R.detach())
    if r > hi:
        return hi / R, True
    if r < lo:
        return lo / R, True
    return torch.ones_like(R), False


def echo_token_loss(
    ratio: torch.Tensor, rho_tilde: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig, clipped: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ECHO's per-token loss ``(B, T)`` from rho and rho~ = kappa rho (design §4, steps 4-5).

    The token term l(x) of ``config.echo_token_clip``:

    - ``ppo``: l(x) = -min(x A, clip(x, 1 - eps_low, 1 + eps_high) A) (dual-clip if
      ``clip_ratio_c``), as :func:`~echotrain.rl.surrogate.ppo_clip_loss`;
    - ``none``: l(x) = -x A (batch clip only);
    - ``truncate``: l(x) = -A (sg(min(x, c)) + sg(min(1, c / x)) (x - sg(x))), c =
      ``echo_token_cap``: value -A min(x, c), gradient -A min(x, c) d log x, i.e. the truncated
      importance weight multiplies the score function and the gradient never vanishes, unlike
      a PPO clip (the truncated-IS convention of V-trace, arXiv 1802.01561, and of Yao et al.
      2025's truncated importance sampling).

    With ``config.echo_pessimistic`` and the batch clip active (``clipped``), each token takes
    l = max(l(rho), l(rho~)) (the surrogate min(J(rho), J(rho~))): the batch factor applies only
    where it lowers the surrogate; on ties the unrescaled branch is taken. Otherwise l = l(rho~).

    Args:
        ratio: ``(B, T)`` rho (may carry gradient); rho_tilde: ``(B, T)`` kappa rho.
        advantages: ``(B, T)`` A. config: the loss config. clipped: R is outside the band.

    Returns:
        ``(loss_mat (B, T), flags)``: bool ``(B, T)`` flags ``high``/``low``/``dual`` as
        :func:`~echotrain.rl.surrogate.ppo_clip_loss` (all False for ``none``/``truncate``),
        ``truncated`` (x > c under ``truncate``) and ``unscaled`` (the pessimistic min chose
        l(rho)), of the chosen branch.
    """

    def token_term(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        none = torch.zeros_like(x, dtype=torch.bool)
        if config.echo_token_clip == "ppo":
            loss, flags = ppo_clip_loss(x, advantages, config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c)
            return loss, {**flags, "truncated": none}
        if config.echo_token_clip == "none":
            return -advantages * x, {"high": none, "low": none, "dual": none, "truncated": none}
        # value -A min(x, c) exactly (so pessimistic ties between two truncated branches are exact ties);
        # gradient -A min(1, c / x) dx = -A min(x, c) d log x (x - sg(x) is exactly 0 in value)
        xd = x.detach()
        truncated = xd > config.echo_token_cap
        capped = torch.clamp(xd, max=config.echo_token_cap)
        return -advantages * (capped + (capped / xd) * (x - xd)), {"high": none, "low": none, "dual": none,
                                                                   "truncated": truncated}

    loss_t, flags_t = token_term(rho_tilde)
    if not (config.echo_pessimistic and clipped):
        return loss_t, {**flags_t, "unscaled": torch.zeros_like(flags_t["high"])}
    loss_u, flags_u = token_term(ratio)
    unscaled = loss_u >= loss_t
    loss = torch.where(unscaled, loss_u, loss_t)
    flags = {k: torch.where(unscaled, flags_u[k], flags_t[k]) for k in flags_t}
    return loss, {**flags, "unscaled": unscaled}


def _rescale(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig, log_ratio_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """rho~ = kappa rho from the whole step's tensors (design §4, steps 1-3).

    ``log_ratio`` is 0 at padding; ``log_ratio_sum`` is its float64 sum. R and kappa are float64
    0-d tensors; rho~ keeps ``log_ratio``'s dtype. For ``geo``, rho~ is formed as
    exp(log rho + log kappa): one pass fewer than a product. Inside the band kappa is the
    constant 1 and rho~ = rho (same value and gradient).
    """
    num_tokens = mask.sum()
    if cfg.batch_ratio == "geo":
        ratio = None
        R = batch_ratio(log_ratio_sum, None, num_tokens, "geo")
    else:
        ratio = torch.exp(log_ratio)
        R = batch_ratio(log_ratio_sum, torch.where(mask, ratio, 0).sum(dtype=torch.float64), num_tokens, "arith")
    kappa, clipped = batch_kappa(R, cfg.batch_clip_low, cfg.batch_clip_high)
    if cfg.detach_kappa:
        kappa = kappa.detach()
    if ratio is None:
        rho_t = torch.exp(log_ratio + torch.log(kappa)) if clipped else torch.exp(log_ratio)
    else:
        rho_t = kappa * ratio if clipped else ratio
    return rho_t, R, kappa, clipped


def echo_loss(
    log_ratio: torch.Tensor,
    log_ratio_sum: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_w: torch.Tensor,
    cfg: PolicyLossConfig,
    step: StepStats | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """ECHO's aggregated loss of one call (before the ``dp_size`` factor), its token flags and
    its own metrics.

    Without ``step`` the inputs are the whole step: R, kappa and rho~ come from them, with
    autograd through kappa. With ``step`` (micro-batches / ranks), R, kappa and S = sum_{i,t}
    w_{i,t} rho_{i,t} dl/drho~ come from the step's no-grad pre-pass (``step.loss_stats``, an
    :class:`EchoStats`), and the surrogate S * kappa_mb(theta) adds this micro-batch's share of
    the kappa gradient (:func:`kappa_gradient_share`), so that the accumulated gradient equals
    the single-tensor autograd gradient.

    Args:
        log_ratio: ``(B, T)`` clamped log rho, 0 at padding (carries grad).
        log_ratio_sum: its float64 sum (shared with the caller's ``ppo_kl``).
        advantages: ``(B, T)`` or broadcastable A. mask: bool ``(B, T)``.
        seq_w: ``(B,)`` float64 aggregation weights (``(B, T)`` with a rollout correction). cfg: the loss config.
        step: the step's statistics or None.

    Returns:
        ``(loss 0-d, flags, metrics)``: flags as :func:`echo_token_loss`; metrics
        ``echo/R_batch``, ``echo/kappa``, ``echo/batch_clipped`` (the step's values) and the local
        token shares of :func:`echo_token_metrics`.

    Raises:
        ValueError: ``step`` carries no :class:`EchoStats`.
    """
    geo = cfg.batch_ratio == "geo"
    if step is None:
        rho_t, R, kappa, clipped = _rescale(log_ratio, mask, cfg, log_ratio_sum)
        ratio = torch.exp(log_ratio) if cfg.echo_pessimistic and clipped else rho_t
        loss_mat, flags = echo_token_loss(ratio, rho_t, advantages, cfg, clipped)
        loss = weighted_sum(loss_mat, mask, seq_w)
        r_val, k_val = float(R.detach()), float(kappa.detach())
    else:
        echo = step.loss_stats
        if not isinstance(echo, EchoStats):
            raise ValueError("step has no ECHO statistics: compute_step_stats(..., loss_mode='echo') is required")
        clipped = echo.clipped
        pessimistic = cfg.echo_pessimistic and clipped
        if geo and not pessimistic:
            rho_t = torch.exp(log_ratio + math.log(echo.kappa)) if clipped else torch.exp(log_ratio)
            ratio = rho_t
        else:
            ratio = torch.exp(log_ratio)
            rho_t = echo.kappa * ratio if clipped else ratio
        loss_mat, flags = echo_token_loss(ratio, rho_t, advantages, cfg, clipped)
        loss = weighted_sum(loss_mat, mask, seq_w)
        if clipped and not cfg.detach_kappa:
            local_sum = log_ratio_sum if geo else torch.where(mask, ratio, 0).sum(dtype=torch.float64)
            share = kappa_gradient_share(local_sum, echo.R, echo.num_tokens, echo.R_bar, cfg.batch_ratio)
            loss = loss + (echo.grad_sum * share).to(loss.dtype)  # value 0; keeps the loss dtype
        r_val, k_val = echo.R, echo.kappa
    metrics = {"echo/R_batch": r_val, "echo/kappa": k_val, "echo/batch_clipped": float(clipped)}
    metrics.update(echo_token_metrics(flags, mask, cfg))
    return loss, flags, metrics


#: ECHO's metrics: the step's values (one per optimizer step) and the token shares of its flags
ECHO_METRICS = (
    declare_metric("echo/R_batch", reduce="mean", unit="ratio (1 = on-policy)", when="loss_mode=echo",
                   summary=True, panel="ECHO batch ratio", label="R_batch",
                   help="ECHO batch ratio R of the optimizer step (before its clip), mean over optimizer steps"),
    declare_metric("echo/kappa", reduce="mean", unit="ratio (1 = on-policy)", when="loss_mode=echo", summary=True,
                   panel="ECHO batch ratio", label="kappa",
                   help="ECHO rescaling factor kappa = clip(R) / R, mean over optimizer steps"),
    declare_metric("echo/batch_clipped", reduce="mean", unit="fraction of updates", when="loss_mode=echo",
                   panel="ECHO batch clip", label="batch clip fired",
                   help="share of the step's optimizer updates whose batch ratio R left the band"),
    declare_metric("pg_echo_unscaled_frac", reduce="token_mean", unit="fraction of tokens",
                   when="loss_mode=echo, echo_pessimistic=true",
                   help="share of valid tokens where the pessimistic min chose the unscaled loss l(rho)"),
    declare_metric("pg_echo_truncfrac", reduce="token_mean", unit="fraction of tokens",
                   when="loss_mode=echo, echo_token_clip=truncate",
                   help="share of valid tokens whose rescaled ratio exceeded echo_token_cap"),
)
ECHO_METRICS += (
    declare_metric("echo/R_batch_min", reduce="min", of="echo/R_batch", unit="ratio (1 = on-policy)",
                   when="loss_mode=echo", panel="ECHO batch ratio", label="R_batch min",
                   help="smallest batch ratio R over the step's optimizer steps"),
    declare_metric("echo/R_batch_max", reduce="max", of="echo/R_batch", unit="ratio (1 = on-policy)",
                   when="loss_mode=echo", panel="ECHO batch ratio", label="R_batch max",
                   help="largest batch ratio R over the step's optimizer steps"),
)


def echo_token_metrics(flags: dict[str, torch.Tensor], mask: torch.Tensor, cfg: PolicyLossConfig) -> dict[str, float]:
    """Local shares of valid tokens (token-weighted like ``pg_clipfrac``, not step values like
    ``echo/*``): ``pg_echo_unscaled_frac`` (the pessimistic min chose l(rho); only with
    ``echo_pessimistic``) and ``pg_echo_truncfrac`` (rho~ > c; only with ``truncate``)."""
    out: dict[str, float] = {}
    n = mask.sum().clamp(min=1)
    if cfg.echo_pessimistic:
        out["pg_echo_unscaled_frac"] = float((flags["unscaled"] & mask).sum() / n)
    if cfg.echo_token_clip == "truncate":
        out["pg_echo_truncfrac"] = float((flags["truncated"] & mask).sum() / n)
    return out


def kappa_gradient_share(local_sum: torch.Tensor, R: float, num_tokens: float, R_bar: float, kind: str) -> torch.Tensor:
    """A 0-d tensor of value 0 whose gradient is this micro-batch's share of d kappa.

    kappa = R_bar / R with R clipped (R_bar constant); R's derivative decomposes over tokens:
    ``geo`` dR = (R / N) sum d log rho, ``arith`` dR = (1 / N) sum d rho. ``local_sum`` is this
    micro-batch's masked sum of log rho (geo) or rho (arith), with grad. Summing the shares of
    every micro-batch and rank gives d kappa of the whole step.
    """
    delta = (local_sum - local_sum.detach()) / num_tokens
    r_local = R * torch.exp(delta) if kind == "geo" else R + delta
    kappa_local = R_bar / r_local
    return kappa_local - kappa_local.detach()


# --------------------------------------------------------------------------- step statistics


def _step_local_sums(mb: StepBatch, cfg: PolicyLossConfig) -> torch.Tensor:
    """``[sum log rho, sum rho]`` (float64) over one micro-batch's valid tokens, at the pre-pass log_prob."""
    mask = mb.response_mask
    lr = clamped_log_ratio(mb.log_prob, mb.old_log_prob, cfg.log_ratio_clamp, mask).to(torch.float64)
    return torch.stack([torch.where(mask, lr, 0).sum(), torch.where(mask, lr.exp(), 0).sum()])


def _step_finish(sums: torch.Tensor, mbs: list[StepBatch], step: StepStats, reduce_fn: ReduceFn) -> EchoStats:
    """R and kappa from the step's sums; when the batch clip is active and kappa is not detached,
    a second all-reduce round for S = sum_{i,t} w_{i,t} rho_{i,t} dl/drho~."""
    cfg = step.config
    R_t = batch_ratio(sums[0], sums[1], step.num_tokens, cfg.batch_ratio)
    kappa_t, clipped = batch_kappa(R_t, cfg.batch_clip_low, cfg.batch_clip_high)
    R, kappa = float(R_t), float(kappa_t)
    grad_sum = 0.0
    if clipped and not cfg.detach_kappa:
        s = torch.zeros(1, dtype=torch.float64, device=sums.device)
        for old, lp, adv, mask, gi, is_w in mbs:
            ratio = torch.exp(clamped_log_ratio(lp, old, cfg.log_ratio_clamp, mask))
            x = (kappa * ratio).detach().requires_grad_(True)
            with torch.enable_grad():
                loss_mat, _ = echo_token_loss(ratio, x, adv, cfg, clipped)
                w = seq_weights(mask, adv, step.loss_agg_mode, cfg, gi, step, is_w)
                (g,) = torch.autograd.grad(weighted_sum(loss_mat, mask, w), x)
            s += (g.to(torch.float64) * ratio.to(torch.float64)).sum()
        grad_sum = float(reduce_fn(s, "sum"))
    n = max(step.num_tokens, 1.0)
    return EchoStats(R=R, R_bar=R * kappa, kappa=kappa, clipped=clipped, num_tokens=n, grad_sum=grad_sum)


#: ECHO's declaration of its step statistics: the no-grad pre-pass, sums of log rho and rho, R.
ECHO_STEP_STATS = LossStepStats(needs_log_prob=True, num_sums=2, local_sums=_step_local_sums, finish=_step_finish,
                                ratio_only=True)
