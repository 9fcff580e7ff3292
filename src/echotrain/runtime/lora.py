"""LoRA fine-tuning through ``peft`` (Hu et al. 2021, arXiv 2106.09685): the trainer's only
contact with peft.

- :func:`apply_lora` wraps the policy in a ``PeftModel`` (only the adapters train).
- :func:`reference_policy` is the KL reference: the *same* model with its adapters disabled,
  i.e. the frozen base weights, with no second copy of the model in memory.
- :func:`model_state` / :func:`load_model_state`: checkpoints hold the adapter weights only
  (the base weights never change); the optimizer state covers the adapters only.
- :func:`save_final_model`: ``final_model`` merged into plain weights (loads without peft) or
  as a peft adapter folder.

peft is an optional dependency (``pip install 'echotrain[lora]'``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator

#: the pip extra that installs peft
EXTRA = "lora"


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - exercised only without peft
        raise ImportError(f"lora_r > 0 needs the peft package: pip install 'echotrain[{EXTRA}]'") from exc
    return peft


def parse_target_modules(value: str) -> str | list[str]:
    """``lora_target_modules``: ``all-linear`` (peft's every linear layer but the output head) or
    a comma-separated list of module-name suffixes (e.g. ``q_proj,v_proj``)."""
    value = value.strip()
    if value == "all-linear":
        return value
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ValueError("lora_target_modules is empty; use all-linear or e.g. q_proj,v_proj")
    return names


def apply_lora(model: Any, *, r: int, alpha: float, dropout: float, target_modules: str) -> Any:
    """Wrap ``model`` (a Hugging Face causal LM) in a peft ``PeftModel`` with LoRA adapters.

    The adapters' B matrices start at zero, so the wrapped model computes exactly the base model
    at step 0. Only adapter parameters have ``requires_grad``.

    Args:
        r: adapter rank (>= 1). alpha: scaling numerator (the update is ``alpha / r * B A``).
        dropout: dropout on the adapter input. target_modules: see :func:`parse_target_modules`.

    Raises:
        ImportError: peft is not installed (names the extra to install).
        ValueError: empty target list, or no module of the model matches.
    """
    import torch

    peft = _peft()
    # peft's CAUSAL_LM wrapper needs transformers' generation API; our own models (the testbed's
    # LoopedTransformer) have their own generate and get the task-agnostic wrapper; peft then cannot
    # tell the output head, so all-linear leaves out ``lm_head`` by name, as it does for transformers
    task_type = "CAUSAL_LM" if hasattr(model, "prepare_inputs_for_generation") else None
    targets = parse_target_modules(target_modules)
    exclude = (["lm_head"] if task_type is None and targets == "all-linear"
               and isinstance(getattr(model, "lm_head", None), torch.nn.Linear) else None)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                          task_type=task_type, exclude_modules=exclude)
    return peft.get_peft_model(model, cfg)


def is_lora(model: Any) -> bool:
    """True if ``model`` is a peft model (built by :func:`apply_lora`). Never imports peft: a peft
    model cannot exist before peft is imported, and the import costs seconds (it pulls in torchao
    and bitsandbytes) on every run that has no adapters."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


@contextlib.contextmanager
def reference_policy(model: Any) -> Iterator[Any]:
    """``with reference_policy(model) as ref:`` -- ``ref`` is ``model`` with its adapters
    disabled: the frozen base model, the KL reference (no copy)."""
    with model.disable_adapter():
        yield model


def model_state(model: Any) -> dict[str, Any]:
    """What a checkpoint stores of the model: the adapter weights for a peft model, else the full
    ``state_dict``."""
    if is_lora(model):
        import peft

        return peft.get_peft_model_state_dict(model)
    return model.state_dict()


def load_model_state(model: Any, state: dict[str, Any]) -> None:
    """Inverse of :func:`model_state`.

    Raises:
        RuntimeError: keys do not match the model (e.g. a full-model checkpoint into a LoRA run).
    """
    if is_lora(model):
        import peft

        res = peft.set_peft_model_state_dict(model, state)
        missing = [k for k in getattr(res, "unexpected_keys", [])]
        if missing:
            raise RuntimeError(f"checkpoint keys not in the LoRA model (was it saved by a full fine-tuning run?): "
                               f"{missing[:5]}")
        return
    model.load_state_dict(state)


def save_final_model(model: Any, path: str | Path, *, merged: bool) -> None:
    """``save_pretrained`` the final policy into ``path``.

    A peft model is saved merged (adapters folded into the base weights of a copy; loads with
    plain transformers) when ``merged``, else as a peft adapter folder (adapter_config.json +
    adapter weights, loads with ``peft.AutoPeftModelForCausalLM``). Other models are saved as is.
    """
    if is_lora(model) and merged:
        import copy

        copy.deepcopy(model).merge_and_unload().save_pretrained(path)
    else:
        model.save_pretrained(path)
