"""``loss_mode=X`` alone keeps the preset's other recipe keys (issue 36, item 15): the startup says
which were overridden and which kept, and the progress line names the mix
(``echotrain echo+loss_mode=gspo``), through the real CLI."""

from __future__ import annotations

import pytest

from echotrain.cli import main
from echotrain.train.config import resolve_config
from echotrain.train.config.preset_report import preset_label, preset_note, preset_overrides, recipe_keys

pytestmark = pytest.mark.usefixtures("testbed_cache")

TINY = ["model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
        "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=0", "num_threads=1", "plots=false",
        "save_final_model=false", "save_every=0", "progress=true"]


def test_recipe_keys_are_the_keys_the_presets_differ_on():
    # by hand from rl/presets.py: estimator (dr_grpo), loss, aggregation, KL (grpo), DAPO's dynamic
    # sampling and overlong shaping, the clip bands, CISPO's lower clip
    assert set(recipe_keys()) == {"adv_estimator", "loss_mode", "loss_agg_mode", "kl_coef", "dynamic_sampling",
                                  "clip_ratio_low", "clip_ratio_high", "cispo_lower_clip", "overlong_buffer_len",
                                  "overlong_filtering"}


def test_overrides_label_and_note_of_resolved_configs():
    assert preset_overrides(resolve_config()) == {} and preset_note(resolve_config()) is None
    assert preset_label(resolve_config(overrides={"preset": "dapo+balanced"})) == "dapo+balanced"
    cfg = resolve_config(overrides={"preset": "grpo", "loss_mode": "echo", "clip_ratio_high": "0.3"})
    assert preset_overrides(cfg) == {"loss_mode": ("vanilla", "echo"), "clip_ratio_high": (0.2, 0.3)}
    assert preset_label(cfg) == "grpo+loss_mode=echo+clip_ratio_high=0.3"
    # cispo on the echo preset keeps cispo_lower_clip=true (preset=cispo sets false): a loss field it reads
    note = preset_note(resolve_config(overrides={"loss_mode": "cispo"}))
    assert "cispo_lower_clip=true" in note and note.endswith("(set them too, or preset=cispo for that paper's recipe)")
    # gspo does not read cispo_lower_clip: not listed
    assert "cispo_lower_clip" not in preset_note(resolve_config(overrides={"loss_mode": "gspo"}))


def test_cli_says_what_loss_mode_alone_keeps_from_the_preset(tmp_path, capsys):
    assert main(["train", *TINY, "loss_mode=gspo", f"output_dir={tmp_path / 'r'}"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert ("echotrain: preset echo with loss_mode=gspo (the preset's: echo); from the preset: adv_estimator=grpo, "
            "loss_agg_mode=token-mean, kl_coef=0, dynamic_sampling=false, clip_ratio_low=0.2, clip_ratio_high=0.28, "
            "overlong_buffer_len=0, overlong_filtering=false (set them too, or preset=gspo for that paper's "
            "recipe)") in err, err
    assert "echotrain echo+loss_mode=gspo:" in err and "echotrain echo:" not in err  # the progress line


def test_cli_says_nothing_when_the_preset_is_trained_as_is(tmp_path, capsys):
    assert main(["train", *TINY, "preset=gspo", f"output_dir={tmp_path / 'r'}"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "echotrain gspo:" in err and "from the preset" not in err and "echotrain: preset" not in err
