"""Steps 1-2 of a training step: draw prompts, sample completions, score them.

:class:`PromptStream` gives reproducible, resumable prompt draws; :class:`Collector` runs rollout
rounds (one batched ``generate`` per round, this rank's prompt groups under torchrun, gathered
so that every rank holds the whole round) and, with DAPO dynamic sampling (Yu et al. 2025,
arXiv 2503.14476), keeps only groups with mixed correctness and refills up to
``max_sampling_rounds`` rounds.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from echotrain.rl import zero_variance_groups
from echotrain.rl.advantages import ADV_NEEDS_BASELINE
from echotrain.train.config import TrainConfig
from echotrain.train.dist import DistContext
from echotrain.runtime.precision import autocast
from echotrain.runtime.rollout import concat_rollouts, generate_rollouts, generate_rollouts_per_group, group_seed
from echotrain.train.step import StepData


def default_reward_fn(task: Any, reward: str = "") -> Any:
    """``echotrain.rewards.RewardFunction`` of ``task`` (timeouts, format check), scoring with
    the custom reward ``reward`` (a ``module:function`` spec, see :mod:`echotrain.rewards.custom`)
    when given, else with the task's own scorer."""
    from echotrain.rewards import RewardFunction

    if reward:
        from echotrain.rewards.custom import CustomRewardTask, load_reward

        return RewardFunction(CustomRewardTask(task, load_reward(reward)))
    return RewardFunction(task)


class PromptStream:
    """Reproducible prompts with a resumable position: draw ``d`` is ``task.sample(n, seed_d)``
    with ``seed_d`` derived from the run seed and ``d``; the position is the draw counter."""

    def __init__(self, task: Any, seed: int):
        self.task, self.seed, self.draws = task, seed, 0

    def next(self, n: int) -> list[Any]:
        seed = (self.seed * 1_000_003 + 7919 * self.draws + 1) % (2**31 - 1)
        self.draws += 1
        return list(self.task.sample(n, seed))

    def state_dict(self) -> dict[str, int]:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.draws = int(state["draws"])


