"""echotrain.integrations: thin adapters that put echotrain's objectives into other frameworks.

They import the math (:mod:`echotrain.rl`), never the trainer, and each imports its framework
only when imported itself (both frameworks are optional):

- :mod:`echotrain.integrations.trl`  ``EchoGRPOTrainer`` / ``EchoGRPOConfig``: TRL's
  ``GRPOTrainer`` with :func:`echotrain.rl.compute_policy_loss` as its loss, exact over
  gradient-accumulation micro-batches (step statistics from :mod:`echotrain.rl.stepwise`).
- :mod:`echotrain.integrations.verl` ``register_with_verl()``: echotrain's policy losses
  (``echotrain_vanilla``, ``echotrain_gspo``, ``echotrain_gspo_token``, ``echotrain_echo``) and a
  Balanced-Aggregation advantage estimator (``echotrain_grpo_balanced``) in verl's registries;
  :mod:`echotrain.integrations.verl_plugin` does it on import (``VERL_USE_EXTERNAL_MODULES``).
"""
