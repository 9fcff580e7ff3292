"""Policy losses: token PPO clip (GRPO/DAPO, dual-clip), GSPO, GSPO-token and ECHO.

Each loss is a function registered in :data:`POLICY_LOSSES` with verl's signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, *, group_index=None, step=None) -> (loss 0-d tensor, metrics dict[str, float])

Each builds a per-token loss matrix ``l (B, T)`` and hands it to the shared aggregation
(:mod:`echotrain.rl.aggregation`); ``step`` (from :func:`echotrain.rl.stepwise.compute_step_stats`)
supplies the step-global normalisers for exact micro-batching, and ``None`` means the inputs are
the whole optimizer step. Frameworks minimise ``loss = -J``. A new objective is one function
plus ``@register_policy_loss("name")``.

Metrics (valid tokens only, local to the call): ``pg_clipfrac`` (share of tokens whose clipped
branch is active: rho > 1 + eps_high with A > 0, or rho < 1 - eps_low with A < 0), split into
``pg_clipfrac_high`` / ``pg_clipfrac_low``; ``pg_clipfrac_lower`` (dual-clip cap active, A < 0);
``ppo_kl`` = mean(old_log_prob - log_prob). ECHO adds ``echo/R_batch``, ``echo/kappa``,
``echo/batch_clipped`` (the step's values), and, local to the call, ``pg_echo_unscaled_frac``
(with ``echo_pessimistic``) and ``pg_echo_truncfrac`` (with ``echo_token_clip="truncate"``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from echotrain.rl.aggregation import agg_weights, weighted_sum
from echotrain.rl.config import PolicyLossConfig, as_policy_loss_config
from echotrain.rl.validation import check_choice, check_group_index, check_token_inputs

if TYPE_CHECKING:  # pragma: no cover
    from echotrain.rl.stepwise import StepStats

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` in :data:`POLICY_LOSSES`.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- pure pieces


def clamped_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, clamp: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """log rho = clamp(log_prob - old_log_prob, -clamp, clamp), ``(B, T)`` (design §2).

    With ``mask`` (bool ``(B, T)``), padding positions are set to 0 (rho = 1) through
    ``torch.where``, so NaN/Inf log-probs there reach neither a value nor a gradient: a product
    ``0 * NaN`` in any later backward (e.g. through ECHO's kappa) would poison every token.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -clamp, clamp)
    return log_ratio if mask is None else torch.where(mask, log_ratio, 0)


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped loss l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    With ``clip_ratio_c`` (dual-clip, arXiv 1912.09729, Eq. 5) the loss of A < 0 tokens is
    capped at -A c; A >= 0 tokens are untouched.

    Args:
        ratio: ``(B, T)`` importance ratio rho (any float dtype).
        advantages: ``(B, T)`` A, same shape.
        clip_ratio_low, clip_ratio_high: eps_low, eps_high.
        clip_ratio_c: dual-clip c > 1, or None.

    Returns:
        ``(loss_mat (B, T), flags)`` where flags are bool ``(B, T)`` tensors ``high``
        (A > 0, rho > 1 + eps_high), ``low`` (A < 0, rho < 1 - eps_low) and ``dual``
        (A < 0 and the cap -A c is active).
    """
    l_unclipped = -advantages * ratio
    l_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(l_unclipped, l_clipped)
    clip_active = l_clipped > l_unclipped
    flags = {"high": clip_active & (advantages > 0), "low": clip_active & (advantages < 0)}
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        flags["dual"] = dual
    else:
        flags["dual"] = torch.zeros_like(clip_active)
    return loss, flags


def clip_metrics(
    flags: dict[str, torch.Tensor],
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    log_ratio_sum: torch.Tensor | None = None,
) -> dict[str, float]:
    """verl's metrics from :func:`ppo_clip_loss` flags, over valid tokens only (0 if none).

    ``log_ratio_sum`` (the masked sum of ``log_ratio``) may be passed when already computed.
    """
    with torch.no_grad():
        if log_ratio_sum is None:
            log_ratio_sum = torch.where(mask, log_ratio, 0).sum(dtype=torch.float64)
        counts = torch.stack([(flags[k] & mask).sum() for k in ("high", "low", "dual")]).to(torch.float64)
        values = torch.cat([counts, -log_ratio_sum.detach().to(torch.float64).reshape(1)])
        high, low, dual, kl = (values / mask.sum().clamp(min=1)).tolist()
    return {"pg_clipfrac": high + low, "pg_clipfrac_high": high, "pg_clipfrac_low": low,
            "pg_clipfrac_lower": dual, "ppo_kl": kl}


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's (1/|o_i|) sum_t log rho_{i,t} over valid tokens, ``(B,)`` (0 for empty responses).

    Masked positions get neither value nor gradient (arXiv 2507.18071, Eq. 7).
    """
    lengths = mask.sum(-1).clamp(min=1).to(log_ratio.dtype)
    return torch.where(mask, log_ratio, 0).sum(-1) / lengths


def batch_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, kind: str, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """ECHO's batch ratio R over all valid tokens (0-d float64; 1 when there are none).

    ``geo``: R = exp(mean log rho); ``arith``: R = mean rho (design §4, step 1). ``ratio``
    (= exp(log_ratio)) may be passed to save an ``exp``. Summed in float64 whatever the input
    dtype: in bfloat16 R would be rounded to steps of 2^-8..2^-7, coarser than the batch band.
    """
    n = mask.sum().clamp(min=1).to(torch.float64)
    if kind == "geo":
        return torch.exp(torch.where(mask, log_ratio, 0).sum(dtype=torch.float64) / n)
    ratio = torch.exp(log_ratio) if ratio is None else ratio
    return torch.where(mask, ratio, 0).sum(dtype=torch.float64) / n + (~mask.any()).to(torch.float64)


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
      ``clip_ratio_c``), as :func:`ppo_clip_loss`;
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
        :func:`ppo_clip_loss` (all False for ``none``/``truncate``), ``truncated`` (x > c under
        ``truncate``) and ``unscaled`` (the pessimistic min chose l(rho)), of the chosen branch.
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


