"""Mixed precision for the policy's forward passes: ``torch.autocast`` in bfloat16, chosen once.

The ``autocast`` setting of :class:`echotrain.train.config.TrainConfig`:

- ``"off"``: every op in the parameters' dtype (float32 by default).
- ``"bfloat16"``: the model's forward passes (rollout generation, old/reference log-probs, the
  with-grad forward, greedy evaluation) run under ``torch.autocast(device, torch.bfloat16)``:
  matrix products in bfloat16 with float32 accumulation, weights, gradients, optimizer state,
  ``log_softmax`` of the logits and every loss stay float32 (mixed precision, Micikevicius et
  al., ICLR 2018, arXiv 1710.03740; bfloat16: Kalamkar et al. 2019, arXiv 1905.12322). The
  backward pass follows the dtypes autocast recorded.
- ``"auto"`` (default): ``"bfloat16"`` where the hardware multiplies bfloat16 natively (a CPU
  with AVX512-BF16 or AMX tiles, a CUDA GPU that supports bfloat16), the parameters are float32
  and, on a CPU, the model has at least :data:`CPU_BF16_MIN_PARAMS` parameters; ``"off"``
  elsewhere: where bfloat16 would be emulated it is slower than float32, and on a CPU the
  products of a small model do not gain from it (:data:`CPU_BF16_MEASURED`). The size rule is
  ours (a documented flag) and holds for CPUs only: no GPU was measured.

All passes of a run use the same precision, so an on-policy importance ratio is still exactly 1
(``old_log_prob`` and ``log_prob`` come from the same computation). Bit-reproducibility on one
machine holds with ``"off"``; bfloat16 runs with more than one thread were seen to part after a
few steps (README, Reproducibility). A machine that resolves ``auto`` differently computes a
different (equally valid) run, so set ``autocast`` explicitly to compare runs across machines. Measured speed-up on a 2-core
AVX512-BF16 CPU: docs/benchmarks.md, "Mixed precision". :func:`resolve_autocast_why` also says why
(the setting, the CPU's instruction sets, the override, the parameter dtype): the startup line of
``echotrain train`` prints it and ``run_info.json`` keeps it as ``autocast_reason``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch

#: values of the ``autocast`` setting
AUTOCAST_CHOICES = ("auto", "off", "bfloat16")


#: environment variable that overrides the hardware check of ``auto``: "1" = native bf16, "0" = not
NATIVE_BF16_ENV = "ECHOTRAIN_NATIVE_BF16"

#: ``auto`` on a CPU with native bf16 picks bfloat16 only for a model of at least this many
#: parameters (our choice, a documented flag): bfloat16 was measured slower than float32 for the
#: 0.43M testbed and faster for the 135M default model (:data:`CPU_BF16_MEASURED`), so the
#: threshold sits between the two, below the default model, whose runs keep their precision.
CPU_BF16_MIN_PARAMS = 100_000_000

#: what was measured on CPUs with native bf16, the ground of :data:`CPU_BF16_MIN_PARAMS` (the
#: ``autocast`` key's help quotes it; docs/benchmarks.md, "Mixed precision", has the figures)
CPU_BF16_MEASURED = ("bfloat16 autocast ran the default job (SmolLM2-135M) in 0.84x the float32 time (AMD "
                     "AVX512-BF16, 2026-12-04) and the 0.43M testbed 10-18% slower")


def native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ('cpu' | 'cuda' | ...) computes bfloat16 matrix products natively.

    CPU: AVX512-BF16 or AMX tile instructions (``torch.cpu`` capability checks; False when this
    torch build cannot tell). CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)``. Other devices: False.
    ``ECHOTRAIN_NATIVE_BF16=0`` / ``=1`` overrides the check (the test suite sets 0, so that
    ``auto`` means float32 on every machine it runs on).
    """
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if device_type == "cpu":
        return bool(cpu_bf16_features())
    return _probe_native_bf16(device_type)


#: the CPU instruction sets that multiply bfloat16 natively, as named in logs, with torch's check
_CPU_BF16_CHECKS = (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))


@functools.lru_cache(maxsize=1)
def cpu_bf16_features() -> tuple[str, ...]:
    """The native-bf16 instruction sets of this CPU among AVX512-BF16 and AMX (``torch.cpu``
    capability checks; empty when this torch build cannot tell)."""
    found = []
    for label, name in _CPU_BF16_CHECKS:
        check = getattr(torch.cpu, name, None)
        try:
            if check is not None and bool(check()):
                found.append(label)
        except (RuntimeError, AttributeError):
            pass
    return tuple(found)


@functools.lru_cache(maxsize=8)
def _probe_native_bf16(device_type: str) -> bool:
    if device_type == "cuda":
        # not emulated bf16 (pre-Ampere GPUs): slower than float32 there
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return False


