"""Worker for tests/integrations/test_trl_distributed.py, launched as
``accelerate launch --multi_gpu --num_processes 2 trl_dist_worker.py OUT_DIR`` (on CPU:
the trainer's ``use_cpu=True`` makes accelerate use gloo).

1. Each process holds one half of a fabricated off-policy optimizer step (process r: window r
   of :func:`global_step_windows`) and computes ECHO's step statistics through the TRL route
   (``EchoGRPOTrainer.compute_step_stats_for``), writing R to ``OUT_DIR/rank<r>.json``.
2. Then 2 real GRPO steps (``num_iterations=2``: the second pass over each rollout buffer is
   off-policy), recording the ``echotrain/echo/R_batch`` values each process logged.
Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trl_adapter import fabricated_window, make_trainer  # noqa: E402


def global_step_windows(trainer):
    """Two processes' micro-batches of one optimizer step: window k = fabricated_window(seed=k),
    step-wide group ids (window 1's groups shifted by 4)."""
    a = fabricated_window(trainer, seed=0)
    b = fabricated_window(trainer, seed=1)
    for mb in b:
        mb["group_index"] = mb["group_index"] + 4
    return [a, b]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    trainer = make_trainer(out / "trl", loss_mode="echo", loss_agg_mode="token-mean")
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    mbs = global_step_windows(trainer)[rank]
    stats = trainer.compute_step_stats_for(trainer.model, mbs)
    result = {"world": world, "R": stats.loss_stats.R, "kappa": stats.loss_stats.kappa, "num_tokens": stats.num_tokens,
              "dp_size": stats.dp_size}

    trainer = make_trainer(out / "trl", loss_mode="echo", loss_agg_mode="token-mean", max_steps=2, num_iterations=2)
    seen, compute_loss = [], trainer._compute_loss

    def recording(model, inputs):  # the R each micro-batch's loss used, on this process
        loss = compute_loss(model, inputs)
        seen.append(trainer._step_stats.loss_stats.R)
        return loss

    trainer._compute_loss = recording
    trainer.train()
    result["train_R"] = seen
    result["global_step"] = trainer.state.global_step
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
