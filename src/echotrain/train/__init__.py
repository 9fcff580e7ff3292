"""echotrain.train: orchestration of RL from verifiable rewards (the math is in echotrain.rl).

- :mod:`~echotrain.train.config`     ``TrainConfig`` (every field documented), presets, validation
- :mod:`~echotrain.train.rollout`    batched generation, response masks, log-probs of response tokens
- :mod:`~echotrain.train.trainer`    ``Trainer``: rollout -> reward -> advantage -> old log-probs -> update
- :mod:`~echotrain.train.checkpoint` atomic checkpoints, keep-last-k, RNG states for exact resume
- :mod:`~echotrain.train.metrics`    metrics.jsonl / samples.jsonl / eval.jsonl, summary table
- :mod:`~echotrain.train.plots`      PNG curves
- :mod:`~echotrain.train.evaluate`   accuracy and unbiased pass@k
- :mod:`~echotrain.train.commands`   ``echotrain train`` / ``echotrain eval``

Heavy imports (transformers, matplotlib) happen inside the functions that need them.
"""

from echotrain.train.config import ConfigError, TrainConfig, resolve_config

__all__ = ["ConfigError", "TrainConfig", "Trainer", "resolve_config"]


def __getattr__(name: str):
    if name == "Trainer":
        from echotrain.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'echotrain.train' has no attribute {name!r}")
