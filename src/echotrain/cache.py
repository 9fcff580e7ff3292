"""Where echotrain keeps what it builds or measures once per machine (converted GGUF models,
built testbed policies, the roofline peaks). A ground-floor module: it imports nothing from
echotrain, so every layer may ask for the folder."""

from __future__ import annotations

import os
from pathlib import Path

#: environment variable naming the cache folder
CACHE_ENV = "ECHOTRAIN_CACHE"


def default_cache_dir() -> Path:
    """``$ECHOTRAIN_CACHE`` (``~`` expanded) if set and not empty, else ``~/.cache/echotrain``.
    The folder is not created here; each writer creates its own subfolder."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "echotrain"
