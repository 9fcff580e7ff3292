"""Named recipes: advantage estimator + loss mode + aggregation + clip bands, as the papers set them.

A preset is data over the trainer's own keys: each field but ``name``, ``config``,
``overlong_shaping`` and ``source`` is the :class:`echotrain.train.TrainConfig` key of the same
name, and ``config`` holds the :class:`PolicyLossConfig` fields (also TrainConfig keys).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from echotrain.rl.config import PolicyLossConfig, flat_loss_settings
from echotrain.rl.validation import check_choice


@dataclass(frozen=True)
class Preset:
    """One objective recipe. The trainer reads these fields; nothing else is implied."""

    name: str
    adv_estimator: str  # echotrain.rl.ADV_METHODS
    loss_mode: str  # echotrain.rl.POLICY_LOSSES
    loss_agg_mode: str  # echotrain.rl.AGG_MODES
    config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl_coef: float = 0.0  # beta of the KL-to-reference loss term (0: no reference model)
    kl_penalty: str = "k3"  # estimator when kl_coef > 0
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill
    # DAPO: soft overlong penalty + overlong filtering (trainer: overlong_buffer_len=-1, overlong_filtering)
    overlong_shaping: bool = False
    source: str = ""


PRESETS: dict[str, Preset] = {
    "grpo": Preset(
        "grpo", "grpo", "vanilla", "seq-mean-token-mean", PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2),
        kl_coef=0.04, kl_penalty="k3", source="DeepSeekMath arXiv 2402.03300 (beta 0.04, eps 0.2)",
    ),
    "dapo": Preset(
        "dapo", "grpo", "vanilla", "token-mean", PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28),
        dynamic_sampling=True, overlong_shaping=True, source="DAPO arXiv 2503.14476 (clip-higher 0.2/0.28)",
    ),
    "dr_grpo": Preset(
        "dr_grpo", "grpo_no_std", "vanilla", "seq-mean-token-sum-norm",
        PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2),
        source="Dr. GRPO arXiv 2503.20783; set norm_constant to the max response length",
    ),
    "gspo": Preset(
        "gspo", "grpo", "gspo", "seq-mean-token-mean", PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
        source="GSPO arXiv 2507.18071 (eps 3e-4 / 4e-4)",
    ),
    "cispo": Preset(
        "cispo", "grpo", "cispo", "token-mean",
        PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=4.0, cispo_lower_clip=False),
        source="CISPO, MiniMax-M1 arXiv 2506.13585 (IS weight capped from above only, token-mean); cap 1 + 4.0 = "
               "5.0 from ScaleRL arXiv 2510.13786 (TRL's recommended epsilon_high); clip_ratio_low unused",
    ),
    "sapo": Preset(
        "sapo", "grpo", "sapo", "seq-mean-token-mean", PolicyLossConfig(tau_pos=1.0, tau_neg=1.05),
        source="SAPO arXiv 2511.20347 (tau_pos 1.0, tau_neg 1.05, sequence-mean of token means)",
    ),
    "gmpo": Preset(
        "gmpo", "grpo", "geo_mean", "seq-mean-token-mean", PolicyLossConfig(clip_ratio_low=0.4, clip_ratio_high=0.4),
        source="GMPO arXiv 2507.20673 (token log-ratio clip (-0.4, 0.4), i.e. rho in (e^-0.4, e^0.4))",
    ),
    "echo": Preset(
        "echo", "grpo", "echo", "token-mean", PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28),
        source="ECHO (OpenReview); our formulation, docs/design/objectives.md §4; batch band provisional",
    ),
}


def get_preset(name: str, **config_overrides: Any) -> Preset:
    """The preset ``name`` with optional :class:`PolicyLossConfig` field overrides.

    Example: ``get_preset("dr_grpo", norm_constant=1024)``.

    Raises:
        ValueError: unknown preset (lists the valid ones) or invalid overrides.
    """
    check_choice("preset", name, PRESETS)
    preset = PRESETS[name]
    if not config_overrides:
        return preset
    bad = sorted(set(config_overrides) - {f.name for f in dataclasses.fields(PolicyLossConfig)}
                 - set(flat_loss_settings()))
    if bad:
        raise ValueError(f"unknown PolicyLossConfig field(s) {bad}")
    return dataclasses.replace(preset, config=dataclasses.replace(preset.config, **config_overrides))
