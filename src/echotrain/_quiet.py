"""Silence known-harmless third-party log noise in the ``echotrain`` command (not in the library).

Each entry is (logger name, message prefix); only records starting with that prefix are dropped,
everything else from those loggers still shows.

- torchao on a CPU-only machine: "Failed to load .../_C_*.so" for its CUDA kernels (it falls
  back to the Python implementation).
- torch ``_pytree``: "<enum ...> is an Enum subclass and is now natively supported by
  torch.compile ..." deprecation notices raised by torchao's imports.
"""

from __future__ import annotations

import logging

KNOWN_NOISE: tuple[tuple[str, str], ...] = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "<enum "),
    ("torchao.kernel.intmm", "Warning: Detected no triton"),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not record.getMessage().startswith(self.prefix)
        except Exception:  # pragma: no cover - a malformed record: let it through
            return True


def silence_known_noise() -> None:
    """Install the filters of :data:`KNOWN_NOISE` (idempotent)."""
    for name, prefix in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropPrefix(prefix))