def echo_token_ratios(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """ECHO's rescaled token ratios rho~ = kappa rho over one whole step (the loss's own path).

    Returns:
        ``(rho_tilde (B, T), R 0-d, kappa 0-d, clipped)``; R and kappa are float64, rho~ has
        the inputs' dtype and holds kappa at padding (rho := 1 there); kappa carries gradient
        through R unless ``config.detach_kappa``.
    """
    mask = response_mask.bool()
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config.log_ratio_clamp, mask)
    return _echo_rescale(log_ratio, mask, config, log_ratio.sum(dtype=torch.float64))


def _echo_rescale(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig, log_ratio_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """rho~ = kappa rho from the whole step's tensors (design §4, steps 1-3).

    ``log_ratio`` is 0 at padding; ``log_ratio_sum`` is its float64 sum. R and kappa are float64
    0-d tensors; rho~ keeps ``log_ratio``'s dtype. For ``geo``, rho~ is formed as
    exp(log rho + log kappa): one pass fewer than a product. Inside the band kappa is the
    constant 1 and rho~ = rho (same value and gradient).
    """
    if cfg.batch_ratio == "geo":
        ratio = None
        R = torch.exp(log_ratio_sum / mask.sum().clamp(min=1).to(torch.float64))
    else:
        ratio = torch.exp(log_ratio)
        R = batch_ratio(log_ratio, mask, "arith", ratio)
    kappa, clipped = batch_kappa(R, cfg.batch_clip_low, cfg.batch_clip_high)
    if cfg.detach_kappa:
        kappa = kappa.detach()
    if ratio is None:
        rho_t = torch.exp(log_ratio + torch.log(kappa)) if clipped else torch.exp(log_ratio)
    else:
        rho_t = kappa * ratio if clipped else ratio
    return rho_t, R, kappa, clipped


# --------------------------------------------------------------------------- aggregation glue


def _seq_weights(
    mask: torch.Tensor,
    advantages: torch.Tensor,
    loss_agg_mode: str,
    cfg: PolicyLossConfig,
    group_index: torch.Tensor | None,
    step: "StepStats | None",
) -> torch.Tensor:
    """Per-sequence aggregation weights, from the step's statistics when given."""
    if step is None:
        return agg_weights(
            mask,
            loss_agg_mode,
            advantages=advantages,
            group_index=group_index,
            norm_constant=cfg.norm_constant,
            ba_scope=cfg.ba_scope,
            ba_count_zero_adv=cfg.ba_count_zero_adv,
        )
    if step.loss_agg_mode != loss_agg_mode:
        raise ValueError(f"step was computed for loss_agg_mode={step.loss_agg_mode!r}, not {loss_agg_mode!r}")
    if step.config is not None and step.config != cfg:
        raise ValueError(f"step was computed with config {step.config}, not {cfg}")
    return agg_weights(
        mask,
        loss_agg_mode,
        advantages=advantages,
        group_index=group_index,
        **step.agg_kwargs(cfg),
    )


def _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index, step):
    cfg = as_policy_loss_config(config)
    advantages, mask = check_token_inputs(old_log_prob, log_prob, advantages, response_mask)
    if group_index is not None:
        check_group_index("group_index", group_index, mask.shape[0])
    w = _seq_weights(mask, advantages, loss_agg_mode, cfg, group_index, step)
    return cfg, advantages, mask, w


