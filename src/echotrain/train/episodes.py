"""The trainer's multi-turn path (``env=``): episodes instead of single completions, and their metrics.

:class:`EpisodeRollouts` is what :class:`~echotrain.train.collect.Collector` calls in place of
``generate_rollouts`` when ``env`` is set: it builds the environment factory from ``env`` /
``env_options`` / ``tools`` (:mod:`echotrain.envs`), plays the episodes
(:func:`echotrain.runtime.episodes.run_episodes`; with ``rollout_rng=group`` each prompt group
under its own seed, as single-turn rollouts) and returns the batch with the texts the reward
scores (the final model turn of each episode). :func:`episode_metrics` gives the step's
``episode/*`` metrics from ``RolloutBatch.episode_stats``.
"""

from __future__ import annotations

from typing import Any

import torch

from echotrain.runtime.cpu_linear import linear_backend
from echotrain.runtime.device import rng_devices

from echotrain.metrics import Metric, declare_metric
from echotrain.runtime.episodes import EPISODE_STATS, run_episodes
from echotrain.runtime.rollout import RolloutBatch, concat_rollouts, group_seed

__all__ = ["EPISODE_METRICS", "EpisodeRollouts", "episode_budget", "episode_metrics", "env_factory_of",
           "episodes_of_run"]

_WHEN = "env is set (multi-turn episodes)"
#: The ``episode/*`` metrics (every step of a run with ``env``), declared in the metric schema.
EPISODE_METRICS: dict[str, Metric] = {m.name: m for m in (
    declare_metric("episode/turns", reduce="step", unit="model turns per episode", when=_WHEN,
                   panel="Episodes", label="turns per episode", help="model turns per episode (mean over the step's episodes)"),
    declare_metric("episode/tool_calls", reduce="step", unit="calls per episode", when=_WHEN, panel="Episodes",
                   label="tool calls per episode", help="tool calls per episode, malformed ones included (mean)"),
    declare_metric("episode/tool_errors", reduce="step", unit="calls per episode", when=_WHEN, panel="Episodes",
                   label="tool errors per episode",
                   help="failed tool calls per episode: malformed, unknown tool, bad arguments, raised, timed out, "
                        "too much output; an env=verifiers environment that raised (mean)"),
    declare_metric("episode/env_tokens", reduce="step", unit="tokens per episode", when=_WHEN,
                   help="environment tokens per episode (response_mask 0 inside the trajectory) (mean)"),
    declare_metric("episode/model_tokens", reduce="step", unit="tokens per episode", when=_WHEN,
                   help="model tokens per episode (the trained ones) (mean)"),
    declare_metric("episode/env_token_frac", reduce="step", unit="fraction of tokens", when=_WHEN,
                   help="environment tokens / (environment + model tokens) over the step's episodes"),
    declare_metric("episode/cut_by_tokens", reduce="step", unit="fraction of episodes", when=_WHEN,
                   help="episodes cut by the token budget (max_new_tokens per turn or max_episode_tokens)"),
    declare_metric("episode/cut_by_turns", reduce="step", unit="fraction of episodes", when=_WHEN,
                   help="episodes that reached max_turns with a tool call in their last turn (no final answer)"),
    declare_metric("episode/shaping", reduce="step", unit="reward per episode", when=_WHEN,
                   help="the environment's per-turn shaping rewards summed per episode (mean; added to the reward)"),
)}


def episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The ``episode/*`` metrics of a step's batch (``{}`` without ``episode_stats``)."""
    s = batch.episode_stats
    if s is None or not len(s):
        return {}
    col = {k: s[:, i] for i, k in enumerate(EPISODE_STATS)}
    out = {f"episode/{k}": float(col[k].mean()) for k in EPISODE_STATS}
    total = float(col["env_tokens"].sum() + col["model_tokens"].sum())
    out["episode/env_token_frac"] = float(col["env_tokens"].sum()) / total if total else 0.0
    return out


def env_factory_of(cfg: Any) -> Any:
    """The zero-argument environment factory of ``cfg`` (``env``, ``env_options``, ``tools``;
    ``tools`` without ``env`` is ``env=tools``).

    Raises:
        ValueError / TypeError: unknown env or options it rejects (the validation turns them
            into a ConfigError).
    """
    from echotrain.envs import get_env_factory

    options = dict(cfg.env_options)
    if cfg.tools:
        options["tools"] = list(cfg.tools)
    return get_env_factory(cfg.env or "tools", **options)


def episode_budget(max_episode_tokens: int, max_turns: int, max_new_tokens: int) -> int:
    """The ids an episode may hold after its prompt: ``max_episode_tokens``, or ``2 * max_turns *
    max_new_tokens`` when it is 0 (model turns and as many environment tokens)."""
    return int(max_episode_tokens) or 2 * int(max_turns) * int(max_new_tokens)


def episodes_of_run(run_cfg: dict[str, Any], max_new_tokens: int) -> dict[str, Any] | None:
    """The ``episodes`` of :func:`~echotrain.train.evaluate.evaluate` for a finished run's
    ``config.yaml`` values (``echotrain eval`` of a run directory evaluates as the run did): its
    environment, ``max_turns`` and episode budget; None when the run had no ``env`` / ``tools``.

    Raises:
        ValueError / TypeError: the run's environment cannot be built here (an unknown env, a
            plugin that is not importable).
    """
    from types import SimpleNamespace

    if not (run_cfg.get("env") or run_cfg.get("tools")):
        return None
    cfg = SimpleNamespace(env=run_cfg.get("env"), env_options=run_cfg.get("env_options") or {},
                          tools=run_cfg.get("tools") or [])
    max_turns = int(run_cfg.get("max_turns") or 4)
    return dict(make_env=env_factory_of(cfg), max_turns=max_turns,
                max_episode_tokens=episode_budget(run_cfg.get("max_episode_tokens") or 0, max_turns, max_new_tokens))


class EpisodeRollouts:
    """Plays one round's episodes for the :class:`~echotrain.train.collect.Collector`.

    Args:
        cfg: the run's config (``env``, ``max_turns``, ``max_episode_tokens``, sampling, ``rollout_rng``).
        model, tokenizer: the policy.
        pad_id: padding of concatenated groups.
    """

    def __init__(self, cfg: Any, model: Any, tokenizer: Any, pad_id: int):
        self.cfg, self.model, self.tokenizer, self.pad_id = cfg, model, tokenizer, pad_id
        self.make_env = env_factory_of(cfg)

    def budget(self) -> int:
        """``max_episode_tokens``, or ``max_turns * max_new_tokens * 2`` when 0 (model turns and as
        many environment tokens)."""
        cfg = self.cfg
        return episode_budget(cfg.max_episode_tokens, cfg.max_turns, cfg.max_new_tokens)

    def eval_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~echotrain.train.evaluate.evaluate`'s ``episodes``: the
        held-out evaluation plays episodes with the run's environment, turn limit and budget."""
        return dict(make_env=self.make_env, max_turns=self.cfg.max_turns, max_episode_tokens=self.budget())

    def run(self, examples: list[Any], mine: range, group_offset: int, draw: int) -> tuple[RolloutBatch, list[str]]:
        """Episodes of ``examples`` (this rank's groups ``mine``): the batch and the final turns' texts."""
        cfg = self.cfg
        kw = dict(max_new_tokens=cfg.max_new_tokens, max_turns=cfg.max_turns, max_episode_tokens=self.budget(),
                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, decode_loop=cfg.decode_loop,
                  sampler=cfg.sampler, decode_linear=cfg.decode_linear)
        if cfg.rollout_rng != "group":
            res = run_episodes(self.model, self.tokenizer, examples, cfg.num_generations, self.make_env,
                               group_offset=group_offset + mine.start, **kw)
            return res.batch, res.final_texts
        devices = rng_devices(next(self.model.parameters()).device)  # the CUDA generator forked too
        parts, texts = [], []
        with linear_backend(self.model, cfg.decode_linear):  # one context for every group: weights packed once
            for k, (ex, g) in enumerate(zip(examples, mine)):
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(group_seed(cfg.seed, draw, g))
                    res = run_episodes(self.model, self.tokenizer, [ex], cfg.num_generations, self.make_env,
                                       group_offset=group_offset + mine.start + k, **kw)
                parts.append(res.batch)
                texts += res.final_texts
        return concat_rollouts(parts, self.pad_id), texts
