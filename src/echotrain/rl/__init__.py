"""echotrain.rl: the pure tensor math of RL-from-verifiable-rewards objectives.

Everything here takes tensors and returns tensors (no models, no I/O, no logging). The
specification is ``docs/design/objectives.md``; names follow verl's ``core_algos`` so that the policy
losses drop into its registry unchanged.

- :mod:`~echotrain.rl.advantages`  group advantages (GRPO, Dr. GRPO, batch-std), zero-variance flags
- :mod:`~echotrain.rl.objectives`  PPO/GRPO/DAPO clip, GSPO, GSPO-token, ECHO; ``POLICY_LOSSES``
- :mod:`~echotrain.rl.aggregation` ``loss_agg_mode`` weights incl. Balanced Aggregation
- :mod:`~echotrain.rl.stepwise`    exact micro-batch / multi-rank statistics for one optimizer step
- :mod:`~echotrain.rl.kl`, :mod:`~echotrain.rl.shaping`, :mod:`~echotrain.rl.presets`
"""

from echotrain.rl.advantages import ADV_METHODS, compute_advantages, zero_variance_groups
from echotrain.rl.aggregation import AGG_MODES, BalancedStats, agg_loss, agg_weights, balanced_stats
from echotrain.rl.config import ECHO_DEFAULT_BATCH_BAND, PolicyLossConfig, as_policy_loss_config
from echotrain.rl.kl import KL_ESTIMATORS, kl_penalty
from echotrain.rl.objectives import (
    POLICY_LOSSES,
    compute_policy_loss,
    register_policy_loss,
)
from echotrain.rl.presets import PRESETS, Preset, get_preset
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
    "ADV_METHODS",
    "AGG_MODES",
    "BalancedStats",
    "ECHO_DEFAULT_BATCH_BAND",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "PolicyLossConfig",
    "Preset",
    "StepStats",
    "agg_loss",
    "agg_weights",
    "as_policy_loss_config",
    "balanced_stats",
    "compute_advantages",
    "compute_policy_loss",
    "compute_step_stats",
    "get_preset",
    "kl_penalty",
    "needs_log_prob_prepass",
    "overlong_reward_penalty",
    "register_policy_loss",
    "shard_batch",
    "split_micro_batches",
    "step_agg_loss",
    "truncated_response_mask",
    "zero_variance_groups",
]
