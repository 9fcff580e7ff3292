"""The error type of a bad setting, shared by every command that checks settings."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key and the valid choices."""
