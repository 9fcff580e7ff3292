"""Policy losses: token PPO clip (GRPO/DAPO, dual-clip), GSPO, GSPO-token and ECHO; the registry.

The field's other losses (CISPO, SAPO, GMPO, DPPO, GPG, Clip-/KL-Cov, DRO, LUSPO, VESPO) are
registrations in :mod:`echotrain.rl.losses`, built on the pieces here.

Each loss is a function registered in :data:`POLICY_LOSSES` with verl's signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, *, group_index=None, step=None) -> (loss 0-d tensor, metrics dict[str, float])

Each builds a per-token loss matrix ``l (B, T)`` and hands it to the shared aggregation
(:mod:`echotrain.rl.aggregation`); ``step`` (from :func:`echotrain.rl.stepwise.compute_step_stats`)
supplies the step-global normalisers for exact micro-batching, and ``None`` means the inputs are
the whole optimizer step. Frameworks minimise ``loss = -J``. A new objective is one function
plus ``@register_policy_loss("name")`` (with ``step_stats=`` when it needs step-global values
beyond the aggregation's, as ECHO does); ``@prepared_policy_loss(default_agg)`` gives a
function of the checked inputs verl's signature.

Metrics (valid tokens only, local to the call): ``pg_clipfrac`` (share of tokens whose clipped
branch is active: rho > 1 + eps_high with A > 0, or rho < 1 - eps_low with A < 0), split into
``pg_clipfrac_high`` / ``pg_clipfrac_low``; ``pg_clipfrac_lower`` (dual-clip cap active, A < 0);
``ppo_kl`` = mean(old_log_prob - log_prob). ECHO adds ``echo/R_batch``, ``echo/kappa``,
``echo/batch_clipped`` (the step's values), and, local to the call, ``pg_echo_unscaled_frac``
(with ``echo_pessimistic``) and ``pg_echo_truncfrac`` (with ``echo_token_clip="truncate"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from echotrain.rl.aggregation import weighted_sum
from echotrain.metrics import METRICS, Metric, declare_metric
from echotrain.rl.config import (
    LOSS_SETTINGS,
    POLICY_LOSS_FIELDS,
    SETTINGS_CHECKS,
    Check,
    LossSetting,
    PolicyLossConfig,
    as_policy_loss_config,
)
from echotrain.rl.echo import (  # noqa: F401  re-exported: ECHO's math lives in echotrain.rl.echo
    ECHO_METRICS,
    ECHO_SETTINGS,
    ECHO_STEP_STATS,
    EchoStats,
    batch_kappa,
    batch_ratio,
    echo_loss,
    echo_token_loss,
    kappa_gradient_share,
)
from echotrain.registry import Registry
from echotrain.rl.step import LossStepStats, StepStats, seq_weights
from echotrain.rl.surrogate import clamped_log_ratio, ppo_clip_loss
from echotrain.rl.correction import apply_rollout_correction, parse_rollout_correction
from echotrain.rl.validation import check_choice, check_finite, check_group_index, check_same_shape, check_token_inputs

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
#: ``loss_mode`` name -> policy loss function (verl's signature, above); a live mapping.
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "loss_mode")


def register_policy_loss(
    name: str,
    *,
    step_stats: LossStepStats | None = None,
    settings: Mapping[str, LossSetting] | None = None,
    metrics: Sequence[Metric | str] = (),
    exact: bool | str = True,
    reads: Sequence[str] = (),
    settings_check: Check | None = None,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` in :data:`POLICY_LOSSES`.

    Args:
        name: the ``loss_mode``.
        step_stats: what the loss needs from the whole optimizer step beyond the token /
            sequence counts and BA statistics (:class:`~echotrain.rl.step.LossStepStats`:
            ECHO declares its no-grad pre-pass and the sums giving R); None for none.
            :func:`~echotrain.rl.compute_step_stats` runs it and passes the result as
            ``step.loss_stats``.
        settings: the loss's own settings beyond :class:`PolicyLossConfig`'s fields, name ->
            :func:`~echotrain.rl.config.loss_setting` (default, help, check); set with
            ``loss_options.NAME=VALUE``, read as ``config.NAME`` (see :mod:`echotrain.rl.config`).
        metrics: the metrics the loss returns (declared with :func:`echotrain.metrics.declare_metric`,
            or their names when declared elsewhere), so the trainer reduces each as declared.
            Every loss also returns the clip metrics of :data:`CLIP_METRICS` when it uses
            :func:`clip_metrics`; list them too.
        exact: True when micro-batching the step (with ``step=`` from
            :func:`~echotrain.rl.compute_step_stats`) gives the single-batch loss and gradient,
            as every built-in loss does; else a string saying why not (e.g. a loss whose math
            needs a global selection over the step's tokens). The exactness tests enumerate
            :data:`POLICY_LOSSES` and assert equality for exact losses, the declared
            difference otherwise.
        reads: the :class:`PolicyLossConfig` fields the loss reads beyond the aggregation's (the
            verl adapter takes exactly these from verl's config).
        settings_check: a rule between the loss's settings, ``values -> None or the problem``
            (``values`` has the settings as attributes), checked with every config
            (:data:`~echotrain.rl.config.SETTINGS_CHECKS`, e.g. Clip-Cov's band).

    Raises:
        ValueError: ``name`` is already registered, a setting clashes with a
            :class:`PolicyLossConfig` field or another loss's setting, an undeclared metric name.
        TypeError: ``exact`` is neither True nor a non-empty reason string.
    """
    if not (exact is True or (isinstance(exact, str) and exact)):
        raise TypeError(f"exact must be True or a non-empty str saying why the loss is not exact, got {exact!r}")
    names = tuple(m if isinstance(m, str) else m.name for m in metrics)
    for m in names:
        METRICS.check(m)
    settings = dict(settings or {})
    unknown = [r for r in reads if r not in POLICY_LOSS_FIELDS and r not in settings]
    if unknown:
        raise ValueError(f"policy loss {name!r}: reads={unknown!r} names neither a PolicyLossConfig field nor one of "
                         "the loss's own settings")
    for key, s in settings.items():
        if key in LOSS_SETTINGS:
            raise ValueError(f"policy loss {name!r}: setting {key!r} is already declared by loss_mode="
                             f"{LOSS_SETTINGS.info(key)['loss_mode']!r}")
        if key in POLICY_LOSS_FIELDS:
            raise ValueError(f"policy loss {name!r}: setting {key!r} is already a PolicyLossConfig field")
        if not isinstance(s, LossSetting):
            raise TypeError(f"policy loss {name!r}: setting {key!r} must be a loss_setting(...), got {type(s).__name__}")
    register = POLICY_LOSSES.register(name, step_stats=step_stats, settings=tuple(settings), metrics=names,
                                      reads=tuple(reads),
                                      exact=exact)

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        for key, s in settings.items():
            LOSS_SETTINGS.register(key, loss_mode=name)(s)
        if settings_check is not None:
            SETTINGS_CHECKS[name] = settings_check
        return register(fn)

    return deco


