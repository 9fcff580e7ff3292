"""``--resume RUN steps=N`` continues a run with the schedule of the new total: the first resumed
update already uses the new schedule's learning rate, not the one the checkpoint's optimizer
state stored (with cosine, 0 at the end of the finished run)."""

from __future__ import annotations

import math

import pytest

from echotrain import cli
from echotrain.train.metrics import read_jsonl

PEAK = 1e-3
RUN = ["model=testbed", "task=testbed", "lr_scheduler=cosine", f"lr={PEAK}", "warmup_steps=0", "num_mini_batches=1",
       "ppo_epochs=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4", "micro_batch_size=4",
       "eval_prompts=0", "num_threads=1", "progress=false", "plots=false", "save_final_model=false"]


def cosine(u: int, total: int) -> float:
    """The LR of optimizer step u (0-based) of a cosine decay to 0 over ``total`` steps, by hand."""
    return PEAK * 0.5 * (1 + math.cos(math.pi * min(1.0, u / total)))


def test_continuing_a_finished_cosine_run_uses_the_new_schedule(tmp_path, testbed_cache, capsys):
    run = str(tmp_path / "run")
    assert cli.main(["train", *RUN, "steps=4", f"output_dir={run}"]) == 0
    first = [r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    # 1, (1 + cos(pi/4))/2, 1/2, (1 - cos(pi/4))/2 of the peak
    assert first == pytest.approx([1e-3, 8.535533905932737e-4, 5e-4, 1.4644660940672627e-4], rel=1e-12)
    assert cli.main(["train", "--resume", run, "steps=6"]) == 0, capsys.readouterr().err
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert lrs[:4] == first  # the first 4 steps are kept as written
    # step 5 = optimizer step 4 of a 6-step cosine: (1 + cos(2 pi / 3)) / 2 = 1/4; step 6: (1 + cos(5 pi / 6)) / 2
    assert lrs[4:] == pytest.approx([2.5e-4, 6.698729810778066e-5], rel=1e-12)
    assert lrs[4:] == pytest.approx([cosine(4, 6), cosine(5, 6)], rel=1e-12)


def test_restart_schedule_sets_the_optimizer_lr_before_the_first_step():
    import torch

    from echotrain.train.checkpoint import restart_schedule
    from echotrain.train.trainer import lr_lambda
    from echotrain.train.config import resolve_config

    w = torch.nn.Parameter(torch.zeros(2))
    old = torch.optim.AdamW([w], lr=PEAK)
    old_sched = torch.optim.lr_scheduler.LambdaLR(old, lr_lambda(resolve_config(overrides={"lr_scheduler": "cosine"}), 4))
    for _ in range(4):
        old.step()
        old_sched.step()
    assert old.param_groups[0]["lr"] == 0.0  # the finished 4-step cosine
    new = torch.optim.AdamW([w], lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(new, lr_lambda(resolve_config(overrides={"lr_scheduler": "cosine"}), 6))
    new.load_state_dict(old.state_dict())  # what resume does: the stored lr (0.0) comes back with the state
    assert new.param_groups[0]["lr"] == 0.0
    restart_schedule(sched, old_sched.state_dict())
    assert new.param_groups[0]["lr"] == pytest.approx(2.5e-4, rel=1e-12) == sched.get_last_lr()[0]
    assert sched.last_epoch == 4
    new.step()
    sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(cosine(5, 6), rel=1e-12)
