"""What a resolved config keeps of its preset, said truthfully.

``loss_mode=gspo`` alone on the default preset (``echo``) trains GSPO's loss with ECHO's other
choices (aggregation ``token-mean``, clip band 0.2/0.28, ...): the preset layer is applied first
and a later layer overrides single keys (:func:`~echotrain.train.config.parse.resolve_config`).
This module names that mix: :func:`preset_label` (``echo+loss_mode=gspo``: the progress line and
the plots' title) and :func:`preset_note` (the startup line listing what was overridden and what
was kept from the preset).

A preset's *recipe keys* (:func:`recipe_keys`) are the keys on which the presets of
:data:`echotrain.rl.PRESETS` differ (estimator, loss, aggregation, clip band, KL, dynamic sampling,
overlong shaping, ...): the choices a preset makes. Keys every preset sets alike are not the
preset's choice and are not reported.
"""

from __future__ import annotations

from typing import Any

from echotrain.train.config.parse import preset_values
from echotrain.train.config.schema import TrainConfig


def recipe_keys() -> list[str]:
    """The trainer keys on which the presets of :data:`echotrain.rl.PRESETS` differ, in
    :func:`~echotrain.train.config.parse.preset_values` order (``adv_estimator``, ``loss_mode``,
    ``loss_agg_mode``, ``kl_coef``, ``dynamic_sampling``, ``clip_ratio_low``, ...)."""
    from echotrain.rl import PRESETS

    values = [preset_values(name) for name in PRESETS]
    return [k for k in values[0] if len({repr(v.get(k)) for v in values}) > 1]


def preset_overrides(cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The recipe keys whose value in ``cfg`` differs from ``cfg.preset``'s:
    ``{key: (preset's value, cfg's value)}``, in :func:`recipe_keys` order. Empty when the run
    trains exactly its preset's recipe.

    Raises:
        ConfigError: ``cfg.preset`` is not a preset (a validated config always names one).
    """
    preset = preset_values(cfg.preset)
    return {k: (preset[k], getattr(cfg, k)) for k in recipe_keys() if getattr(cfg, k) != preset[k]}


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def preset_label(cfg: TrainConfig) -> str:
    """The preset as the run trains it: ``cfg.preset``, then ``+key=value`` for each overridden
    recipe key (``echo+loss_mode=gspo``; ``gspo`` when nothing is overridden)."""
    return cfg.preset + "".join(f"+{k}={_fmt(v)}" for k, (_, v) in preset_overrides(cfg).items())


def preset_note(cfg: TrainConfig) -> str | None:
    """One line for the start of a run whose config overrides recipe keys of its preset, else
    None. It names the overridden keys (with the preset's value), the recipe keys kept from the
    preset (of the loss settings, shared :class:`~echotrain.rl.config.PolicyLossConfig` fields and
    each loss's own declared ones, only those the run's loss reads: its registration's ``reads``
    and its own settings) and the presets whose recipe has the run's
    ``loss_mode``, e.g. ``preset echo with loss_mode=gspo (the preset's: echo); from the preset:
    adv_estimator=grpo, loss_agg_mode=token-mean, ..., clip_ratio_low=0.2, clip_ratio_high=0.28
    (set them too, or preset=gspo for that paper's recipe)``."""
    from echotrain.rl import PRESETS
    from echotrain.rl.config import LOSS_SETTINGS, POLICY_LOSS_FIELDS
    from echotrain.rl.objectives import POLICY_LOSSES

    over = preset_overrides(cfg)
    if not over:
        return None
    # loss keys: the shared PolicyLossConfig fields and every loss's own declared settings; the
    # run's loss reads its registration's `reads` and the settings it declared itself
    loss_keys = set(POLICY_LOSS_FIELDS) | set(LOSS_SETTINGS)
    reads = set(POLICY_LOSSES.info(cfg.loss_mode).get("reads", ())) if cfg.loss_mode in POLICY_LOSSES else set()
    reads |= {s for s in LOSS_SETTINGS if LOSS_SETTINGS.info(s).get("loss_mode") == cfg.loss_mode}
    kept = [k for k in recipe_keys() if k not in over and (k not in loss_keys or k in reads)]
    changed = ", ".join(f"{k}={_fmt(v)} (the preset's: {_fmt(p)})" for k, (p, v) in over.items())
    line = f"preset {cfg.preset} with {changed}"
    if kept:
        line += "; from the preset: " + ", ".join(f"{k}={_fmt(getattr(cfg, k))}" for k in kept)
    own = [name for name, p in PRESETS.items() if p.loss_mode == cfg.loss_mode and name != cfg.preset]
    if "loss_mode" in over and own:
        line += f" (set them too, or preset={'|'.join(own)} for that paper's recipe)"
    return line