class Collector:
    """Rollouts and rewards of one step (:meth:`collect`).

    Args:
        cfg: the run's config (sampling settings, ``dynamic_sampling``, ``rollout_rng``).
        model, tokenizer: the policy that samples.
        reward_fn: ``reward_fn(completions, examples) -> (rewards (n,), info)``; ``info`` has
            ``correct`` and optionally ``format_ok``, ``n_timeouts``, ``n_exceptions``.
        prompts: the run's :class:`PromptStream`.
        dist: the data-parallel context (one process: everything local).
        pad_id: the padding token id used when concatenating rounds.
        autocast_dtype: generate under ``torch.autocast`` in this dtype (the run's resolved
            ``autocast`` setting, :mod:`echotrain.runtime.precision`); None: no autocast.
        utilisation: a :class:`~echotrain.train.utilisation.UtilisationMeter` that counts each
            round's prefill FLOPs and decode bytes (None: nothing counted).
    """

    def __init__(self, cfg: TrainConfig, model: Any, tokenizer: Any, reward_fn: Any, prompts: PromptStream,
                 dist: DistContext, pad_id: int, autocast_dtype: torch.dtype | None = None,
                 utilisation: Any = None):
        self.cfg, self.model, self.tokenizer, self.reward_fn = cfg, model, tokenizer, reward_fn
        self.prompts, self.dist, self.pad_id = prompts, dist, pad_id
        self.autocast_dtype, self.utilisation = autocast_dtype, utilisation
        #: env set: multi-turn episodes instead of single completions (train/episodes.py)
        self.episodes = None
        if cfg.env or cfg.tools:
            from echotrain.train.episodes import EpisodeRollouts

            self.episodes = EpisodeRollouts(cfg, model, tokenizer, pad_id)

    def _generate(self, local: list[Any], mine: range, group_offset: int, draw: int, sampling: dict[str, Any]) -> Any:
        """This rank's rollouts of ``local`` (its share ``mine`` of the round's prompt groups)."""
        cfg = self.cfg
        if cfg.rollout_rng == "group":
            return generate_rollouts_per_group(
                self.model, self.tokenizer, [ex.messages for ex in local], cfg.num_generations,
                seeds=[group_seed(cfg.seed, draw, g) for g in mine], group_offset=group_offset + mine.start,
                pad_token_id=self.pad_id, **sampling)
        return generate_rollouts(self.model, self.tokenizer, [ex.messages for ex in local], cfg.num_generations,
                                 group_offset=group_offset + mine.start, **sampling)

    def _decode(self, batch: Any) -> list[str]:
        return [self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for ids, mask in zip(batch.response_ids, batch.response_mask)]

    def _greedy_baselines(self, local: list[Any], sampling: dict[str, Any]) -> tuple[torch.Tensor, float]:
        """ReMax's baselines (Li et al., arXiv 2310.10505): the reward of one greedy rollout of
        each prompt in ``local`` by the sampling weights, repeated over the prompt's G rows
        ``(len(local) * G,)`` float32, and the seconds its generation took (scoring included).
        Greedy decoding draws no random numbers, so the sampled rollouts' stream is unchanged."""
        cfg = self.cfg
        t0 = time.perf_counter()
        greedy = {k: v for k, v in sampling.items() if k not in ("temperature", "top_p", "top_k", "sampler")}
        with autocast(self.model, self.autocast_dtype):
            batch = generate_rollouts(self.model, self.tokenizer, [ex.messages for ex in local], 1, do_sample=False,
                                      record_log_prob=False, **greedy)
        rewards, _ = self.reward_fn(self._decode(batch), list(local))
        return rewards.float().repeat_interleave(cfg.num_generations), time.perf_counter() - t0

    def rollout_round(self, group_offset: int) -> StepData:
        """One round: ``prompts_per_step`` prompts x ``num_generations`` completions, scored.

        Every rank returns the whole round in group order (group ids from ``group_offset``);
        ``reward_timeouts`` / ``reward_exceptions`` count all ranks' completions."""
        cfg = self.cfg
        draw = self.prompts.draws
        examples = self.prompts.next(cfg.prompts_per_step)
        mine = self.dist.shard(len(examples))  # this rank's whole prompt groups (all of them in one process)
        local = [examples[i] for i in mine]
        rows = [ex for ex in examples for _ in range(cfg.num_generations)]
        part = None
        t_gen = t_score = 0.0
        if local:
            t0 = time.perf_counter()
            sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, batch_size=cfg.rollout_batch_size, decode_loop=cfg.decode_loop,
                            sampler=cfg.sampler, decode_linear=cfg.decode_linear)
            with autocast(self.model, self.autocast_dtype):
                if self.episodes is not None:  # the texts scored: each episode's final model turn
                    batch, texts = self.episodes.run(local, mine, group_offset, draw)
                else:
                    batch = self._generate(local, mine, group_offset, draw, sampling)
            t_gen = time.perf_counter() - t0
            if self.utilisation is not None and self.episodes is None:
                from echotrain.train.utilisation import generate_calls

                self.utilisation.generation(batch, generate_calls(len(batch), cfg.num_generations, cfg.rollout_rng,
                                                                  cfg.rollout_batch_size))
            t0 = time.perf_counter()
            if self.episodes is None:
                texts = self._decode(batch)
            local_rows = [ex for ex in local for _ in range(cfg.num_generations)]
            rewards, info = self.reward_fn(texts, local_rows)
            if self.episodes is not None:  # the environment's per-turn shaping, summed per episode
                from echotrain.runtime.episodes import EPISODE_STATS

                rewards = rewards.float() + batch.episode_stats[:, EPISODE_STATS.index("shaping")]
                # samples.jsonl shows the whole episode (model and environment tokens), not only the scored turn
                texts = [self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
                         for ids, mask in zip(batch.response_ids, batch.attended_mask)]
            t_score = time.perf_counter() - t0
            base = None
            if cfg.adv_estimator in ADV_NEEDS_BASELINE:
                base, t_base = self._greedy_baselines(local, sampling)
                t_gen += t_base
            part = (batch, texts, rewards.float(), {k: info[k] for k in ("correct", "format_ok") if k in info},
                    (int(info.get("n_timeouts", 0)), int(info.get("n_exceptions", 0))), base)
        # every rank gets the whole round (as one process would have it): rank order = group order
        parts = [p for p in self.dist.gather(part) if p is not None] if self.dist.enabled else [part]
        info = {k: torch.cat([torch.as_tensor(p[3][k]) for p in parts]) for k in parts[0][3]}
        correct = torch.as_tensor(info["correct"], dtype=torch.float32)
        fmt = torch.as_tensor(info.get("format_ok", torch.zeros(len(rows), dtype=torch.bool)), dtype=torch.bool)
        baselines = torch.cat([p[5] for p in parts]) if parts[0][5] is not None else None
        return StepData(batch=concat_rollouts([p[0] for p in parts], self.pad_id), rewards=torch.cat([p[2] for p in parts]),
                        reward_baselines=baselines,
                        correct=correct, format_ok=fmt, examples=rows, texts=[t for p in parts for t in p[1]],
                        time_generation=t_gen, time_scoring=t_score,
                        reward_timeouts=sum(p[4][0] for p in parts), reward_exceptions=sum(p[4][1] for p in parts))

    def collect(self) -> StepData:
        """Rollouts and rewards for one step, with DAPO dynamic sampling if enabled.

        Returns the kept sequences (whole groups, at most ``prompts_per_step`` of them; all of
        the last round's if no round had an informative group) with dense group ids, the
        number of rounds, the zero-variance share and the round totals of time and reward
        failures."""
        cfg = self.cfg
        kept_parts, rounds, n_seen, n_zero, kept_groups = [], 0, 0, 0, 0
        t_gen = t_score = 0.0
        n_timeouts = n_exceptions = 0
        while True:
            part = self.rollout_round(group_offset=rounds * cfg.prompts_per_step)
            rounds += 1
            t_gen, t_score = t_gen + part.time_generation, t_score + part.time_scoring
            n_timeouts, n_exceptions = n_timeouts + part.reward_timeouts, n_exceptions + part.reward_exceptions
            keep = torch.ones(len(part), dtype=torch.bool)
            zv = zero_variance_groups(part.correct, part.batch.group_index)
            n_seen += cfg.prompts_per_step
            n_zero += int(zv.view(-1, cfg.num_generations)[:, 0].sum())
            if cfg.dynamic_sampling:
                keep = ~zv
                room = (cfg.prompts_per_step - kept_groups) * cfg.num_generations
                keep &= torch.cumsum(keep.long(), 0) <= room
            idx = keep.nonzero().squeeze(-1)
            if len(idx):
                kept_parts.append(part.select(idx))
                kept_groups += len(idx) // cfg.num_generations
            if not cfg.dynamic_sampling or kept_groups >= cfg.prompts_per_step or rounds >= cfg.max_sampling_rounds:
                break
        if not kept_parts:  # nothing informative after max_sampling_rounds: keep the last round (A = 0)
            kept_parts.append(part)
        data = StepData.concat(kept_parts, self.pad_id)
        data.rounds, data.zero_variance_frac = rounds, n_zero / max(1, n_seen)
        data.time_generation, data.time_scoring = t_gen, t_score
        data.reward_timeouts, data.reward_exceptions = n_timeouts, n_exceptions
        return data
