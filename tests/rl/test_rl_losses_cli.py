"""`echotrain train model=testbed task=testbed loss_mode=L steps=3` runs and moves the policy for
every registered policy loss, each preset reaches the run's config, and bad loss settings fail
before any work.

Through the real CLI (``echotrain.cli.main``), offline (the preflight knows ``model=testbed``),
tiny settings, one thread; the registries are enumerated, so a new loss or preset is covered.
"""

from __future__ import annotations

import json
import math

import pytest

from echotrain import cli
from echotrain.rl import POLICY_LOSSES, PRESETS

# model=testbed: the cached testbed policy (slow when it must be built; tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_testbed")
TINY = ["model=testbed", "task=testbed", "steps=3", "prompts_per_step=2", "num_generations=4", "max_new_tokens=6",
        "eval_prompts=0", "num_threads=1", "save_every=0", "save_final_model=false", "plots=false", "seed=1"]


@pytest.mark.parametrize("loss_mode", POLICY_LOSSES)
def test_train_runs_with_every_loss(loss_mode, tmp_path):
    out = tmp_path / loss_mode
    assert cli.main(["train", *TINY, f"loss_mode={loss_mode}", f"output_dir={out}"]) in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["ppo_kl"]) for r in records)
    assert max(r["grad_norm"] for r in records) > 0  # the loss moved the policy


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_train_runs_with_every_preset(preset, tmp_path):
    out = tmp_path / preset
    assert cli.main(["train", *TINY, "steps=1", f"preset={preset}", f"output_dir={out}"]) in (0, None)
    config = (out / "config.yaml").read_text()
    assert f"loss_mode: {PRESETS[preset].loss_mode}\n" in config


def test_bad_loss_settings_fail_before_any_work_naming_the_key(capsys):
    for bad, key in [("tau_neg=-1", "tau_neg"), ("clip_cov_lb=6", "clip_cov_lb"), ("kl_cov_ratio=0", "kl_cov_ratio"),
                     ("dro_beta=0", "dro_beta"), ("vespo_lambda_pos=0", "vespo_lambda_pos")]:
        assert cli.main(["train", *TINY, bad, "output_dir=/nonexistent/never"]) == 2
        err = capsys.readouterr().err
        assert key in err and len(err.strip().splitlines()) == 1, err
