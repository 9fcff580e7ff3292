"""The worked examples of docs/design/architecture.md ("How to add a policy loss"), exercised.

A policy loss is one registration: the trainer's config accepts its name and trains with it with
no other edit. The toy loss is the vanilla PPO-clip loss times a constant 1/2, so with one
mini-batch and no clipping of the gradient norm its first step's gradient is exactly half of
vanilla's (scaling by 1/2 is exact in binary floating point).
"""

from __future__ import annotations

import dataclasses

import pytest

from echotrain import rl
from echotrain.train.config import ConfigError, parse_overrides, resolve_config
from echotrain.train.trainer import Trainer

# model=testbed: the cached testbed policy (slow when it must be built; tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_testbed")

_RUN = ["model=testbed", "task=testbed", "steps=1", "prompts_per_step=4", "num_generations=4", "max_new_tokens=8",
        "num_mini_batches=1", "micro_batch_size=8", "eval_prompts=0", "max_grad_norm=0", "seed=3", "num_threads=1",
        "save_every=0", "save_final_model=false", "plots=false", "preset=dapo", "kl_coef=0"]


@pytest.fixture
def half_vanilla():
    @rl.register_policy_loss("half_vanilla")
    def _half_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                      *, group_index=None, step=None):
        # the step statistics were computed for this loss; vanilla's own check wants its name on them
        step = dataclasses.replace(step, loss_mode="vanilla") if step is not None else None
        loss, metrics = rl.compute_policy_loss("vanilla", old_log_prob, log_prob, advantages, response_mask,
                                               loss_agg_mode, config, group_index=group_index, step=step)
        return 0.5 * loss, metrics

    yield "half_vanilla"
    rl.POLICY_LOSSES.unregister("half_vanilla")


def _first_grad_norm(tmp_path, loss_mode: str) -> float:
    cfg = resolve_config(overrides=parse_overrides(_RUN + [f"loss_mode={loss_mode}", f"output_dir={tmp_path / loss_mode}"]))
    records = Trainer(cfg).train()
    return records[0]["grad_norm"]


def test_a_registered_loss_trains_with_no_other_edit(tmp_path, half_vanilla):
    with pytest.raises(ConfigError, match="loss_mode"):
        resolve_config(overrides=parse_overrides(_RUN + ["loss_mode=not_registered"]))
    vanilla, half = _first_grad_norm(tmp_path, "vanilla"), _first_grad_norm(tmp_path, half_vanilla)
    assert vanilla > 0 and half == 0.5 * vanilla