def _dp(step: "StepStats | None") -> int:
    return 1 if step is None else step.dp_size


# --------------------------------------------------------------------------- losses


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    group_index: torch.Tensor | None = None,
    step: "StepStats | None" = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clip with an asymmetric band: GRPO, DAPO clip-higher, optional dual-clip.

    l_{i,t} = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(log_prob -
    old_log_prob) (PPO arXiv 1707.06347 Eq. 7; DAPO arXiv 2503.14476 Eq. 10; dual-clip
    arXiv 1912.09729), then aggregated with ``loss_agg_mode``.

    Args:
        old_log_prob, log_prob: ``(B, T)`` float log-probs (nats) of the sampled tokens.
        advantages: ``(B, T)`` or ``(B,)`` float.
        response_mask: ``(B, T)`` bool or 0/1.
        loss_agg_mode: one of :data:`echotrain.rl.AGG_MODES`.
        config: :class:`PolicyLossConfig` or dict.
        group_index: ``(B,)`` int prompt-group ids (``balanced`` only).
        step: step-global statistics (:mod:`echotrain.rl.stepwise`) or None.

    Returns:
        ``(loss 0-d, metrics)``.

    Raises:
        ValueError / TypeError: see :func:`compute_policy_loss`.
    """
    cfg, adv, mask, w = _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index, step)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
    loss_mat, flags = ppo_clip_loss(torch.exp(log_ratio), adv, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c)
    loss = weighted_sum(loss_mat, mask, w) * _dp(step)
    return loss, clip_metrics(flags, log_ratio, mask)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    group_index: torch.Tensor | None = None,
    step: "StepStats | None" = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one clipped sequence ratio per response (arXiv 2507.18071, Eq. 5-7).

    s_i = exp((1/|o_i|) sum_t log rho_{i,t}) over valid tokens; l_{i,t} = -min(s_i A_{i,t},
    clip(s_i, 1 - eps_low, 1 + eps_high) A_{i,t}) on every valid token, aggregated with
    ``loss_agg_mode`` (the paper's J is ``seq-mean-token-mean``, this function's default).
    The gradient flows through s_i: d s_i = s_i (1/|o_i|) sum_t d log pi. Typical
    eps: 3e-4 / 4e-4. Arguments, returns and errors as :func:`compute_policy_loss_vanilla`.
    """
    cfg, adv, mask, w = _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index, step)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
    seq_log_ratio = sequence_log_ratio(log_ratio, mask).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    s = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(log_ratio)
    loss_mat, flags = ppo_clip_loss(s, adv, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c)
    loss = weighted_sum(loss_mat, mask, w) * _dp(step)
    return loss, clip_metrics(flags, log_ratio, mask)


