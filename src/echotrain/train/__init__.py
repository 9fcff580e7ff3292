"""echotrain.train: orchestration of RL from verifiable rewards (the math is in echotrain.rl).

- :mod:`~echotrain.train.config`     ``TrainConfig`` (every field documented), parsing, presets, validation, help
- :mod:`~echotrain.train.trainer`    ``Trainer``: rollout -> reward -> advantage -> old log-probs -> update
- :mod:`~echotrain.train.checkpoint` writing atomic checkpoints, keep-last-k, RNG states, resume
- :mod:`~echotrain.train.metrics`    metrics.jsonl / samples.jsonl / eval.jsonl, summary table
- :mod:`~echotrain.train.plots`      PNG curves
- :mod:`~echotrain.train.evaluate`   accuracy and pass@k of a policy on a task
- :mod:`~echotrain.train.commands`   ``echotrain train`` / ``echotrain eval``

What training shares with evaluation (generation, precision, preflight, checkpoint reading,
model loading for eval, ``ConfigError``) is :mod:`echotrain.runtime`.

Heavy imports (transformers, matplotlib) happen inside the functions that need them.
"""

from echotrain.train.config import ConfigError, TrainConfig, resolve_config

__all__ = ["ConfigError", "TrainConfig", "Trainer", "resolve_config"]


def __getattr__(name: str):
    if name == "Trainer":
        from echotrain.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'echotrain.train' has no attribute {name!r}")
