"""A policy for evaluation from what the user names: a model name or path, a training run
directory or one of its checkpoint files (``echotrain eval --model``, both ``--task`` and
``--suite``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["RUN_GENERATION_KEYS", "generation_settings", "load_for_eval", "read_run_config", "run_dir_of"]

#: The generation settings of a training run that ``echotrain eval --model RUN_DIR`` (``--task``
#: and ``--suite``) takes as its defaults, so that it generates the way the run did: the keys of
#: the trainer's config (``train/config/schema.py`` declares their defaults and help).
RUN_GENERATION_KEYS = ("decode_loop", "sampler")


def run_dir_of(model: str | None) -> Path | None:
    """The training run directory that ``--model`` names, or None: ``model`` itself when it is a
    folder holding ``config.yaml``, the run of a checkpoint file ``RUN/checkpoints/step_*.pt``
    (when ``RUN/config.yaml`` exists), else None (a model name, a model folder, a ``.gguf``)."""
    if model is None or not os.path.exists(model):
        return None
    p = Path(model)
    if p.is_file() and p.suffix == ".pt":
        run = p.parent.parent
        return run if (run / "config.yaml").is_file() else None
    return p if p.is_dir() and (p / "config.yaml").is_file() else None


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run directory's ``config.yaml`` as a mapping ({} when empty).

    Raises:
        echotrain.errors.ConfigError: the file is not YAML or not a mapping (names it).
    """
    import yaml

    from echotrain.errors import ConfigError

    path = Path(run_dir) / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--model {str(run_dir)!r}: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model {str(run_dir)!r}: {path} is not a mapping of keys to values")
    return cfg


def generation_settings(model: str | None, decode_loop: str | None = None,
                        sampler: str | None = None) -> tuple[dict[str, str], str | None]:
    """``decode_loop`` and ``sampler`` of an evaluation: each given value (``--decode-loop``,
    ``--sampler``; None = not given), else the run's own when ``model`` names a run directory or
    one of its checkpoints (its ``config.yaml``), else the trainer's defaults
    (:data:`echotrain.runtime.decode.DEFAULT_DECODE_LOOP`, ``DEFAULT_SAMPLER``).

    Returns:
        ``({"decode_loop": ..., "sampler": ...}, config)``: ``config`` is the run's
        ``config.yaml`` path the values not given came from, or None.

    Raises:
        echotrain.errors.ConfigError: the run's ``config.yaml`` is unreadable or holds a
            value outside :data:`~echotrain.runtime.decode.DECODE_LOOPS` / ``SAMPLERS``.
    """
    from echotrain.runtime.decode import DECODE_LOOPS, DEFAULT_DECODE_LOOP, DEFAULT_SAMPLER, SAMPLERS
    from echotrain.errors import ConfigError

    run = run_dir_of(model)
    saved = read_run_config(run) if run is not None else {}
    given = {"decode_loop": decode_loop, "sampler": sampler}
    defaults = {"decode_loop": DEFAULT_DECODE_LOOP, "sampler": DEFAULT_SAMPLER}
    out = {k: given[k] or saved.get(k) or defaults[k] for k in RUN_GENERATION_KEYS}
    for key, valid in (("decode_loop", DECODE_LOOPS), ("sampler", SAMPLERS)):
        if out[key] not in valid:
            raise ConfigError(f"--model {model!r}: its config.yaml has {key}={out[key]!r}; valid: {', '.join(valid)}")
    return out, (run / "config.yaml" if run is not None else None)


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
        elif run_dir_of(model) is not None:
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
        run_cfg = read_run_config(run_dir)
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
