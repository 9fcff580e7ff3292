"""echotrain's policy losses and Balanced Aggregation inside verl (0.9.x), through its registries.

verl composes a PPO step from two registries in ``verl.trainer.ppo.core_algos``: policy losses
(``register_policy_loss``, chosen by ``actor_rollout_ref.actor.policy_loss.loss_mode``) and
advantage estimators (``register_adv_est``, chosen by ``algorithm.adv_estimator``).
:func:`register_with_verl` adds echotrain's math to both::

    from echotrain.integrations.verl import register_with_verl
    register_with_verl()      # in every process that builds losses, or use verl_plugin (below)

    # then, in the verl config:
    actor_rollout_ref.actor.policy_loss.loss_mode=echotrain_echo      # or echotrain_vanilla, ...
    actor_rollout_ref.actor.loss_agg_mode=token-mean                   # any verl mode we share
    # Balanced Aggregation (verl's loss cannot see prompt groups, so it goes in the advantages):
    algorithm.adv_estimator=echotrain_grpo_balanced
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum

verl runs the actor in Ray worker processes: the registration must run in each of them. verl
imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` (and ``verl.plugins`` entry points) in
every process that imports ``verl``, so the simplest route is
``VERL_USE_EXTERNAL_MODULES=echotrain.integrations.verl_plugin`` in the run's environment
(:mod:`echotrain.integrations.verl_plugin` calls :func:`register_with_verl` on import).

Registered policy losses (verl's signature ``fn(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``), each a call of
:func:`echotrain.rl.compute_policy_loss`:

====================== ============= ==============================================================
verl name              echotrain     compared with verl
====================== ============= ==============================================================
``echotrain_vanilla``  ``vanilla``   equals verl's ``vanilla`` (token PPO clip, DAPO clip-higher,
                                     dual-clip ``clip_ratio_c``) up to the documented differences
``echotrain_gspo``     ``gspo``      GSPO with the gradient through s_i (arXiv 2507.18071 Eq. 5-7);
                                     verl has no such loss (same value as verl's ``gspo``)
``echotrain_gspo_token`` ``gspo_token`` equals verl's ``gspo`` (the GSPO-token form) up to the
                                     documented log-ratio clamp difference
``echotrain_echo``     ``echo``      R is the micro-batch's (see below)
``echotrain_<name>``   ``<name>``    every other registered loss (:data:`POLICY_LOSS_NAMES` is read
                                     from :data:`echotrain.rl.POLICY_LOSSES`): ``cispo``, ``sapo``,
                                     ``geo_mean``, ``dppo_tv``/``dppo_kl``, ``gpg``, ``clip_cov``,
                                     ``kl_cov``, ``dro`` equal verl's loss of the same name up to
                                     the differences of docs/design/objectives.md §9; ``luspo``,
                                     ``vespo`` are TRL's (verl has none); ``clip_cov``/``kl_cov``
                                     take their means and top-k over the call (as verl's own do)
====================== ============= ==============================================================

Documented differences from verl (docs/design/objectives.md §8, each an explicit expectation in
tests/integrations/test_verl_adapter.py and tests/rl/test_rl_verl_parity.py; the upstream run
of ``scripts/verl_upstream_tests.py`` is recorded in docs/design/objectives.md): our token
log-ratios are clamped at +-``log_ratio_clamp`` (20) with zero gradient beyond, where verl's
``vanilla`` clamps at +-20 the same way but verl's ``gspo`` clamps only the sequence mean from
above at 10; ``seq-mean-token-sum-norm`` without ``loss_scale_factor`` raises (verl divides by
the padded width); ECHO's R is per micro-batch. verl's rollout correction
(``algorithm.rollout_correction``: its ``rollout_is_weights`` and rejection mask) is verl's own
stage and applies to every echotrain loss (the weights multiply each token's loss, as in verl's
losses); echotrain's ``rollout_correction`` setting is refused here (verl's loss signature has
no ``rollout_log_prob``: configure the correction in verl).

Config mapping: the token clip comes from verl's actor config (``clip_ratio_low`` /
``clip_ratio_high``, falling back to ``clip_ratio``, then to the ``config`` given to
:func:`register_with_verl`); ``clip_ratio_c`` (dual-clip; verl's actor config sets 3.0) is
applied where verl's own counterpart applies it -- ``echotrain_vanilla`` and
``echotrain_echo`` (a token-PPO loss) as the dual-clip, ``echotrain_dppo_tv`` / ``_kl`` as their
IS cap -- and never to ``echotrain_gspo`` / ``echotrain_gspo_token``, because verl's ``gspo`` has
no dual-clip (:data:`DUAL_CLIP_LOSSES`: the losses that declare ``clip_ratio_c``);
ECHO's batch band and the other echotrain-only knobs
(every setting verl does not have: ECHO's own, declared with its registration, ``batch_clip_low/high``,
``batch_ratio``, ``detach_kappa``, ``echo_pessimistic``, ``echo_token_clip``, ``echo_token_cap``;
the :class:`echotrain.rl.PolicyLossConfig` field ``log_ratio_clamp``, and the Balanced-Aggregation
flags ``ba_scope`` / ``ba_count_zero_adv`` of ``echotrain_grpo_balanced``) come from the ``config``
given to :func:`register_with_verl` (a dict may name them flat; the declared defaults otherwise;
ECHO band :data:`echotrain.rl.ECHO_DEFAULT_BATCH_BAND`).
``seq-mean-token-sum-norm`` uses verl's ``loss_scale_factor`` (else the config's
``norm_constant``) and raises if both are unset (verl would silently use the padded width).

Normalisers: verl calls the loss once per micro-batch and passes the step-global counts in
``config.global_batch_info`` (``batch_num_tokens``, ``global_batch_size``, ``dp_size``). The
adapter computes the micro-batch's loss with its local normaliser and rescales it by
``local count / global count * dp_size``, which is exactly the micro-batch's share of the
step loss (all our aggregations except ``balanced`` have one scalar normaliser), so gradient
accumulation and data parallelism give verl's global-batch gradient. Without
``global_batch_info`` the call is taken to be the whole step.

ECHO is approximate here: its batch ratio R must be a statistic of the whole optimizer step
(docs/design/objectives.md §4), but a verl loss only sees one micro-batch on one rank, so R (and
kappa, and the baseline in the gradient) is the micro-batch's. It is exact when verl passes the
whole mini-batch in one call: one data-parallel rank and ``ppo_micro_batch_size_per_gpu`` equal
to the mini-batch (no dynamic batch size). The metric ``actor/echo/R_token_share`` (this call's
share of the step's tokens; 1.0 = exact) shows which case a run is in. echotrain's own trainer
computes R exactly with a no-grad pre-pass (:mod:`echotrain.rl.stepwise`).

Balanced Aggregation (Zeng et al., arXiv 2605.04077) needs the prompt groups, which verl's loss
never sees; its advantage estimator does (``index`` = the prompt uids). Because every policy
loss here is positively homogeneous in A, scaling each response's advantage by
``s_i = N * w_i`` (w_i its BA weight, N the number of responses) and aggregating with
``seq-mean-token-sum`` (weight 1/N per sequence) gives BA exactly (design §5). Exact when every
mini-batch holds whole groups of the same size (verl's ``rollout.n``), e.g. one mini-batch per
step; metrics such as ``pg_clipfrac`` are unaffected, but verl's entropy and KL terms are then
aggregated with ``seq-mean-token-sum``, not BA. ``dro`` (its penalty is not scaled by A),
``clip_cov`` and ``kl_cov`` (their covariance is not homogeneous in A) are not positively
homogeneous in A, so this route is not BA for them.

Settings of the other losses: each loss declares at registration the settings it reads
(``reads``: :class:`echotrain.rl.PolicyLossConfig` fields and the loss's own settings, declared
with it and kept under their flat names, verl's); those verl has are read
from verl's config at call time (``actor.tau_pos`` / ``tau_neg``, ``actor.policy_loss.clip_cov_ratio``
/ ``clip_cov_lb`` / ``clip_cov_ub`` / ``kl_cov_ratio`` / ``ppo_kl_coef`` / ``dro_beta``), the others
(``cispo_lower_clip``, ``vespo_*``) from the ``config`` given to :func:`register_with_verl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping

import torch

from echotrain.rl.config import POLICY_LOSS_FIELDS
from echotrain.rl.correction_names import parse_rollout_correction
from echotrain.rl import (
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_weights,
    as_policy_loss_config,
    compute_advantages,
    compute_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "DUAL_CLIP_LOSSES",
    "POLICY_LOSS_NAMES",
    "balanced_advantage_scale",
    "make_verl_adv_estimator",
    "make_verl_policy_loss",
    "register_with_verl",
    "verl_core_algos",
]

class _VerlLossNames(Mapping[str, str]):
    """verl policy-loss name ``echotrain_<loss_mode>`` -> echotrain ``loss_mode``, for every name in
    :data:`echotrain.rl.POLICY_LOSSES` (live: a loss registered later is listed too)."""

    def __getitem__(self, key: str) -> str:
        if isinstance(key, str) and key.startswith("echotrain_") and key[len("echotrain_"):] in POLICY_LOSSES:
            return key[len("echotrain_"):]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter([f"echotrain_{name}" for name in POLICY_LOSSES])

    def __len__(self) -> int:
        return len(POLICY_LOSSES)

    def __repr__(self) -> str:
        return repr(dict(self))


#: verl policy-loss name -> echotrain loss_mode: ``echotrain_<name>`` for every registered loss.
POLICY_LOSS_NAMES: Mapping[str, str] = _VerlLossNames()
#: echotrain loss_modes that read ``clip_ratio_c`` (declared in their registration's ``reads``):
#: the dual-clip of ``vanilla`` / ``echo`` and DPPO's IS cap, as verl's own losses read it; verl's
#: ``gspo`` has none, so the GSPO forms never get it through verl. A live view.
DUAL_CLIP_LOSSES = POLICY_LOSSES.names(lambda info: "clip_ratio_c" in info.get("reads", ()))
#: verl advantage-estimator name -> what it computes.
ADV_ESTIMATORS: dict[str, str] = {
    "echotrain_grpo_balanced": "GRPO advantages (std-normalised unless algorithm.norm_adv_by_std_in_grpo=False) "
    "scaled for Balanced Aggregation; use with loss_agg_mode=seq-mean-token-sum",
}

# verl aggregation modes that echotrain implements identically (all of verl 0.9.1's)
_SHARED_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: PolicyLossConfig fields verl keeps under ``actor.policy_loss`` (the others it has sit on ``actor``).
_VERL_POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
_CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
def _get(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` for verl's ActorConfig / AlgoConfig (dataclasses with ``.get``), omegaconf
    DictConfig or a plain dict; ``default`` when absent or None."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(key, default)
    elif hasattr(config, "get"):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def _loss_config(verl_config: Any, base: PolicyLossConfig, loss_mode: str) -> PolicyLossConfig:
    """echotrain's PolicyLossConfig for one call: token clip (and dual-clip) from verl's actor
    config where it sets them, else from ``base``; dual-clip only for :data:`DUAL_CLIP_LOSSES`,
    as verl applies it; and every other setting the loss declared at registration (``reads``)
    that verl's config has (``actor.tau_pos``, ``actor.policy_loss.clip_cov_ratio``, ...)."""
    clip_c = _get(verl_config, "clip_ratio_c", base.clip_ratio_c)
    low = _get(verl_config, "clip_ratio_low", _get(verl_config, "clip_ratio", base.clip_ratio_low))
    high = _get(verl_config, "clip_ratio_high", _get(verl_config, "clip_ratio", base.clip_ratio_high))
    extra, options = {}, dict(base.loss_options)
    for name in POLICY_LOSSES.info(loss_mode).get("reads", ()):
        if name in _CLIP_KEYS:
            continue
        source = _get(verl_config, "policy_loss") if name in _VERL_POLICY_LOSS_KEYS else verl_config
        value = _get(source, name)
        if value is not None:
            # a PolicyLossConfig field, or a setting the loss declared itself (kept in loss_options)
            (extra if name in POLICY_LOSS_FIELDS else options)[name] = value
    return dataclasses.replace(
        base,
        loss_options=options,
        clip_ratio_low=float(low),
        clip_ratio_high=float(high),
        clip_ratio_c=None if clip_c is None or loss_mode not in DUAL_CLIP_LOSSES else float(clip_c),
        **extra,
    )


