"""The error type of a bad setting, shared by every command that checks settings (the trainer's
keys, the preflight, a comparison file, a custom reward's import path). A ground-floor module:
it imports nothing from echotrain, so any layer may raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key and the valid choices.

    The CLI prints it as one line (``echotrain <command>: error: <message>``) and exits with
    status 2; nothing has been written when it is raised by a check."""
