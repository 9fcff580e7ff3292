"""The TRL route with 2 processes: ECHO's batch ratio R is the global one (all-reduced over the
accelerate process group), equal to the single-process R of the same step, not each process's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_trl_adapter import make_trainer  # noqa: E402
from trl_dist_worker import global_step_windows  # noqa: E402


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """``accelerate launch --multi_gpu --num_processes 2`` of trl_dist_worker.py on CPU: the
    launcher starts torchrun's 2 processes and accelerate picks gloo from ``use_cpu=True``.
    (``accelerate launch --cpu --num_processes 2`` would start ONE process: accelerate's
    multi-CPU route needs mpirun.)"""
    out = tmp_path_factory.mktemp("trl_dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(HERE / "trl_dist_worker.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_echo_batch_ratio_is_global_across_processes(two_processes, tmp_path):
    trainer = make_trainer(tmp_path, loss_mode="echo", loss_agg_mode="token-mean")
    windows = global_step_windows(trainer)
    whole = trainer.compute_step_stats_for(trainer.model, windows[0] + windows[1])  # one process, whole step
    own = [trainer.compute_step_stats_for(trainer.model, w).loss_stats.R for w in windows]  # each half alone
    for r, res in enumerate(two_processes):
        assert res["world"] == 2 and res["dp_size"] == 2  # DDP averages: each loss x world size
        assert res["num_tokens"] == whole.num_tokens
        assert res["R"] == pytest.approx(whole.loss_stats.R, rel=1e-6)
        assert res["kappa"] == pytest.approx(whole.loss_stats.kappa, rel=1e-6)
        assert abs(own[r] - whole.loss_stats.R) > 1e-3  # a per-process R would differ
    assert whole.loss_stats.clipped


def test_two_real_grpo_steps_use_one_R_on_both_processes(two_processes):
    a, b = two_processes
    assert a["global_step"] == b["global_step"] == 2
    assert len(a["train_R"]) == 4 and a["train_R"] == b["train_R"]  # bit-identical: an all-reduced statistic
    assert a["train_R"][:2] == [1.0, 1.0]  # first pass over the rollouts: on-policy, R = 1 exactly
    assert any(abs(r - 1.0) > 1e-4 for r in a["train_R"][2:])  # num_iterations=2: off-policy second pass
    assert torch.isfinite(torch.tensor(a["train_R"])).all()
