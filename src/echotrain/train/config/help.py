"""The option reference of ``echotrain train --help``: every :class:`TrainConfig` key by group,
with its default, help text and valid choices."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import fields

from echotrain.train.config.schema import TrainConfig
from echotrain.train.config.validate import registry_choices


def format_help() -> str:
    """The option reference printed by ``echotrain train --help``: every key, its default and help."""
    lines, group = [], None
    from_registries = registry_choices()
    for f in fields(TrainConfig):
        g = f.metadata.get("group", "run")
        if g != group:
            lines.append(f"\n{g} keys:")
            group = g
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        choices = f.metadata.get("choices") or from_registries.get(f.name)
        extra = f" choices: {', '.join(map(str, choices))}." if choices else ""
        body = textwrap.fill(f"{f.metadata['help']}{extra}", width=96, initial_indent="      ",
                             subsequent_indent="      ")
        lines.append(f"  {f.name}={default!r}\n{body}")
    return "\n".join(lines)

