"""Warm-started testbed weights shipped with the package, so every machine starts from one policy.

The testbed warm-up is deterministic on one machine, but not across CPUs (the same pinned
packages stopped at step 2,100 on an AVX2 machine and 2,700 on an AVX-512 one). The policies of
``model=testbed`` and ``model=testbed-length`` are therefore shipped as package data:

    src/echotrain/models/weights/<name>.safetensors   the state dict (float32, tied weights once)
    src/echotrain/models/weights/manifest.json        per name: file, SHA-256, size, the full
                                                      TestbedConfig, the warm-up report, the CPU
                                                      and torch of the build, the build command

:func:`echotrain.models.testbed.load_testbed` loads a shipped file when its manifest entry's
config equals the requested one, after checking its SHA-256 (:func:`verify`); otherwise it uses
the cache / builds. ``echotrain testbed --model NAME --force`` rebuilds into the cache and prints
the rebuilt weights' SHA-256 next to the shipped one; ``--export DIR`` writes a file and its
manifest entry (the command that made the shipped files: ``echotrain testbed --model NAME
--export src/echotrain/models/weights``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["WEIGHTS_DIR", "WeightsError", "export", "file_sha256", "manifest", "shipped_entry", "verify"]

#: The folder of the shipped weights (package data).
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
MANIFEST = "manifest.json"


class WeightsError(ValueError):
    """A shipped weights file is missing or its SHA-256 differs from the manifest's."""


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(weights_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The manifest (``{name: entry}``) of ``weights_dir`` (default :data:`WEIGHTS_DIR`); {} when absent."""
    path = Path(weights_dir or WEIGHTS_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _plain(config: Any) -> dict[str, Any]:
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(config)))


def shipped_entry(config: Any, weights_dir: str | os.PathLike | None = None) -> tuple[str, dict[str, Any]] | None:
    """``(name, entry)`` of the shipped weights built with exactly ``config`` (a TestbedConfig), or None."""
    want = _plain(config)
    for name, entry in manifest(weights_dir).items():
        if entry.get("config") == want:
            return name, entry
    return None


def verify(name: str, weights_dir: str | os.PathLike | None = None) -> Path:
    """The path of shipped weights ``name`` after checking its SHA-256 against the manifest.

    Raises:
        WeightsError: no such entry, the file is missing, or its SHA-256 differs (the message
            names the file, both hashes and how to rebuild).
    """
    folder = Path(weights_dir or WEIGHTS_DIR)
    entry = manifest(folder).get(name)
    if entry is None:
        raise WeightsError(f"no shipped weights named {name!r} in {folder / MANIFEST}")
    path = folder / entry["file"]
    if not path.is_file():
        raise WeightsError(f"shipped weights {path} are missing (reinstall echotrain, or rebuild them with "
                           f"`{entry.get('build', 'echotrain testbed')}`)")
    got = file_sha256(path)
    if got != entry["sha256"]:
        raise WeightsError(f"shipped weights {path}: SHA-256 {got} differs from the manifest's {entry['sha256']} "
                           f"(damaged or replaced file; reinstall echotrain, or rebuild with `{entry.get('build')}`)")
    return path


def load_into(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a safetensors file written by :func:`save` into ``model`` (strict; tied weights once)."""
    from safetensors.torch import load_model

    load_model(model, str(path), strict=True)


def save(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Write ``model``'s state dict as safetensors (no metadata but the format: same weights, same
    bytes) and return the file's SHA-256."""
    from safetensors.torch import save_model

    save_model(model, str(path))
    os.chmod(path, 0o644)
    return file_sha256(path)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 the file :func:`save` would write for ``model`` (to compare a rebuild with the shipped one)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return save(model, Path(tmp) / "w.safetensors")


def export(name: str, model: torch.nn.Module, config: Any, report: dict[str, Any],
           weights_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write ``<weights_dir>/<name>.safetensors`` and its manifest entry; return the entry.

    The entry holds the file, its SHA-256 and size, the full config (what :func:`shipped_entry`
    matches), the warm-up report, the dtype, the CPU, torch version and the build command.
    """
    folder = Path(weights_dir or WEIGHTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.safetensors"
    sha = save(model, path)
    keep = ("steps", "stage_steps", "accuracy", "reached_target", "history", "seconds", "num_params", "key")
    entry = {"file": path.name, "sha256": sha, "bytes": path.stat().st_size,
             "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "config": _plain(config),
             "report": {k: report[k] for k in keep if k in report}, "torch": torch.__version__,
             "cpu": _cpu_name(), "build": f"echotrain testbed --model {name} --force --export src/echotrain/models/weights"}
    data = manifest(folder)
    data[name] = entry
    (folder / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return entry


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                return line.split(":", 1)[1].strip() + (" (AVX-512)" if "avx512f" in flags else " (no AVX-512)")
    except OSError:
        pass
    return platform.processor() or platform.machine()
