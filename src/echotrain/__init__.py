"""echotrain: stable, low-memory RL from verifiable rewards.

Layers (a module imports only from its own layer or below):

* ``echotrain.rl``       pure tensor math of RL objectives (advantages, losses, aggregation, KL,
                         shaping, exact micro-batch statistics).
* ``echotrain.optim``    optimizers by name (AdamW with 4-bit states, SAM, late-phase SAM), LR
                         schedules, Hessian eigenvalue / trace / SAM sharpness
                         (``echotrain.optim.sharpness``).
* ``echotrain.models``   model loading (Hugging Face, the embedded GGUF default) and our own
                         models (the looped transformer).
* ``echotrain.tasks`` / ``echotrain.rewards``  prompts, answers and verifiable rewards.
* ``echotrain.train``    orchestration: rollout, the RL trainer, checkpoints, metrics, plots.
* ``echotrain.experiments`` reproductions of each method's central claim.
* ``echotrain.integrations`` thin adapters for TRL and verl.
* ``echotrain.cli``      the ``echotrain`` command.
"""

__version__ = "0.1.0"
