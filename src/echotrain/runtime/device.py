"""The ``device`` setting resolved, and why: ``auto`` is CUDA when a CUDA GPU is usable, else the CPU.

``device=auto`` is the trainer's default (our choice, a documented flag: a user with a GPU
expects it to be used, and the CPU stays the answer everywhere else). The startup line of
``echotrain train`` prints the resolution with its reason (as it does for ``autocast``,
:mod:`echotrain.runtime.precision`) and ``run_info.json`` keeps it as ``device_reason``;
:func:`echotrain.runtime.preflight.check_device` refuses an explicit device that is not usable
before a model loads. Under torchrun a bare ``cuda`` becomes ``cuda:<LOCAL_RANK>`` (the trainer).
"""

from __future__ import annotations

import torch


def resolve_device_why(name: str) -> tuple[torch.device, str]:
    """``(device, why)`` for the ``device`` setting ``name``.

    ``"auto"``: ``cuda`` when ``torch.cuda.is_available()``, with the GPU's name in ``why``;
    else ``cpu``, with whether this torch build has no CUDA (a CPU wheel) or no GPU is visible.
    Anything else is ``torch.device(name)`` ("device=cuda:1 is set").

    Raises:
        RuntimeError: ``name`` is not a device string torch parses (the config's validation
            refuses those first, with a ConfigError).
    """
    if name != "auto":
        return torch.device(name), f"device={name} is set"
    if torch.cuda.is_available():
        return torch.device("cuda"), f"device=auto and a CUDA GPU is visible ({torch.cuda.get_device_name(0)})"
    if torch.version.cuda is None:
        return torch.device("cpu"), "device=auto and this torch build has no CUDA (a CPU wheel)"
    return torch.device("cpu"), "device=auto and no CUDA GPU is visible (driver / CUDA_VISIBLE_DEVICES)"


def resolve_device(name: str) -> torch.device:
    """:func:`resolve_device_why` without the reason."""
    return resolve_device_why(name)[0]


def rng_devices(device: torch.device | str) -> list[int]:
    """The ``devices`` argument of ``torch.random.fork_rng`` for work on ``device``: its CUDA
    index (the current device for a bare ``cuda``), or ``[]`` off CUDA. A fork with ``[]`` keeps
    only the CPU generator, so ``torch.manual_seed`` or CUDA sampling inside it would move the
    run's CUDA stream."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
