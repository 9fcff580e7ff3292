"""A policy for evaluation from what the user names: a model name or path, a training run
directory or one of its checkpoint files (``echotrain eval --model``, both ``--task`` and
``--suite``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["load_for_eval"]


def load_for_eval(model: str | None, device: str = "cpu") -> tuple[Any, Any, str]:
    """Load a policy for evaluation from a model name/path, a run directory or a checkpoint file.

    - run directory (has ``config.yaml``): its ``final_model`` if present, else the base model of
      its config with the latest checkpoint's weights;
    - a checkpoint file ``.../checkpoints/step_*.pt``: the run's base model with these weights;
      a LoRA run's checkpoint (``lora_r > 0`` in its config.yaml) holds the adapters only, so
      they are put on the base model (the run's ``lora_*`` settings) and merged into it;
    - anything else (or None): ``echotrain.models.load_policy(model)``.

    Returns:
        ``(model, tokenizer, description)``.

    Raises:
        FileNotFoundError: a run directory without a model or checkpoint.
        echotrain.runtime.checkpoints.CheckpointError: a damaged checkpoint, or one whose weights do
            not fit the run's base model (names both).
    """
    from echotrain.models import load_policy
    from echotrain.runtime.checkpoints import CheckpointError, latest_valid_checkpoint, load_checkpoint

    if model is not None and os.path.exists(model):
        p = Path(model)
        ckpt = None
        if p.is_file() and p.suffix == ".pt":
            ckpt, run_dir = p, p.parent.parent
        elif p.is_dir() and (p / "config.yaml").is_file():
            run_dir = p
            if (p / "final_model").is_dir():
                m, tok = load_policy(str(p / "final_model"), device=device)
                return m, tok, f"{p / 'final_model'}"
            ckpt = latest_valid_checkpoint(p)[0]
            if ckpt is None:
                raise FileNotFoundError(f"run directory {str(p)!r} has neither final_model/ nor checkpoints")
        else:
            m, tok = load_policy(str(p), device=device)
            return m, tok, str(p)
        import yaml

        run_cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        base = run_cfg.get("model")
        m, tok = load_policy(base, device=device)
        state = load_checkpoint(ckpt, map_location=device)["model"]
        lora_r = int(run_cfg.get("lora_r") or 0)
        if lora_r > 0:  # the checkpoint holds the adapters only: base model + adapters, merged for speed
            from echotrain.runtime.lora import apply_lora, load_model_state

            m = apply_lora(m, r=lora_r, alpha=float(run_cfg.get("lora_alpha", 16.0)), dropout=0.0,
                           target_modules=str(run_cfg.get("lora_target_modules", "all-linear")))
            load_model_state(m, state)
            m = m.merge_and_unload().eval()
            return m, tok, f"{ckpt} (base {base or 'default'} + LoRA r={lora_r} adapters)"
        try:
            m.load_state_dict(state)
        except RuntimeError as exc:  # e.g. a checkpoint of another base model
            raise CheckpointError(f"checkpoint {str(ckpt)!r} does not fit its run's base model {base or 'default'!r}: "
                                  f"{str(exc).splitlines()[0]}") from exc
        return m, tok, f"{ckpt} (base {base or 'default'})"
    m, tok = load_policy(model, device=device)
    return m, tok, model or "smollm2-135m-instruct (embedded default)"
