"""echotrain.rl: the pure tensor math of RL-from-verifiable-rewards objectives.

Everything here takes tensors and returns tensors (no models, no I/O, no logging). The
specification is ``docs/design/objectives.md``; names follow verl's ``core_algos`` so that the
policy losses drop into its registry unchanged.

Each kind of piece is a registry with one decorator (:mod:`echotrain.registry`): policy
losses (``register_policy_loss``; a loss built on ``prepared_policy_loss`` gets checked inputs,
the step's aggregation weights and ``dp_size`` handled; ``loss_setting`` declares its own
settings), advantage estimators (``register_adv_estimator``),
aggregation modes (``register_agg_mode``) and KL estimators (``register_kl_estimator``). The
name tuples ``POLICY_LOSSES``, ``ADV_METHODS``, ``AGG_MODES``, ``KL_ESTIMATORS`` and
``PREPASS_LOSS_MODES`` are live views of them.

- :mod:`~echotrain.rl.advantages`  group advantages (GRPO, Dr. GRPO, batch-std), zero-variance flags
- :mod:`~echotrain.rl.objectives`  PPO/GRPO/DAPO clip, GSPO, GSPO-token, ECHO; ``POLICY_LOSSES``
- :mod:`~echotrain.rl.losses`      CISPO, SAPO, GMPO, DPPO, GPG, Clip-/KL-Cov, DRO, LUSPO, VESPO
- :mod:`~echotrain.rl.echo`        ECHO's math: batch ratio R, kappa, token loss, step statistics
- :mod:`~echotrain.rl.correction`  behaviour-policy corrections (``rollout_correction``: TIS, IcePop/MIS,
  k1/k2/k3 rejection, off-policy sequence mask, decoupled PPO); ``ROLLOUT_CORRECTIONS``
- :mod:`~echotrain.rl.surrogate`   clamped log-ratio, PPO clip (shared by the losses)
- :mod:`~echotrain.rl.aggregation` ``loss_agg_mode`` weights incl. Balanced Aggregation
- :mod:`~echotrain.rl.step`        ``StepStats`` and ``LossStepStats`` (what a loss declares)
- :mod:`~echotrain.rl.stepwise`    exact micro-batch / multi-rank statistics for one optimizer step
- :mod:`~echotrain.rl.kl`, :mod:`~echotrain.rl.shaping`, :mod:`~echotrain.rl.presets`
"""

from echotrain.rl.advantages import (ADV_METHODS, compute_advantages, compute_token_advantages, register_adv_estimator,
                                     zero_variance_groups)
from echotrain.rl.aggregation import (
    AGG_MODES,
    BalancedStats,
    agg_loss,
    agg_weights,
    balanced_stats,
    register_agg_mode,
    weighted_sum,
)
from echotrain.rl.config import (
    ECHO_DEFAULT_BATCH_BAND,
    LOSS_SETTINGS,
    LossSetting,
    PolicyLossConfig,
    as_policy_loss_config,
    loss_setting,
)
from echotrain.rl.config import ECHO_DEFAULT_BATCH_BAND, PolicyLossConfig, as_policy_loss_config
from echotrain.rl.correction import ROLLOUT_CORRECTIONS, apply_rollout_correction, register_rollout_correction
from echotrain.rl.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from echotrain.rl.objectives import (
    CLIP_METRICS,
    PreparedInputs,
    clip_metrics,
    prepared_policy_loss,
    unregister_policy_loss,
    POLICY_LOSSES,
    PREPASS_LOSS_MODES,
    compute_policy_loss,
    register_policy_loss,
)
from echotrain.rl import losses as _losses  # noqa: F401,E402  (registers the losses of echotrain.rl.losses)
from echotrain.rl.step import LossStepStats
from echotrain.rl.presets import PRESETS, Preset, get_preset
from echotrain.rl.surrogate import ppo_clip_loss
from echotrain.rl.shaping import overlong_reward_penalty, truncated_response_mask
from echotrain.rl.stepwise import (
    StepStats,
    compute_step_stats,
    needs_log_prob_prepass,
    shard_batch,
    split_micro_batches,
    step_agg_loss,
)

__all__ = [
    "CLIP_METRICS",
    "LOSS_SETTINGS",
    "LossSetting",
    "PreparedInputs",
    "clip_metrics",
    "loss_setting",
    "ppo_clip_loss",
    "prepared_policy_loss",
    "unregister_policy_loss",
    "weighted_sum",
    "ADV_METHODS",
    "AGG_MODES",
    "BalancedStats",
    "ECHO_DEFAULT_BATCH_BAND",
    "KL_ESTIMATORS",
    "LossStepStats",
    "POLICY_LOSSES",
    "PREPASS_LOSS_MODES",
    "PRESETS",
    "PolicyLossConfig",
    "ROLLOUT_CORRECTIONS",
    "Preset",
    "StepStats",
    "agg_loss",
    "agg_weights",
    "apply_rollout_correction",
    "as_policy_loss_config",
    "balanced_stats",
    "compute_advantages",
    "compute_policy_loss",
    "compute_step_stats",
    "get_preset",
    "kl_penalty",
    "needs_log_prob_prepass",
    "overlong_reward_penalty",
    "register_adv_estimator",
    "compute_token_advantages",
    "register_agg_mode",
    "register_kl_estimator",
    "register_policy_loss",
    "register_rollout_correction",
    "shard_batch",
    "split_micro_batches",
    "step_agg_loss",
    "truncated_response_mask",
    "zero_variance_groups",
]