def unregister_policy_loss(name: str) -> PolicyLossFn:
    """Remove the loss ``name`` and the settings it declared (tests, temporary plugins).

    Raises:
        KeyError: ``name`` is not registered.
    """
    for key in POLICY_LOSSES.info(name)["settings"]:
        LOSS_SETTINGS.unregister(key)
    SETTINGS_CHECKS.pop(name, None)
    return POLICY_LOSSES.unregister(name)


def loss_step_stats(loss_mode: str) -> LossStepStats | None:
    """The :class:`~echotrain.rl.step.LossStepStats` that ``loss_mode`` declared (None if none).

    Raises:
        ValueError: unknown ``loss_mode`` (lists the valid ones).
    """
    return POLICY_LOSSES.info(loss_mode)["step_stats"]


#: Loss modes whose step statistics depend on the current policy (need the no-grad pre-pass);
#: a live view of the registrations that declare it.
PREPASS_LOSS_MODES = POLICY_LOSSES.names(lambda info: info["step_stats"] is not None and info["step_stats"].needs_log_prob)


# --------------------------------------------------------------------------- pure pieces

#: the metrics of :func:`clip_metrics` (every built-in loss returns them), token-weighted
CLIP_METRICS = (
    declare_metric("pg_clipfrac", reduce="token_mean", unit="fraction of tokens", label="total",
                   help="share of valid tokens whose clipped branch is active (high + low)"),
    declare_metric("pg_clipfrac_high", reduce="token_mean", unit="fraction of tokens", summary=True,
                   panel="Clip fractions", label="high (rho > 1+eps_high, A>0)",
                   help="share of valid tokens clipped at the ratio ceiling with A > 0"),
    declare_metric("pg_clipfrac_low", reduce="token_mean", unit="fraction of tokens", summary=True,
                   panel="Clip fractions", label="low (rho < 1-eps_low, A<0)",
                   help="share of valid tokens clipped at the ratio floor with A < 0"),
    declare_metric("pg_clipfrac_lower", reduce="token_mean", unit="fraction of tokens",
                   help="share of valid tokens where the dual-clip cap is active (A < 0, clip_ratio_c set)"),
    declare_metric("ppo_kl", reduce="token_mean", unit="nats per token", summary=True, panel="Policy drift",
                   label="ppo_kl = mean log-ratio old/new (not a KL)",
                   help="mean of old_log_prob - log_prob over valid tokens (policy drift; not a KL, can be < 0)"),
)


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


