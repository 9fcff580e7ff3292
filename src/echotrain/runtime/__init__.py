"""echotrain.runtime: what training and evaluation both need, apart from the RL step.

``echotrain train`` (:mod:`echotrain.train`, the orchestration of the RL step) and ``echotrain
eval`` (:mod:`echotrain.train.commands` for ``--task``, :mod:`echotrain.evalsuite` for suites) run
a policy the same way; that shared part lives here, one job per module:

- :mod:`~echotrain.runtime.preflight`      checks of settings, devices, threads, paths before a model loads
- :mod:`~echotrain.runtime.precision`      the ``autocast`` setting: resolution per device, the context
- :mod:`~echotrain.runtime.rollout`        batched generation, response masks, log-probs of response tokens
- :mod:`~echotrain.runtime.lora`           LoRA adapters through peft (wrap, adapter state, merge, save)
- :mod:`~echotrain.runtime.chat_template`  reading a ``chat_template`` override
- :mod:`~echotrain.runtime.checkpoints`    reading checkpoint files (find, validate, load); writing is train's
- :mod:`~echotrain.runtime.loading`        a policy for evaluation from a model, run directory or checkpoint
- :mod:`~echotrain.runtime.sampling_stats` unbiased pass@k and the greedy-samples check of evaluation

Nothing here imports :mod:`echotrain.train`, :mod:`echotrain.evalsuite` or :mod:`echotrain.cli`
(tests/test_import_graph.py); ``ConfigError`` (a bad setting, the CLI's exit 2) is
:mod:`echotrain.errors`, on the ground floor. Heavy imports (transformers, peft) happen inside the functions.
"""