def make_verl_policy_loss(loss_mode: str, config: PolicyLossConfig | Mapping[str, Any] | None = None) -> Callable:
    """A function with verl's policy-loss signature that computes echotrain's ``loss_mode``.

    Args:
        loss_mode: a name in :data:`echotrain.rl.POLICY_LOSSES`.
        config: echotrain-only knobs (ECHO band etc.); the token clip comes from verl's config
            at call time. Default: :class:`PolicyLossConfig` defaults.

    Raises:
        ValueError: unknown ``loss_mode`` (lists the valid ones) or invalid ``config``.

    Returns:
        ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        config=None, rollout_is_weights=None) -> (loss 0-d, metrics dict[str, float])`` where the
        tensors are verl's ``(bs, response_length)``, ``config`` verl's ActorConfig (None: the
        echotrain ``config`` is used as is, token clip included) and the metrics are
        echotrain's, prefixed ``actor/``.

    ``rollout_is_weights`` (verl's rollout correction) multiply each token's loss. The
    returned function raises ``ValueError`` for
    ``loss_agg_mode="balanced"`` (use :data:`ADV_ESTIMATORS`), for verl modes echotrain does not
    share (``token-sum``), for ``seq-mean-token-sum-norm`` without ``loss_scale_factor``, and
    for ``dp_size > 1`` without the global count; plus every error of
    :func:`echotrain.rl.compute_policy_loss`.
    """
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(f"unknown loss_mode {loss_mode!r}; valid: {sorted(POLICY_LOSSES)}")
    base = as_policy_loss_config(config)
    if parse_rollout_correction(base.rollout_correction):
        raise ValueError(f"rollout_correction={base.rollout_correction!r}: in verl the correction is verl's own stage "
                         "(algorithm.rollout_correction: rollout_is, rollout_rs, ...); its weights reach the echotrain "
                         "loss as rollout_is_weights. Leave echotrain's rollout_correction none")

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if loss_agg_mode == "balanced":
            raise ValueError(
                "loss_agg_mode='balanced' cannot be computed inside a verl loss (no prompt groups); use "
                "algorithm.adv_estimator=echotrain_grpo_balanced with loss_agg_mode=seq-mean-token-sum"
            )
        if loss_agg_mode not in _SHARED_AGG_MODES:
            raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not supported by echotrain losses; valid: "
                             f"{list(_SHARED_AGG_MODES)} (and BA via echotrain_grpo_balanced advantages)")
        cfg = _loss_config(config, base, loss_mode) if config is not None else base
        info = dict(_get(config, "global_batch_info", {}) or {})
        dp_size = int(info.get("dp_size") or 1)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            factor = info.get("loss_scale_factor") or _get(config, "loss_scale_factor") or base.norm_constant
            if factor is None:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs actor.loss_scale_factor (e.g. the maximum "
                    "response length); echotrain never normalises by the padded width"
                )
            cfg = dataclasses.replace(cfg, norm_constant=float(factor))
        mask = response_mask.bool()
        # verl's own rollout correction (algorithm.rollout_correction) computed the weights and the
        # rejection mask; every echotrain loss applies them like verl's losses do
        loss, metrics = compute_policy_loss(loss_mode, old_log_prob, log_prob, advantages, mask, loss_agg_mode, cfg,
                                            rollout_is_weights=rollout_is_weights)
        # rescale the local normaliser to the step's: loss_mb * local / global * dp_size
        if loss_agg_mode == "token-sum":  # no normaliser: each rank's sum, times dp_size (as verl)
            return loss * dp_size, {f"actor/{k}": float(v) for k, v in metrics.items()}
        if loss_agg_mode == "token-mean":
            local, total = float(mask.sum()), info.get("batch_num_tokens")
            name = "batch_num_tokens"
        else:
            local, total = float(mask.any(-1).sum()), info.get("global_batch_size")
            name = "global_batch_size"
        if total is None:
            if dp_size > 1:
                raise ValueError(f"global_batch_info[{name!r}] is required when dp_size > 1")
            total = local
        total = float(total)
        scale = local / total * dp_size if total > 0 else 0.0
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        if loss_mode == "echo":
            n_tok, n_all = float(mask.sum()), info.get("batch_num_tokens")
            out["actor/echo/R_token_share"] = n_tok / float(n_all) if n_all else 1.0
        return loss * scale, out

    policy_loss.__name__ = f"echotrain_{loss_mode}"
    policy_loss.__doc__ = f"echotrain's {loss_mode!r} policy loss with verl's signature (see make_verl_policy_loss)."
    return policy_loss