# --------------------------------------------------------------------------- verl's signature


@dataclass(frozen=True)
class PreparedInputs:
    """A policy loss's checked inputs, as :func:`prepared_policy_loss` hands them to its core.

    ``old_log_prob``, ``log_prob``: the ``(B, T)`` inputs as given (``log_prob`` carries grad;
    padding may hold anything); ``advantages``: ``(B, T)`` or ``(B, 1)``, checked; ``mask``:
    bool ``(B, T)``; ``seq_weights``: ``(B,)`` float64 aggregation weights (the step's when
    ``step`` is given), ``(B, T)`` when a rollout correction's weights multiply them (pass it
    to :func:`~echotrain.rl.aggregation.weighted_sum`, which takes both); ``log_ratio``: ``(B, T)`` clamped log rho, 0 at padding; ``cfg``: the
    :class:`PolicyLossConfig`; ``step``: the step's statistics or None; ``agg_weights``:
    ``(B,)`` float64, the aggregation weights alone (= ``seq_weights`` without a correction;
    None only when built by hand); ``rollout_is_weights``: ``(B, T)`` the correction's weights
    that ``seq_weights`` includes, or None (a loss that applies them its own way, e.g.
    ``geo_mean``'s one weight per response, reads these two instead of ``seq_weights``).
    """

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_weights: torch.Tensor
    log_ratio: torch.Tensor
    cfg: PolicyLossConfig
    step: StepStats | None
    agg_weights: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None


LossCore = Callable[[PreparedInputs], tuple[torch.Tensor, dict[str, float]]]


