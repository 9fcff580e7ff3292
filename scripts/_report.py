"""The closing step of the measurement scripts in this folder: the result printed as JSON on
stdout and, with ``--json PATH``, written to PATH (atomically: :func:`echotrain.atomic.atomic_write_text`)."""

from __future__ import annotations

import json
from typing import Any


def report(result: dict[str, Any], path: str | None) -> None:
    """Print ``result`` as indented JSON; also write it to ``path`` unless that is None or empty."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        from echotrain.atomic import atomic_write_text

        atomic_write_text(path, text + "\n")