def balanced_advantage_scale(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    config: PolicyLossConfig | Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Per-response factor ``s_i = N * w_i`` that turns ``seq-mean-token-sum`` into BA.

    ``w_i`` is the Balanced-Aggregation weight of response i (per token; design §5:
    k/(G T+) or m/(G T-) per group, over the number of groups), N the number of responses.
    Scaling the advantages by ``s_i`` and aggregating with ``seq-mean-token-sum`` (weight 1/N)
    gives the BA loss exactly, because the policy losses are positively homogeneous in A.

    Args:
        advantages: ``(N, T)`` or ``(N,)`` float (only the sign per response is used).
        response_mask: ``(N, T)`` bool / 0-1.
        group_index: ``(N,)`` int prompt-group ids.
        config: :class:`echotrain.rl.PolicyLossConfig` or dict; its BA flags ``ba_scope`` and
            ``ba_count_zero_adv`` are used (None: defaults).

    Returns:
        ``(N,)`` float32, 0 for zero-advantage or empty responses.
    """
    cfg = as_policy_loss_config(config)
    w = agg_weights(response_mask, "balanced", advantages=advantages, group_index=group_index,
                    ba_scope=cfg.ba_scope, ba_count_zero_adv=cfg.ba_count_zero_adv)
    return (w * response_mask.shape[0]).to(torch.float32)


def make_verl_adv_estimator(config: PolicyLossConfig | Mapping[str, Any] | None = None, *,
                            eps: float = 1e-6) -> Callable:
    """A verl advantage estimator: echotrain GRPO advantages scaled for Balanced Aggregation
    with the BA flags (``ba_scope``, ``ba_count_zero_adv``) of ``config`` (None: defaults).

    Signature (verl's): ``fn(token_level_rewards (bs, T), response_mask (bs, T), index
    (bs,) array of prompt uids, config=AlgoConfig | None, **kwargs) -> (advantages, returns)``,
    both ``(bs, T)`` float32. ``config.norm_adv_by_std_in_grpo=False`` selects Dr. GRPO's
    ``grpo_no_std``. Use with ``loss_agg_mode=seq-mean-token-sum`` (see the module docstring).

    Raises:
        ValueError: invalid ``config``.
    """
    base = as_policy_loss_config(config)

    def echotrain_grpo_balanced(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        if index is None:
            raise ValueError("echotrain_grpo_balanced needs the prompt uids (verl's non_tensor_batch['uid'])")
        import numpy as np

        _, group = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
        group_index = torch.as_tensor(group.reshape(-1), dtype=torch.long, device=token_level_rewards.device)
        rewards = token_level_rewards.sum(-1).float()
        adv_estimator = "grpo" if _get(config, "norm_adv_by_std_in_grpo", True) else "grpo_no_std"
        adv = compute_advantages(rewards, group_index, adv_estimator=adv_estimator, eps=eps)
        mask = response_mask.bool()
        scale = balanced_advantage_scale(adv, mask, group_index, base)
        scores = (adv * scale).unsqueeze(-1) * mask
        return scores, scores

    return echotrain_grpo_balanced


def verl_core_algos() -> Any:
    """verl's ``verl.trainer.ppo.core_algos`` module (the policy-loss and advantage registries).

    Raises:
        ImportError: verl cannot be imported (missing, or a dependency clash at import time); the
            message names the cause and says how to install it.
    """
    try:
        from verl.trainer.ppo import core_algos
    except Exception as exc:  # ImportError or a dependency clash raised at import time
        raise ImportError(
            f"verl's core_algos cannot be imported ({type(exc).__name__}: {exc}); install verl==0.9.1 "
            "(pip install --no-deps verl==0.9.1 plus the packages of requirements-extras.txt)"
        ) from exc
    return core_algos


def register_with_verl(config: PolicyLossConfig | Mapping[str, Any] | None = None) -> list[str]:
    """Register echotrain's policy losses and BA advantage estimator in verl's registries.

    Idempotent (re-registering replaces echotrain's own entries; other entries are untouched).

    Args:
        config: echotrain-only loss knobs (:class:`PolicyLossConfig` or dict), e.g.
            ``{"batch_clip_low": 0.02, "batch_clip_high": 0.02, "batch_ratio": "geo"}`` for
            ECHO, and the Balanced-Aggregation flags ``ba_scope`` / ``ba_count_zero_adv`` of
            ``echotrain_grpo_balanced``; default :class:`PolicyLossConfig` (ECHO band
            ``ECHO_DEFAULT_BATCH_BAND``).

    Returns:
        the registered names (policy losses, then the advantage estimator).

    Raises:
        ImportError: verl (``verl.trainer.ppo.core_algos``) cannot be imported; the message
            says how to install it.
        ValueError: invalid ``config``.
    """
    core_algos = verl_core_algos()
    base = as_policy_loss_config(config)
    names = []
    for verl_name, loss_mode in POLICY_LOSS_NAMES.items():
        # register_policy_loss overwrites silently; write the registry directly for clarity
        core_algos.POLICY_LOSS_REGISTRY[verl_name] = make_verl_policy_loss(loss_mode, base)
        names.append(verl_name)
    for adv_name in ADV_ESTIMATORS:
        # register_adv_est refuses a different function under an existing name: replace ours
        core_algos.ADV_ESTIMATOR_REGISTRY[adv_name] = make_verl_adv_estimator(base)
        names.append(adv_name)
    return names