def resolve_autocast(setting: str, device: torch.device | str, param_dtype: torch.dtype = torch.float32,
                     num_params: int | None = None) -> torch.dtype | None:
    """The autocast dtype of a run: ``torch.bfloat16`` or None (no autocast).

    Args:
        setting: ``"auto"`` | ``"off"`` | ``"bfloat16"`` (the ``autocast`` config key).
        device: the device the policy runs on.
        param_dtype: the policy's parameter dtype; ``"auto"`` resolves to None unless float32
            (bfloat16/float16 parameters already compute in low precision).
        num_params: the policy's parameter count; ``"auto"`` on a CPU resolves to None below
            :data:`CPU_BF16_MIN_PARAMS`. None = unknown (no size rule).
    Raises:
        ValueError: ``setting`` is not one of :data:`AUTOCAST_CHOICES`.
    """
    return resolve_autocast_why(setting, device, param_dtype, num_params)[0]


def resolve_autocast_why(setting: str, device: torch.device | str, param_dtype: torch.dtype = torch.float32,
                         num_params: int | None = None) -> tuple[torch.dtype | None, str]:
    """:func:`resolve_autocast` and why, as a phrase for the startup line and ``run_info.json``
    (``autocast_reason``), e.g. ``"autocast=auto and this CPU has no native bf16 (no
    AVX512-BF16 or AMX)"``, ``"autocast=auto and this CPU has native bf16 (AMX), but the model
    has 426,624 parameters, fewer than 100,000,000: ..."`` or ``"autocast=off is set"``.

    Raises:
        ValueError: ``setting`` is not one of :data:`AUTOCAST_CHOICES`.
    """
    if setting not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast: {setting!r} is not one of {', '.join(AUTOCAST_CHOICES)}")
    device_type = torch.device(device).type
    if setting == "off":
        return None, "autocast=off is set"
    native = native_bf16(device_type)
    if setting == "bfloat16":
        return torch.bfloat16, "autocast=bfloat16 is set" + ("" if native else f", but {_hardware(device_type, False)}: "
                                                             "bf16 is emulated, slower than float32")
    if param_dtype != torch.float32:
        return None, f"autocast=auto and the parameters are {str(param_dtype).replace('torch.', '')}, not float32"
    if native and device_type == "cpu" and num_params is not None and num_params < CPU_BF16_MIN_PARAMS:
        return None, (f"autocast=auto and {_hardware(device_type, native)}, but the model has {num_params:,} "
                      f"parameters, fewer than {CPU_BF16_MIN_PARAMS:,}: bfloat16 does not pay there on a CPU "
                      "(docs/benchmarks.md, \"Mixed precision\")")
    return (torch.bfloat16 if native else None), f"autocast=auto and {_hardware(device_type, native)}"


def _hardware(device_type: str, native: bool) -> str:
    """Why ``device_type`` counts as having native bf16 or not (the env override, the CPU's
    instruction sets, the GPU)."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return f"{NATIVE_BF16_ENV}={forced} says the hardware has {'' if native else 'no '}native bf16"
    if device_type == "cpu":
        if native:
            return f"this CPU has native bf16 ({', '.join(cpu_bf16_features())})"
        return "this CPU has no native bf16 (no AVX512-BF16 or AMX)"
    if device_type == "cuda":
        return "this GPU has native bf16" if native else "this GPU has no native bf16"
    return f"no native bf16 known for device type {device_type!r}"


def resolve_for(model: Any, setting: str) -> torch.dtype | None:
    """:func:`resolve_autocast` for ``model``'s device, parameter dtype (its first parameter) and
    parameter count."""
    return resolve_for_why(model, setting)[0]


def resolve_for_why(model: Any, setting: str) -> tuple[torch.dtype | None, str]:
    """:func:`resolve_autocast_why` for ``model``'s device, parameter dtype (its first parameter)
    and parameter count (``model.parameters()``: a tied weight once; a LoRA model's base included)."""
    p = next(model.parameters())
    return resolve_autocast_why(setting, p.device, p.dtype, sum(q.numel() for q in model.parameters()))


def setting_name(dtype: torch.dtype | None) -> str:
    """The explicit ``autocast`` value a resolved dtype stands for: 'bfloat16' or 'off'."""
    return "bfloat16" if dtype is not None else "off"


def describe(dtype: torch.dtype | None, reason: str | None = None) -> str:
    """Short text for logs: 'bfloat16 autocast' or 'no autocast', followed by ', because
    <reason>' when ``reason`` (:func:`resolve_autocast_why`) is given."""
    text = "bfloat16 autocast" if dtype is not None else "no autocast"
    return f"{text}, because {reason}" if reason else text


@contextlib.contextmanager
def autocast(model: Any, dtype: torch.dtype | None) -> Iterator[None]:
    """Run the enclosed forward passes of ``model`` under ``torch.autocast`` in ``dtype`` (on the
    device of its first parameter); a no-op when ``dtype`` is None."""
    if dtype is None:
        yield
        return
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype):
        yield
