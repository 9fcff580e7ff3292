"""verl's advantage estimators in the trainer: every registered one trains from the CLI, and
ReMax's greedy baselines are generated with the rollouts, without touching the sampling stream."""

from __future__ import annotations

import json

import pytest
import torch

from echotrain.cli import main
from echotrain.rl import ADV_METHODS
from echotrain.runtime.rollout import generate_rollouts

_TINY = ["model=testbed", "task=testbed", "steps=2", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=0", "num_threads=1", "save_every=0",
         "save_final_model=false", "plots=false", "progress=false", "log_samples=0"]
BASE = dict(steps=1, prompts_per_step=3, num_generations=2, max_new_tokens=6, micro_batch_size=6, eval_prompts=0,
            num_threads=1, save_every=0, save_final_model=False, plots=False, progress=False, log_samples=0)


@pytest.mark.usefixtures("real_testbed")
@pytest.mark.parametrize("adv", ADV_METHODS)
def test_every_estimator_trains_from_the_cli(adv, tmp_path):
    assert main(["train", *_TINY, f"adv_estimator={adv}", "gamma=0.9", f"output_dir={tmp_path}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["optimizer_steps"] == 1 for r in records)


def test_gamma_outside_the_unit_interval_is_refused():
    assert main(["train", *_TINY, "adv_estimator=reinforce_plus_plus", "gamma=1.5", "--print-config"]) == 2


def test_remax_baseline_is_the_greedy_rollouts_reward(build_trainer):
    trainer = build_trainer(BASE, adv_estimator="remax")
    data = trainer.collector.collect()
    assert data.reward_baselines is not None and data.reward_baselines.shape == data.rewards.shape
    # the baseline of each group: the reward of the greedy completion of its prompt
    prompts = [ex for ex in data.examples[::2]]
    greedy = generate_rollouts(trainer.model, trainer.tokenizer, [ex.messages for ex in prompts], 1, do_sample=False,
                               record_log_prob=False, max_new_tokens=BASE["max_new_tokens"])
    texts = [trainer.tokenizer.decode(i[m.bool()], skip_special_tokens=True)
             for i, m in zip(greedy.response_ids, greedy.response_mask)]
    expected = torch.tensor([float(trainer.task.score(t, ex)) for t, ex in zip(texts, prompts)])
    assert data.reward_baselines.tolist() == expected.repeat_interleave(2).tolist()
    # greedy decoding draws nothing from the RNG: the next round samples what it would have
    state = torch.get_rng_state()
    trainer.collector._greedy_baselines(prompts, dict(max_new_tokens=6, batch_size=0, decode_loop="echotrain"))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("adv", ["remax", "reinforce_plus_plus"])
def test_the_step_trains_on_the_estimators_advantages(build_trainer, adv):
    trainer = build_trainer(BASE, adv_estimator=adv, gamma=0.5, prompts_per_step=8, num_generations=4, max_new_tokens=8,
                            micro_batch_size=32)
    seen = []
    rollouts_for = trainer.rollouts.rollouts_for
    trainer.rollouts.rollouts_for = lambda step: seen.append(rollouts_for(step)) or seen[-1]
    trainer.train()
    (d,) = seen
    assert d.advantages.abs().sum() > 0  # not a trivial step
    if adv == "remax":
        assert torch.equal(d.seq_advantages, d.rewards - d.reward_baselines)
        torch.testing.assert_close(d.advantages, d.seq_advantages[:, None] * d.response_mask)
    else:  # token-level: discounted returns whitened over the step's valid tokens
        m = d.response_mask.double()
        after = m.flip(-1).cumsum(-1).flip(-1) - m
        ret = d.rewards.double()[:, None] * 0.5**after * m
        mean = (ret * m).sum() / m.sum()
        var = ((ret - mean) ** 2 * m).sum() / (m.sum() - 1)
        torch.testing.assert_close(d.advantages, ((ret - mean) / torch.sqrt(var + 1e-8) * m).float())
    # estimators without a baseline roll out no greedy response
    assert build_trainer(BASE, name="grpo").collector.collect().reward_baselines is None


@pytest.mark.parametrize("adv", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("from_sampler", [True, False], ids=["sampler", "pass"])
def test_optimal_token_baselines_read_the_step_start_policy(build_trainer, adv, from_sampler):
    """log pi of the sampled tokens (= the recomputed old_log_prob of the same weights) and
    sum_v pi(v)^2 (= a plain, unpacked forward of the weights before the update), from the sampler's
    own numbers (synchronous float32: no pass) or from the trainer's one no-grad pass
    (``reuse_sampler_log_probs=false``), and the step trains on the estimator's advantages of
    exactly those."""
    import copy

    from echotrain.rl import compute_token_advantages
    from echotrain.runtime.rollout import response_log_softmax

    trainer = build_trainer(BASE, adv_estimator=adv, prompts_per_step=4, num_generations=4, max_new_tokens=8,
                            micro_batch_size=5,  # micro-batches of 5 rows: the pass runs in 4 pieces
                            reuse_sampler_log_probs=from_sampler)
    assert trainer.sampler_is_learner is from_sampler
    before = copy.deepcopy(trainer.model)
    seen, stats = [], []
    rollouts_for, pi_stats = trainer.rollouts.rollouts_for, trainer._pi_stats
    trainer.rollouts.rollouts_for = lambda step: seen.append(rollouts_for(step)) or seen[-1]
    trainer._pi_stats = lambda batch: stats.append(pi_stats(batch)) or stats[-1]
    trainer.train()
    (d,), ((lp, s2),) = seen, stats
    m = d.response_mask.bool()
    b = d.batch
    assert (lp is b.rollout_log_prob and s2 is b.rollout_sum_pi_squared) is from_sampler
    torch.testing.assert_close(lp[m], d.old_log_prob[m], rtol=0, atol=2e-5)
    with torch.no_grad():
        ls = response_log_softmax(before, b.prompt_ids, b.prompt_mask, b.response_ids, b.attended_mask,
                                  temperature=trainer.cfg.temperature, pack=False)
    torch.testing.assert_close(s2[m], ls.exp().pow(2).sum(-1)[m], rtol=0, atol=2e-5)
    assert (s2[m] <= 1 + 1e-6).all() and (s2[m] >= lp[m].exp() ** 2 - 1e-6).all()
    expect, _ = compute_token_advantages(d.rewards, b.group_index, d.response_mask, adv, old_log_prob=lp,
                                         sum_pi_squared=s2)
    assert torch.equal(d.advantages, expect) and d.advantages.abs().sum() > 0
