"""Issue 9 case 4: configs under which every advantage is exactly 0 are refused at config time."""

from __future__ import annotations

import pytest
import torch

from echotrain.rl import PRESETS, compute_advantages
from echotrain.rl.advantages import ADV_METHODS
from echotrain.train.config import ConfigError, resolve_config


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("adv", ADV_METHODS)
def test_one_generation_is_refused_naming_the_key(preset, adv):
    # groups of one give every advantage exactly 0 under every estimator we have ...
    assert not compute_advantages(torch.tensor([0.0, 1.0, 5.0]), torch.arange(3), adv_estimator=adv).any()
    with pytest.raises(ConfigError, match=rf"num_generations=1: adv_estimator='{adv}'.*exactly 0"):
        resolve_config(overrides={"preset": preset, "adv_estimator": adv, "num_generations": 1})
    # ... and two already carry signal
    assert compute_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), adv_estimator=adv).abs().sum() > 0
    assert resolve_config(overrides={"preset": preset, "adv_estimator": adv, "num_generations": 2}).num_generations == 2


def test_greedy_top_k_is_refused():
    with pytest.raises(ConfigError, match="top_k=1: greedy"):
        resolve_config(overrides={"top_k": 1})
    assert resolve_config(overrides={"top_k": 2}).top_k == 2
    assert resolve_config(overrides={"top_k": 0}).top_k == 0