def prepared_policy_loss(default_loss_agg_mode: str) -> Callable[[LossCore], PolicyLossFn]:
    """Decorator: give ``core(x: PreparedInputs) -> (loss 0-d, metrics)`` verl's signature.

    The returned function (named and documented as ``core``) is::

        fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=default_loss_agg_mode,
           config=None, *, group_index=None, step=None) -> (loss, metrics)

    with ``old_log_prob, log_prob`` ``(B, T)`` float log-probs (nats) of the sampled tokens,
    ``advantages`` ``(B, T)`` or ``(B,)``, ``response_mask`` ``(B, T)`` bool or 0/1,
    ``loss_agg_mode`` one of :data:`echotrain.rl.AGG_MODES`, ``config`` a
    :class:`PolicyLossConfig` or dict, ``group_index`` ``(B,)`` int prompt-group ids
    (``balanced`` only), ``step`` the step-global statistics (:mod:`echotrain.rl.stepwise`)
    or None and ``rollout_is_weights`` ``(B, T)`` per-token weights of a rollout correction
    (verl's argument; :mod:`echotrain.rl.correction`) or None. It checks the inputs, builds the
    config, the aggregation weights (times ``rollout_is_weights``: ``x.seq_weights`` is then
    ``(B, T)``, and a core that aggregates with :func:`~echotrain.rl.aggregation.weighted_sum`
    gets the correction with no code of its own) and the clamped log-ratio, calls ``core``
    and multiplies its loss by ``step.dp_size``. Errors: see :func:`compute_policy_loss`.
    """

    def deco(core: LossCore) -> PolicyLossFn:
        def loss_fn(
            old_log_prob: torch.Tensor,
            log_prob: torch.Tensor,
            advantages: torch.Tensor,
            response_mask: torch.Tensor,
            loss_agg_mode: str = default_loss_agg_mode,
            config: PolicyLossConfig | Mapping[str, Any] | None = None,
            *,
            group_index: torch.Tensor | None = None,
            step: StepStats | None = None,
            rollout_is_weights: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, dict[str, float]]:
            cfg = as_policy_loss_config(config)
            adv, mask = check_token_inputs(old_log_prob, log_prob, advantages, response_mask)
            if group_index is not None:
                check_group_index("group_index", group_index, mask.shape[0])
            if rollout_is_weights is not None:
                check_same_shape("response_mask", mask, rollout_is_weights=rollout_is_weights)
                check_finite("rollout_is_weights", rollout_is_weights, mask)
            agg_w = seq_weights(mask, adv, loss_agg_mode, cfg, group_index, step)
            w = agg_w if rollout_is_weights is None else agg_w.unsqueeze(-1) * rollout_is_weights.to(torch.float64)
            log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
            loss, metrics = core(PreparedInputs(old_log_prob, log_prob, adv, mask, w, log_ratio, cfg, step, agg_w,
                                                rollout_is_weights))
            return loss * (1 if step is None else step.dp_size), metrics

        loss_fn.__name__ = loss_fn.__qualname__ = core.__name__
        loss_fn.__doc__, loss_fn.__module__ = core.__doc__, core.__module__
        return loss_fn

    return deco