@register_policy_loss("gspo_token")
def compute_policy_loss_gspo_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    group_index: torch.Tensor | None = None,
    step: "StepStats | None" = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: s_{i,t} = sg[s_i] * pi(o_{i,t}) / sg[pi(o_{i,t})] (arXiv 2507.18071, Eq. 13-14).

    Same value as s_i; the gradient of token t is s_i A_{i,t} d log pi(o_{i,t}) (times the
    aggregation weight), so per-token advantages are possible. verl's ``gspo`` is this form.
    Arguments, returns and errors as :func:`compute_policy_loss_vanilla`.
    """
    cfg, adv, mask, w = _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index, step)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
    seq_log_ratio = sequence_log_ratio(log_ratio, mask).detach().unsqueeze(-1)
    c = cfg.log_ratio_clamp
    # where, not a product: log_prob may be -inf/NaN at padding (-inf - -inf = NaN)
    s_token = torch.exp(torch.clamp(seq_log_ratio + torch.where(mask, log_prob - log_prob.detach(), 0), -c, c))
    loss_mat, flags = ppo_clip_loss(s_token, adv, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c)
    loss = weighted_sum(loss_mat, mask, w) * _dp(step)
    return loss, clip_metrics(flags, log_ratio, mask)


@register_policy_loss("echo")
def compute_policy_loss_echo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    group_index: torch.Tensor | None = None,
    step: "StepStats | None" = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ECHO: clip the batch ratio R, rescale every token ratio by kappa, token-clip on top.

    Our formulation (docs/design/objectives.md §4; the paper's equations are not public):
    R = exp(mean log rho) (``geo``) or mean rho (``arith``) over the step's N valid tokens;
    kappa = clip(R, 1 - eps_b_low, 1 + eps_b_high) / R; rho~ = kappa rho;
    l_{i,t} = -min(rho~ A, clip(rho~, 1 - eps_low, 1 + eps_high) A), aggregated (defaults).
    The open choices are flags (:func:`echo_token_loss`): ``echo_token_clip`` ("ppo" above,
    "none": l = -rho~ A, "truncate": truncated weight min(rho~, c)) and ``echo_pessimistic``
    (l = max(l(rho), l(rho~)) per token when the batch clip fires). The closed forms below are
    for the defaults; with pessimism only the tokens whose l(rho~) is chosen carry the kappa term.
    When R clips, the gradient gains a baseline built from L = (1/N) sum rho A and R (token-mean,
    token clip inactive; both tested against autograd):

    - ``arith``: grad J = (kappa / N) sum rho (A - b) grad log pi, with b = L / R (design page);
    - ``geo``:   grad J = (kappa / N) sum (rho A - L) grad log pi (d log R / d log rho = 1/N),
      i.e. the same form with a per-token b_t = L / rho_t.

    Inside the band kappa = 1 with no gradient: value and gradient equal ``vanilla``.

    With ``step`` (micro-batches / ranks), R, kappa and S = sum_{i,t} w_{i,t} rho_{i,t}
    dl/drho~ come from the step's no-grad pre-pass, and the surrogate S * kappa_mb(theta) adds
    this micro-batch's share of the kappa gradient, so that the accumulated gradient equals the
    single-tensor autograd gradient. Arguments, returns and errors as
    :func:`compute_policy_loss_vanilla`.
    """
    cfg, adv, mask, w = _prepare(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index, step)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
    log_ratio_sum = log_ratio.sum(dtype=torch.float64)  # shared by R_geo, its gradient share and ppo_kl
    geo = cfg.batch_ratio == "geo"
    if step is None:
        rho_t, R, kappa, clipped = _echo_rescale(log_ratio, mask, cfg, log_ratio_sum)
        ratio = torch.exp(log_ratio) if cfg.echo_pessimistic and clipped else rho_t
        loss_mat, flags = echo_token_loss(ratio, rho_t, adv, cfg, clipped)
        loss = weighted_sum(loss_mat, mask, w)
        r_val, k_val = float(R.detach()), float(kappa.detach())
    else:
        echo = step.echo
        if echo is None:
            raise ValueError("step has no ECHO statistics: compute_step_stats(..., loss_mode='echo') is required")
        clipped = echo.clipped
        pessimistic = cfg.echo_pessimistic and clipped
        if geo and not pessimistic:
            rho_t = torch.exp(log_ratio + math.log(echo.kappa)) if clipped else torch.exp(log_ratio)
            ratio = rho_t
        else:
            ratio = torch.exp(log_ratio)
            rho_t = echo.kappa * ratio if clipped else ratio
        loss_mat, flags = echo_token_loss(ratio, rho_t, adv, cfg, clipped)
        loss = weighted_sum(loss_mat, mask, w)
        if clipped and not cfg.detach_kappa:
            local_sum = log_ratio_sum if geo else torch.where(mask, ratio, 0).sum(dtype=torch.float64)
            share = kappa_gradient_share(local_sum, echo.R, echo.num_tokens, echo.R_bar, cfg.batch_ratio)
            loss = loss + (echo.grad_sum * share).to(loss.dtype)  # value 0; keeps the loss dtype
        r_val, k_val = echo.R, echo.kappa
    metrics = clip_metrics(flags, log_ratio, mask, log_ratio_sum)
    metrics.update({"echo/R_batch": r_val, "echo/kappa": k_val, "echo/batch_clipped": float(clipped)})
    metrics.update(_echo_token_metrics(flags, mask, cfg))
    return loss * _dp(step), metrics


