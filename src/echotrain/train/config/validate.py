"""Checking a :class:`~echotrain.train.config.schema.TrainConfig` before any work: each field's
choices and check, the registries' names (losses, aggregations, estimators, KL estimators,
optimizers, presets), ranges, settings that only work together, and settings under which a run
could learn nothing. Every problem is a :class:`ConfigError` naming the key, the value and the
valid choices or range (the CLI prints it as one line, exit 2).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from echotrain.errors import ConfigError
from echotrain.train.config.schema import BALANCED_SUFFIX

if TYPE_CHECKING:
    from echotrain.train.config.schema import TrainConfig


def preset_names() -> list[str]:
    """Valid values of ``preset``: the names in :data:`echotrain.rl.PRESETS` and each with '+balanced'."""
    from echotrain.rl import PRESETS

    names = sorted(PRESETS)
    return names + [n + BALANCED_SUFFIX for n in names]


def unknown_value_msg(key: str, value: str, valid: list[str]) -> str:
    """``"<key>=<value> is not valid (did you mean ...?); valid: ..."``, the close matches by edit distance."""
    close = difflib.get_close_matches(str(value), valid, n=3)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    return f"{key}={value!r} is not valid{hint}; valid: {', '.join(valid)}"


def registry_choices() -> dict[str, tuple[str, ...]]:
    """Keys whose valid values are the names in an :mod:`echotrain.rl` registry, read at call time."""
    import echotrain.rl as rl

    return {"adv_estimator": tuple(rl.ADV_METHODS), "loss_mode": tuple(rl.POLICY_LOSSES),
            "loss_agg_mode": tuple(rl.AGG_MODES), "kl_penalty": tuple(rl.KL_ESTIMATORS)}


def validate(cfg: TrainConfig) -> None:
    """Check every value of ``cfg`` before any work.

    Raises:
        ConfigError: naming the key, the bad value and the valid choices or range.
    """
    from echotrain.optim.registry import OPTIMIZERS, base_optimizer_names
    from echotrain.rl import AGG_MODES, POLICY_LOSSES

    for f in fields(cfg):
        choices = f.metadata.get("choices")
        v = getattr(cfg, f.name)
        if choices and v not in choices:
            raise ConfigError(unknown_value_msg(f.name, v, list(choices)))
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{f.name}={v!r} must be finite")
        problem = f.metadata["check"](v) if f.metadata.get("check") else None  # PolicyLossConfig's checks
        if problem:
            raise ConfigError(f"{f.name}={v!r}: {problem}")
    from echotrain.rl.config import cross_field_problem

    problem = cross_field_problem(cfg)  # between PolicyLossConfig settings (e.g. thresholds in the wrong order)
    if problem:
        raise ConfigError(problem)
    for key, names in registry_choices().items():
        if getattr(cfg, key) not in names:
            raise ConfigError(unknown_value_msg(key, getattr(cfg, key), list(names)))
    if cfg.preset not in preset_names():
        raise ConfigError(unknown_value_msg("preset", cfg.preset, preset_names()))
    if cfg.loss_mode not in POLICY_LOSSES:
        raise ConfigError(unknown_value_msg("loss_mode", cfg.loss_mode, sorted(POLICY_LOSSES)))
    if cfg.loss_agg_mode not in AGG_MODES:
        raise ConfigError(unknown_value_msg("loss_agg_mode", cfg.loss_agg_mode, list(AGG_MODES)))
    from echotrain.rl.config import LOSS_SETTINGS

    for key in cfg.loss_options:  # declared (checked above); by the loss in use?
        if key in type(cfg).policy_loss_keys:
            raise ConfigError(f"loss_options.{key}: {key} is a trainer key of its own; set {key}="
                              f"{cfg.loss_options[key]!r}")
        owner = LOSS_SETTINGS.info(key)["loss_mode"]
        if owner != cfg.loss_mode:
            raise ConfigError(f"loss_options.{key} is a setting of loss_mode={owner!r}, not of "
                              f"loss_mode={cfg.loss_mode!r}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(unknown_value_msg("optimizer", cfg.optimizer, sorted(OPTIMIZERS)))
    sam_bases = base_optimizer_names()
    if cfg.sam_base not in sam_bases:
        raise ConfigError(unknown_value_msg("sam_base", cfg.sam_base, sam_bases))

    def need(cond: bool, key: str, what: str) -> None:
        if not cond:
            raise ConfigError(f"{key}={getattr(cfg, key)!r}: {what}")

    for key in ("steps", "prompts_per_step", "num_generations", "max_new_tokens", "num_mini_batches", "ppo_epochs",
                "micro_batch_size", "max_sampling_rounds"):
        need(getattr(cfg, key) >= 1, key, "must be >= 1")
    for key in ("num_threads", "rollout_batch_size", "staleness", "warmup_steps", "eval_prompts", "eval_every", "save_every",
                "log_samples", "top_k", "no_signal_steps"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0")
    need(cfg.keep_last >= 1, "keep_last", "must be >= 1")
    need(cfg.max_staleness >= 1, "max_staleness", "must be >= 1 (the worker is always at least one step behind)")
    need(cfg.async_timeout_s > 0, "async_timeout_s", "must be > 0 seconds")
    for key in ("rollout_threads", "learner_threads"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0 (0 = split the run's threads)")
    need(not (cfg.async_rollouts and cfg.staleness), "staleness",
         "fixed lag and async_rollouts=true are two modes: set staleness=0 with async_rollouts (its lag is max_staleness)")
    need(not cfg.async_rollouts or cfg.device in ("cpu", "auto"), "device",
         "async_rollouts=true runs on the CPU only (the GPU weight copy is not built)")
    from echotrain.rl.correction_names import parse_rollout_correction

    need(cfg.recompute_old_log_prob or not parse_rollout_correction(cfg.rollout_correction), "recompute_old_log_prob",
         f"false (old_log_prob = rollout_log_prob) makes rollout_correction={cfg.rollout_correction!r} a no-op "
         "(its ratio pi_old / mu is 1): recompute, or drop the correction")
    need(cfg.num_mini_batches <= cfg.prompts_per_step, "num_mini_batches",
         f"must be <= prompts_per_step={cfg.prompts_per_step} (mini-batches hold whole groups)")
    need(cfg.temperature > 0, "temperature", "must be > 0 (RL needs sampling)")
    need(cfg.eval_temperature >= 0, "eval_temperature", "must be >= 0 (0 = greedy)")
    need(cfg.eval_n >= 1, "eval_n", "must be >= 1")
    need(cfg.eval_n == 1 or cfg.eval_temperature > 0, "eval_n",
         "> 1 needs eval_temperature > 0 (greedy samples of a prompt are all the same)")
    need(0.0 < cfg.eval_top_p <= 1.0, "eval_top_p", "must be in (0, 1]")
    need(cfg.best_metric != "eval/pass@n" or cfg.eval_n > 1, "best_metric", "eval/pass@n needs eval_n > 1")
    need(cfg.early_stop_patience >= 0, "early_stop_patience", "must be >= 0 (0 = off)")
    need(not cfg.early_stop_patience or (cfg.eval_every > 0 and cfg.eval_prompts > 0), "early_stop_patience",
         "needs evaluations during the run: eval_every > 0 and eval_prompts > 0")
    need(not cfg.keep_best or cfg.eval_prompts > 0, "keep_best", "needs eval_prompts > 0")
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    from echotrain.runtime.preflight import model_task_mismatch

    mismatch = model_task_mismatch(cfg.model, cfg.task, model_label=f"model={cfg.model}", task_label=f"task={cfg.task}")
    need(mismatch is None, "task", mismatch or "")
    _check_env(cfg, need)
    need(cfg.kl_coef >= 0, "kl_coef", "must be >= 0")
    need(0.0 <= cfg.gamma <= 1.0, "gamma", "must be in [0, 1]")
    need(not (cfg.entropy_coeff and (cfg.entropy_coef or cfg.use_adaptive_entropy)), "entropy_coeff",
         "not together with entropy_coef / use_adaptive_entropy (verl's and TRL's bonus differ only in aggregation: "
         "choose one)")
    need(cfg.entropy_coef_min <= cfg.entropy_coef_max, "entropy_coef_min", "must be <= entropy_coef_max")
    need(cfg.entropy_coef_delta >= 0, "entropy_coef_delta", "must be >= 0")
    need(0.0 <= cfg.top_entropy_quantile <= 1.0, "top_entropy_quantile", "must be in [0, 1]")
    need(cfg.distill_coeff >= 0, "distill_coeff", "must be >= 0")
    need(0.0 <= cfg.distill_beta <= 1.0, "distill_beta", "must be in [0, 1] (TRL's beta)")
    need(cfg.distill_top_k >= 0, "distill_top_k", "must be >= 0 (0 = the full vocabulary)")
    need(cfg.objective != "distill" or bool(cfg.teacher), "objective",
         "objective=distill needs teacher=<model id, path or run directory>")
    need(not (cfg.distill_coeff > 0 and not cfg.teacher), "distill_coeff", "> 0 needs teacher=<model id, path or run "
         "directory>")
    need(not (cfg.teacher and cfg.objective == "rl" and cfg.distill_coeff == 0), "teacher",
         "is set but unused: set distill_coeff > 0 (a term added to the RL loss) or objective=distill")
    need(not (cfg.objective == "distill" and cfg.loss_agg_mode == "balanced"), "loss_agg_mode",
         "balanced weights each token by its advantage's sign group, and objective=distill has advantages 0, so the "
         "distillation term would weigh 0; use token-mean (or another loss_agg_mode)")
    need(not (cfg.teacher and cfg.async_rollouts), "teacher", "not with async_rollouts yet (the teacher pass runs "
         "in the learner's process)")
    need(-1 <= cfg.overlong_buffer_len < cfg.max_new_tokens, "overlong_buffer_len",
         f"must be -1 (auto), 0 (off) or in [1, max_new_tokens={cfg.max_new_tokens})")
    need(cfg.lr > 0, "lr", "must be > 0")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(0 <= cfg.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
    need(0 <= cfg.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
    need(cfg.adam_eps > 0, "adam_eps", "must be > 0")
    need(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")
    need(cfg.sam_rho >= 0, "sam_rho", "must be >= 0")
    need(0 <= cfg.sam_start <= 1, "sam_start", "must be a fraction of the run's optimizer updates in [0, 1]")
    need(cfg.lora_r >= 0, "lora_r", "must be >= 0 (0 = full fine-tuning)")
    need(cfg.lora_alpha > 0, "lora_alpha", "must be > 0")
    need(cfg.lora_dropout == 0, "lora_dropout", "must be 0: the trainer runs the policy without dropout (the old "
         "log-probs, ECHO's pre-pass and the with-grad pass must be the same function)")
    if cfg.lora_r > 0:
        from echotrain.runtime.lora import parse_target_modules

        try:
            parse_target_modules(cfg.lora_target_modules)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError("lora_r > 0 needs the peft package: pip install 'echotrain[lora]'")
    from echotrain.train.sinks import check_available, parse_report_to

    try:
        check_available(parse_report_to(cfg.report_to))
    except (ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    need(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda") or cfg.device == "mps",
         "device", "valid: auto, cpu, cuda, cuda:N, mps")
    if cfg.objective != "distill":  # distillation learns from the teacher, not from advantages
        _check_learning_signal(cfg)


def _check_env(cfg: TrainConfig, need: Any) -> None:
    """The multi-turn keys (env, env_options, tools, max_turns, max_episode_tokens): ``tools``
    implies ``env=tools``; the environment is built once with its options (bad ones fail here)."""
    env = cfg.env or ("tools" if cfg.tools else None)
    need(cfg.max_turns >= 1, "max_turns", "must be >= 1")
    need(cfg.max_episode_tokens >= 0, "max_episode_tokens", "must be >= 0 (0 = 2 x max_turns x max_new_tokens)")
    need(cfg.sft_steps >= 0, "sft_steps", "must be >= 0 (0 = no warm-up)")
    need(cfg.sft_batch_size >= 1, "sft_batch_size", "must be >= 1")
    need(cfg.sft_lr > 0, "sft_lr", "must be > 0")
    # (the file itself is read by echotrain train's preflight: a resumed run without a KL reference needs it not)
    need(not cfg.sft_data or cfg.sft_steps >= 1, "sft_data", "is set but sft_steps=0: set sft_steps=N (the warm-up's steps)")
    if not env:
        need(not cfg.env_options, "env_options", "is set but env is not: name the environment (env=<name>)")
        need(not cfg.sft_steps or bool(cfg.sft_data), "sft_steps",
             "warms up on an environment's demonstrations or a file's: set env=<name> or sft_data=<file.jsonl> too")
        return
    from echotrain.envs import ENVIRONMENTS, env_names
    from echotrain.rl.advantages import ADV_NEEDS_BASELINE

    if env not in ENVIRONMENTS:
        raise ConfigError(unknown_value_msg("env", env, env_names()))
    need(not cfg.tools or env == "tools", "tools", f"takes env=tools (or no env), not env={env!r}")
    need(env != "tools" or bool(cfg.tools), "env", "env=tools needs tools=[module:function,...]")
    need(not cfg.async_rollouts, "async_rollouts",
         "true is not supported with env (multi-turn episodes): use staleness=k for off-policy episodes")
    need(cfg.adv_estimator not in ADV_NEEDS_BASELINE, "adv_estimator",
         f"{cfg.adv_estimator!r} rolls out one greedy single-turn response per prompt as its baseline, which is not an "
         "episode of this environment: choose another estimator with env")
    need(cfg.overlong_buffer == 0, "overlong_buffer_len",
         "DAPO's overlong penalty counts one response's tokens against max_new_tokens, which an episode of "
         "several turns does not have: set overlong_buffer_len=0 with env")
    need(not cfg.max_episode_tokens or cfg.max_episode_tokens >= cfg.max_new_tokens, "max_episode_tokens",
         f"must be 0 or >= max_new_tokens={cfg.max_new_tokens} (one whole model turn)")
    from echotrain.models.testbed import TESTBED_CONFIGS

    if cfg.model in TESTBED_CONFIGS:
        need(bool(ENVIRONMENTS.info(env).get("for_testbed")), "env",
             f"model={cfg.model} speaks plain byte-level text: use an environment registered for_testbed")
    from echotrain.train.episodes import env_factory_of

    try:
        make_env = env_factory_of(cfg)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env={env!r}: {exc}") from None
    need(not cfg.sft_steps or bool(cfg.sft_data) or callable(getattr(make_env(), "demonstration", None)), "sft_steps",
         f"env={env!r} demonstrates no worked episode to warm up on (no demonstration(example, answer) method; "
         "docs/design/environments.md): use sft_steps=0, or give demonstrations with sft_data=<file.jsonl>")


def _check_learning_signal(cfg: TrainConfig) -> None:
    """Refuse settings under which every advantage, hence every policy-gradient term, is exactly 0.

    - ``num_generations=1`` with an estimator that centres rewards within each prompt's group
      (probed on groups of one, so a new estimator is covered by its own behaviour): a group of
      one response always has advantage 0. Every group-baseline estimator is refused (``batch_std``
      is Lite PPO's group mean with the batch std, arXiv 2508.08221); ``remax`` (a greedy
      rollout's baseline) and ``reinforce_plus_plus`` (batch whitening, no groups) learn from
      G = 1 and pass.
    - ``top_k=1``: greedy sampling makes the G responses of a prompt identical, so every group
      has zero reward variance and advantage 0 (the KL term, if any, is 0 with 0 gradient at the
      reference too).

    Raises:
        ConfigError: naming the key, the value and why.
    """
    import torch

    from echotrain.rl import compute_token_advantages

    if cfg.num_generations == 1:
        probe, _ = compute_token_advantages(torch.tensor([0.0, 1.0, 3.0]), torch.arange(3), torch.ones(3, 2),
                                            adv_estimator=cfg.adv_estimator, reward_baselines=torch.zeros(3),
                                            old_log_prob=torch.full((3, 2), -1.0), sum_pi_squared=torch.full((3, 2), 0.5))
        if not probe.any():
            raise ConfigError(
                f"num_generations=1: adv_estimator={cfg.adv_estimator!r} centres rewards within each prompt's group, "
                "so a group of one response has advantage exactly 0 and the run would train nothing; use "
                "num_generations >= 2"
            )
    if cfg.top_k == 1:
        raise ConfigError(
            "top_k=1: greedy rollouts make the num_generations responses of a prompt identical, so every group has "
            "zero reward variance and every advantage is exactly 0 (nothing to learn); use top_k=0 (off) or >= 2"
        )
