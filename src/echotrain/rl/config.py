"""``PolicyLossConfig``: the knobs of every policy loss, named as in verl's actor config.

One dataclass for all loss modes, so that a config reads the same in the trainer, the CLI, the
presets and a verl adapter. A plain ``dict`` with the same keys is accepted everywhere a config
is (see :func:`as_policy_loss_config`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from echotrain.rl.validation import check_choice

#: Provisional ECHO batch band (eps_b_low, eps_b_high) on R. Ours: no published value exists.
#: With the default ``batch_ratio="geo"``, log R is the batch mean of the token log-ratios,
#: an estimate of -KL(pi_old || pi), so 1 - R_geo ~ KL: a PPO-sized band of 0.2 would need a
#: KL of ~0.2 and never fires. In a synthetic look (``python benchmarks/bench_objectives.py
#: --echo-band-look``, table in docs/benchmarks.md) 1 - R_geo = 0.01 is reached when about 10-15%
#: of the tokens would leave a +-0.2 token band; 0.01 therefore bounds the step's KL at ~0.01.
#: ``arith`` R stays within ~1e-3 of 1 whatever the drift (E_old[rho] = 1), so it rarely fires.
#: Provisional: the trainer's sweep of R on real runs must confirm or replace it.
ECHO_DEFAULT_BATCH_BAND: tuple[float, float] = (0.01, 0.01)

BATCH_RATIOS = ("geo", "arith")
#: ECHO's token-level clip on top of the batch clip (design/objectives.md §4, "open choices").
ECHO_TOKEN_CLIPS = ("ppo", "none", "truncate")
BA_SCOPES = ("group", "batch")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Configuration of the policy losses in :data:`echotrain.rl.POLICY_LOSSES`.

    Field names are verl's (``actor_rollout_ref.actor.*``) where verl has the field.
    """

    clip_ratio_low: float = 0.2
    """Token clip eps_low: rho is clipped below at 1 - eps_low (PPO, arXiv 1707.06347). GRPO 0.2."""
    clip_ratio_high: float = 0.2
    """Token clip eps_high: rho is clipped above at 1 + eps_high. DAPO clip-higher: 0.28
    (arXiv 2503.14476). GSPO uses 3e-4 / 4e-4 on its sequence ratio (arXiv 2507.18071)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 (arXiv 1912.09729): for A < 0 the loss is capped at -c A.
    None disables dual-clip (our default; verl's default is 3.0)."""
    batch_clip_low: float = ECHO_DEFAULT_BATCH_BAND[0]
    """ECHO: the batch ratio R is clipped below at 1 - batch_clip_low. Provisional default."""
    batch_clip_high: float = ECHO_DEFAULT_BATCH_BAND[1]
    """ECHO: the batch ratio R is clipped above at 1 + batch_clip_high. Provisional default."""
    batch_ratio: str = "geo"
    """ECHO batch ratio: "geo" = exp(mean log rho) (default, bounds the KL estimate) or
    "arith" = mean rho (the abstract's "average importance sampling ratio")."""
    detach_kappa: bool = False
    """ECHO: True treats kappa = clip(R)/R as a constant (uniform rescaling, no baseline term)."""
    echo_pessimistic: bool = False
    """ECHO: apply the batch factor only where it lowers the surrogate: per token
    J = min(J(rho), J(kappa rho)) (PPO's ``min``, one level up). False (default, provisional):
    J = J(kappa rho) everywhere, so with R outside the band and every token moving the same way
    the gradient can vanish. Design §4; the study (issue 12) decides the default."""
    echo_token_clip: str = "ppo"
    """ECHO token-level term on top of the batch clip: "ppo" (default: the PPO/DAPO token clip
    with clip_ratio_low/high and clip_ratio_c), "none" (batch clip only: J = rho~ A) or
    "truncate" (truncated importance weight, no PPO clip: value min(rho~, c) A, gradient
    min(rho~, c) A grad log pi, c = echo_token_cap). clip_ratio_low/high/c apply only to "ppo".
    Design §4; the study decides the default."""
    echo_token_cap: float = 2.0
    """ECHO ``echo_token_clip="truncate"``: the cap c >= 1 on rho~ (truncated IS; 2.0 is the
    cap of truncated importance sampling in Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"). Unused by the other token clips."""
    norm_constant: float | None = None
    """Constant C of ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv 2503.20783), e.g. the maximum
    response length. Required by that mode; never the padded width of a batch."""
    ba_scope: str = "group"
    """Balanced Aggregation: "group" (per prompt group, default) or "batch" (pooled)."""
    ba_count_zero_adv: bool = True
    """Balanced Aggregation: zero-advantage responses count in the group size G (default)."""
    log_ratio_clamp: float = 20.0
    """log rho is clamped to +-this before ``exp`` (verl uses 20)."""

    def __post_init__(self) -> None:
        for name in ("clip_ratio_low", "clip_ratio_high", "batch_clip_low", "batch_clip_high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
        if self.clip_ratio_low >= 1:
            raise ValueError(f"clip_ratio_low must be < 1 (ratio floor 1 - eps_low > 0), got {self.clip_ratio_low}")
        if self.batch_clip_low >= 1:
            raise ValueError(f"batch_clip_low must be < 1, got {self.batch_clip_low}")
        if self.clip_ratio_c is not None and not (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1.0):
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO (or None to disable), got {self.clip_ratio_c}")
        check_choice("batch_ratio", self.batch_ratio, BATCH_RATIOS)
        check_choice("echo_token_clip", self.echo_token_clip, ECHO_TOKEN_CLIPS)
        if not isinstance(self.echo_pessimistic, bool):
            raise ValueError(f"echo_pessimistic must be a bool, got {self.echo_pessimistic!r}")
        c = self.echo_token_cap
        if isinstance(c, bool) or not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 1):
            raise ValueError(f"echo_token_cap must be a finite float >= 1 (the truncation cap on rho~), got {c!r}")
        check_choice("ba_scope", self.ba_scope, BA_SCOPES)
        if self.norm_constant is not None and not (math.isfinite(self.norm_constant) and self.norm_constant > 0):
            raise ValueError(f"norm_constant must be > 0, got {self.norm_constant}")
        if not (self.log_ratio_clamp > 0 and math.isfinite(self.log_ratio_clamp)):  # inf: exp overflows
            raise ValueError(f"log_ratio_clamp must be finite and > 0, got {self.log_ratio_clamp}")


_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossConfig))


def as_policy_loss_config(config: PolicyLossConfig | Mapping[str, Any] | None) -> PolicyLossConfig:
    """Return ``config`` as a :class:`PolicyLossConfig` (None -> defaults; dicts converted).

    Raises:
        TypeError: not a PolicyLossConfig, mapping or None.
        ValueError: unknown keys (the message lists the valid ones) or invalid values.
    """
    if config is None:
        return PolicyLossConfig()
    if isinstance(config, PolicyLossConfig):
        return config
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown PolicyLossConfig key(s) {unknown}; valid: {sorted(_FIELDS)}")
        return PolicyLossConfig(**config)
    raise TypeError(f"config must be a PolicyLossConfig, a dict or None, got {type(config).__name__}")
