"""The registry of rollout corrections (names only, no math): what ``rollout_correction`` may name.

Kept apart from :mod:`echotrain.rl.correction` so that :mod:`echotrain.rl.config` can check the
setting against the live registry without an import cycle.
"""

from __future__ import annotations

from typing import Any, Callable

from echotrain.rl.registry import Registry

#: ``rollout_correction`` name -> ``fn(CorrectionInputs, PolicyLossConfig) -> Correction``; live.
ROLLOUT_CORRECTIONS: Registry[Callable[..., Any]] = Registry("rollout correction", "rollout_correction")
LEVELS = ("token", "sequence")


def register_rollout_correction(name: str, *, level: str, settings: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a correction ``fn(x: CorrectionInputs, cfg) -> Correction``.

    Args:
        name: the ``rollout_correction`` value.
        level: "token" or "sequence": the level of its weights (batch normalisation averages
            per sequence when every weighting correction of a chain is sequence-level).
        settings: the :class:`~echotrain.rl.PolicyLossConfig` fields it reads (documentation,
            adapters).

    Raises:
        ValueError: ``name`` already registered; unknown ``level``.
    """
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is unknown; valid: {list(LEVELS)}")
    return ROLLOUT_CORRECTIONS.register(name, level=level, settings=tuple(settings))


def parse_rollout_correction(value: str | None) -> tuple[str, ...]:
    """The correction names of a ``rollout_correction`` value: None, "" or "none" -> ``()``;
    "a,b" -> ``("a", "b")``.

    Raises:
        ValueError: an unknown or repeated name (the message lists the valid ones).
    """
    if value is None or value.strip().lower() in ("", "none"):
        return ()
    names = tuple(n.strip() for n in value.split(","))
    for n in names:
        if n not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction name {n!r} is unknown; valid: {sorted(ROLLOUT_CORRECTIONS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"rollout_correction={value!r} names a correction twice")
    return names
