"""Issue 9 case 4: configs under which every advantage is exactly 0 are refused at config time."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import PRESETS, compute_token_advantages
from echotrain.rl.advantages import ADV_ESTIMATOR_REGISTRY, ADV_METHODS
from echotrain.train.config import ConfigError, resolve_config


def _adv(rewards, groups, adv):
    n = len(rewards)
    return compute_token_advantages(torch.tensor(rewards), torch.tensor(groups), torch.ones(n, 3), adv_estimator=adv,
                                    reward_baselines=torch.zeros(n), old_log_prob=torch.full((n, 3), -1.0),
                                    sum_pi_squared=torch.full((n, 3), 0.5))[0]


GROUPED = [a for a in ADV_METHODS if ADV_ESTIMATOR_REGISTRY.info(a)["group_baseline"]]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("adv", GROUPED)
def test_one_generation_is_refused_naming_the_key(preset, adv):
    # groups of one give every advantage exactly 0 under every group-baseline estimator ...
    assert not _adv([0.0, 1.0, 5.0], [0, 1, 2], adv).any()
    with pytest.raises(ConfigError, match=rf"num_generations=1: adv_estimator='{adv}'.*exactly 0"):
        resolve_config(overrides={"preset": preset, "adv_estimator": adv, "num_generations": 1})
    # ... and two already carry signal
    assert _adv([0.0, 1.0], [0, 0], adv).abs().sum() > 0
    assert resolve_config(overrides={"preset": preset, "adv_estimator": adv, "num_generations": 2}).num_generations == 2


@pytest.mark.parametrize("adv", [a for a in ADV_METHODS if a not in GROUPED])
def test_one_generation_is_accepted_without_a_group_baseline(adv):
    # remax's greedy baseline, reinforce_plus_plus's batch whitening and the optimal token baselines
    # (a group of one has no baseline, as verl) learn from G = 1
    assert adv in ("remax", "reinforce_plus_plus", "optimal_token_baseline", "tir_optimal_token_baseline")
    assert _adv([0.0, 1.0, 5.0], [0, 1, 2], adv).any()
    assert resolve_config(overrides={"adv_estimator": adv, "num_generations": 1}).num_generations == 1


def test_greedy_top_k_is_refused():
    with pytest.raises(ConfigError, match="top_k=1: greedy"):
        resolve_config(overrides={"top_k": 1})
    assert resolve_config(overrides={"top_k": 2}).top_k == 2
    assert resolve_config(overrides={"top_k": 0}).top_k == 0