def ppo_clipped_loss(x: PreparedInputs, ratio: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip of ``ratio`` ``(B, T)`` against the advantages (no dual-clip unless configured),
    aggregated with ``x.seq_weights``: ``(loss 0-d, verl's clip metrics)``."""
    cfg = x.cfg
    loss_mat, flags = ppo_clip_loss(ratio, x.advantages, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c)
    return weighted_sum(loss_mat, x.mask, x.seq_weights), clip_metrics(flags, x.log_ratio, x.mask)


# --------------------------------------------------------------------------- losses


_CLIP = ("clip_ratio_low", "clip_ratio_high")


@register_policy_loss("vanilla", reads=_CLIP + ("clip_ratio_c",), metrics=CLIP_METRICS)
@prepared_policy_loss("token-mean")
def compute_policy_loss_vanilla(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clip with an asymmetric band: GRPO, DAPO clip-higher, optional dual-clip.

    l_{i,t} = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(log_prob -
    old_log_prob) (PPO arXiv 1707.06347 Eq. 7; DAPO arXiv 2503.14476 Eq. 10; dual-clip
    arXiv 1912.09729), then aggregated with ``loss_agg_mode`` (default ``token-mean``).
    verl's signature and arguments: :func:`prepared_policy_loss`; returns ``(loss 0-d,
    metrics)``; errors: :func:`compute_policy_loss`.
    """
    return ppo_clipped_loss(x, torch.exp(x.log_ratio))


@register_policy_loss("gspo", reads=_CLIP, metrics=CLIP_METRICS)
@prepared_policy_loss("seq-mean-token-mean")
def compute_policy_loss_gspo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one clipped sequence ratio per response (arXiv 2507.18071, Eq. 5-7).

    s_i = exp((1/|o_i|) sum_t log rho_{i,t}) over valid tokens; l_{i,t} = -min(s_i A_{i,t},
    clip(s_i, 1 - eps_low, 1 + eps_high) A_{i,t}) on every valid token, aggregated with
    ``loss_agg_mode`` (the paper's J is ``seq-mean-token-mean``, this function's default).
    The gradient flows through s_i: d s_i = s_i (1/|o_i|) sum_t d log pi. Typical
    eps: 3e-4 / 4e-4. Arguments, returns and errors as :func:`compute_policy_loss_vanilla`.
    """
    c = x.cfg.log_ratio_clamp
    seq_log_ratio = sequence_log_ratio(x.log_ratio, x.mask).clamp(-c, c)
    return ppo_clipped_loss(x, torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(x.log_ratio))


@register_policy_loss("gspo_token", reads=_CLIP, metrics=CLIP_METRICS)
@prepared_policy_loss("seq-mean-token-mean")
def compute_policy_loss_gspo_token(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: s_{i,t} = sg[s_i] * pi(o_{i,t}) / sg[pi(o_{i,t})] (arXiv 2507.18071, Eq. 13-14).

    Same value as s_i; the gradient of token t is s_i A_{i,t} d log pi(o_{i,t}) (times the
    aggregation weight), so per-token advantages are possible. verl's ``gspo`` is this form.
    Default ``loss_agg_mode`` ``seq-mean-token-mean``. Arguments, returns and errors as
    :func:`compute_policy_loss_vanilla`.
    """
    seq_log_ratio = sequence_log_ratio(x.log_ratio, x.mask).detach().unsqueeze(-1)
    c, lp = x.cfg.log_ratio_clamp, x.log_prob
    # where, not a product: log_prob may be -inf/NaN at padding (-inf - -inf = NaN)
    return ppo_clipped_loss(x, torch.exp(torch.clamp(seq_log_ratio + torch.where(x.mask, lp - lp.detach(), 0), -c, c)))


@register_policy_loss("echo", step_stats=ECHO_STEP_STATS, metrics=CLIP_METRICS + ECHO_METRICS, settings=ECHO_SETTINGS,
                      reads=_CLIP + (
    "clip_ratio_c", "batch_clip_low", "batch_clip_high", "batch_ratio", "detach_kappa", "echo_pessimistic",
    "echo_token_clip", "echo_token_cap"))
@prepared_policy_loss("token-mean")
def compute_policy_loss_echo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """ECHO: clip the batch ratio R, rescale every token ratio by kappa, token-clip on top.

    Our formulation (docs/design/objectives.md §4; the paper's equations are not public; the
    math is :mod:`echotrain.rl.echo`): R = exp(mean log rho) (``geo``) or mean rho (``arith``)
    over the step's N valid tokens; kappa = clip(R, 1 - eps_b_low, 1 + eps_b_high) / R;
    rho~ = kappa rho; l_{i,t} = -min(rho~ A, clip(rho~, 1 - eps_low, 1 + eps_high) A),
    aggregated (defaults; ``loss_agg_mode`` ``token-mean``). The open choices are flags
    (:func:`~echotrain.rl.echo.echo_token_loss`): ``echo_token_clip`` ("ppo" above, "none":
    l = -rho~ A, "truncate": truncated weight min(rho~, c)) and ``echo_pessimistic``
    (l = max(l(rho), l(rho~)) per token when the batch clip fires). The closed forms below are
    for the defaults; with pessimism only the tokens whose l(rho~) is chosen carry the kappa term.
    When R clips, the gradient gains a baseline built from L = (1/N) sum rho A and R (token-mean,
    token clip inactive; both tested against autograd):

    - ``arith``: grad J = (kappa / N) sum rho (A - b) grad log pi, with b = L / R (design page);
    - ``geo``:   grad J = (kappa / N) sum (rho A - L) grad log pi (d log R / d log rho = 1/N),
      i.e. the same form with a per-token b_t = L / rho_t.

    Inside the band kappa = 1 with no gradient: value and gradient equal ``vanilla``.

    With ``step`` (micro-batches / ranks), R, kappa and S = sum_{i,t} w_{i,t} rho_{i,t}
    dl/drho~ come from the step's no-grad pre-pass (declared at registration:
    :data:`~echotrain.rl.echo.ECHO_STEP_STATS`), and the surrogate S * kappa_mb(theta) adds
    this micro-batch's share of the kappa gradient, so that the accumulated gradient equals the
    single-tensor autograd gradient. Arguments, returns and errors as
    :func:`compute_policy_loss_vanilla`.
    """
    log_ratio_sum = x.log_ratio.sum(dtype=torch.float64)  # shared by R_geo, its gradient share and ppo_kl
    loss, flags, echo_metrics = echo_loss(x.log_ratio, log_ratio_sum, x.advantages, x.mask, x.seq_weights, x.cfg, x.step)
    metrics = clip_metrics(flags, x.log_ratio, x.mask, log_ratio_sum)
    metrics.update(echo_metrics)
    return loss, metrics


def _accepts_rollout_is_weights(fn: PolicyLossFn) -> bool:
    """Whether a registered loss takes the ``rollout_is_weights`` keyword (verl's signature)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: let the call decide
        return True
    return "rollout_is_weights" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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
    step: StepStats | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to the policy loss registered as ``loss_mode`` in :data:`POLICY_LOSSES`, after
    the rollout correction of ``config.rollout_correction`` (any loss, no per-loss code).

    Args:
        loss_mode: any name in :data:`POLICY_LOSSES` ("vanilla", "gspo", "gspo_token", "echo",
            and those of :mod:`echotrain.rl.losses`).
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
        rollout_log_prob: ``(B, T)`` the sampler's log-probs (behaviour policy mu), needed
            when ``config.rollout_correction`` is set: the correction
            (:func:`~echotrain.rl.correction.apply_rollout_correction`, with the step's
            ``step.correction`` statistics) modifies ``response_mask`` and passes its weights
            to the loss; its step metrics (``rollout_corr/*``) join the loss's.
        rollout_is_weights: ``(B, T)`` correction weights already applied by the caller
            (then ``response_mask`` must be the corrected mask and ``rollout_log_prob`` is
            unused), as verl's actor passes them.

    Returns:
        ``(loss, metrics)``: 0-d tensor (minimise it) and ``dict[str, float]``.

    Raises:
        ValueError: unknown ``loss_mode`` / ``loss_agg_mode`` (lists the valid ones), shape
            mismatch, NaN/Inf at valid tokens, non-0/1 mask, bad config, missing inputs of
            the aggregation (``norm_constant``, ``group_index``), ``step`` computed for another
            mode or another config; ``rollout_correction`` set without ``rollout_log_prob``
            (or a ``step`` computed without it).
        TypeError: non-tensor inputs, non-integer ``group_index``.
    """
    check_choice("loss_mode", loss_mode, POLICY_LOSSES)
    if step is not None and step.loss_mode != loss_mode:
        raise ValueError(f"step was computed for loss_mode={step.loss_mode!r}, not {loss_mode!r}")
    cfg = as_policy_loss_config(config)
    extra: dict[str, Any] = {}
    corr_metrics: dict[str, float] = {}
    if rollout_is_weights is not None:
        extra["rollout_is_weights"] = rollout_is_weights
    elif parse_rollout_correction(cfg.rollout_correction):
        if step is not None and step.correction is None:
            raise ValueError(f"rollout_correction={cfg.rollout_correction!r}: step has no correction statistics "
                             "(compute_step_stats needs each micro-batch's rollout_log_prob)")
        corrected = apply_rollout_correction(old_log_prob, rollout_log_prob, advantages, response_mask, cfg,
                                             stats=None if step is None else step.correction)
        response_mask, extra["rollout_is_weights"], corr_metrics = corrected
    fn = POLICY_LOSSES[loss_mode]
    if extra and not _accepts_rollout_is_weights(fn):
        raise ValueError(f"loss_mode={loss_mode!r} does not take rollout_is_weights, so rollout_correction cannot "
                         "apply to it: register it with prepared_policy_loss or add verl's rollout_is_weights keyword")
    loss, metrics = fn(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, cfg, group_index=group_index, step=step,
        **extra)
    if corr_metrics:
        metrics = {**metrics, **corr_metrics}
    return loss, metrics