def _echo_token_metrics(flags: dict[str, torch.Tensor], mask: torch.Tensor, cfg: PolicyLossConfig) -> dict[str, float]:
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


def compute_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
    *,
    group_index: torch.Tensor | None = None,
    step: "StepStats | None" = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to the policy loss registered as ``loss_mode`` in :data:`POLICY_LOSSES`.

    Args:
        loss_mode: "vanilla", "gspo", "gspo_token" or "echo" (or any registered name).
        old_log_prob, log_prob: ``(B, T)`` float log-probs (nats); ``log_prob`` carries grad.
            Padding may hold anything (NaN, -inf): it gets neither value nor gradient.
            float32/bfloat16/float64; with float16, rho = exp(log rho) overflows for
            log rho > ~11 (the clamp is ``log_ratio_clamp`` = 20), so pass float32 log-probs.
        advantages: ``(B, T)`` or ``(B,)`` float.
        response_mask: ``(B, T)`` bool or 0/1.
        loss_agg_mode: one of :data:`echotrain.rl.AGG_MODES`.
        config: :class:`PolicyLossConfig` or a dict with its keys (None: defaults).
        group_index: ``(B,)`` int prompt-group ids, needed by ``balanced``.
        step: :class:`echotrain.rl.stepwise.StepStats` for exact micro-batching; None means
            the inputs are the whole optimizer step.

    Returns:
        ``(loss, metrics)``: 0-d tensor (minimise it) and ``dict[str, float]``.

    Raises:
        ValueError: unknown ``loss_mode`` / ``loss_agg_mode`` (lists the valid ones), shape
            mismatch, NaN/Inf at valid tokens, non-0/1 mask, bad config, missing inputs of
            the aggregation (``norm_constant``, ``group_index``), ``step`` computed for another
            mode or another config.
        TypeError: non-tensor inputs, non-integer ``group_index``.
    """
    check_choice("loss_mode", loss_mode, POLICY_LOSSES)
    if step is not None and step.loss_mode != loss_mode:
        raise ValueError(f"step was computed for loss_mode={step.loss_mode!r}, not {loss_mode!r}")
    return POLICY_LOSSES[loss_mode](
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, group_index=group_index, step=step
    )
