"""CLI smoke over the registries: ``echotrain train`` runs one step with every registered policy
loss and every aggregation mode (a plugin's too, with ECHOTRAIN_TEST_PLUGINS; tests/conftest.py),
and every key it writes is declared in the metric schema."""

from __future__ import annotations

import json

import pytest

from echotrain.cli import main
from echotrain.metrics import METRICS
from echotrain.rl import AGG_MODES, POLICY_LOSSES

# model=testbed: the cached testbed policy (slow when it must be built; tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_testbed")

_TINY = ["model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=2", "eval_prompts=0", "num_threads=1", "save_every=0",
         "save_final_model=false", "plots=false", "progress=false", "log_samples=0"]


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_every_registered_loss_trains_from_the_cli(loss_mode, tmp_path):
    # each loss with the next aggregation mode in turn, so that every mode runs too
    agg = AGG_MODES[list(POLICY_LOSSES).index(loss_mode) % len(AGG_MODES)]
    assert main(["train", *_TINY, f"loss_mode={loss_mode}", f"loss_agg_mode={agg}", f"output_dir={tmp_path}"]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["optimizer_steps"] == 1 and record["grad_norm"] >= 0
    # what the loss declares is written, except metrics of settings off by default
    unconditional = {m for m in POLICY_LOSSES.info(loss_mode)["metrics"] if METRICS[m].when in ("", f"loss_mode={loss_mode}")}
    assert unconditional and unconditional <= set(record)
    assert all(k in METRICS for k in record if k != "step")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_aggregation_mode_is_accepted_by_the_cli(agg, tmp_path):
    assert main(["train", *_TINY, "loss_mode=vanilla", f"loss_agg_mode={agg}", "--print-config"]) == 0
