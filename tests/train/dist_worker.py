"""Worker for tests/train/test_distributed.py, launched as
``python -m torch.distributed.run --standalone --nproc_per_node 2 dist_worker.py OUT_DIR``.

Runs, in one process group: ``group`` (rollout_rng=group, compared with one process), ``lora`` (the same with
LoRA adapters), ``uneven`` (3 groups: a rank with no rows in a mini-batch),
``lag`` (group, staleness=2, ECHO's pre-pass from the kept forwards), ``stream`` (per-rank RNG streams), ``killed`` (stream, killed after step 2's metrics, so the
step-1 checkpoint is the last) and ``killed`` resumed; ``async`` (async_rollouts=true: refused on every rank). Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import DigitTask, make_model, make_tokenizer  # noqa: E402

from echotrain.train.config import resolve_config  # noqa: E402
from echotrain.train.trainer import Trainer  # noqa: E402

#: the config of every run in the distributed tests (the test imports it for the 1-process runs)
DIST_BASE = dict(steps=3, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=3,
                 num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
                 save_final_model=False, log_samples=2, seed=0, eval_prompts=0, preset="echo", kl_coef=0.01,
                 save_every=1, keep_last=3)


class Killed(Exception):
    pass


def run(out: Path, name: str, resume: bool = False, callbacks=(), **over) -> list:
    tok = make_tokenizer()
    cfg = resolve_config(overrides={**DIST_BASE, "output_dir": str(out / name), **over})
    trainer = Trainer(cfg, model=make_model(tok), tokenizer=tok, task=DigitTask(), resume=resume, callbacks=callbacks)
    return trainer.train()


def main(out: Path) -> None:
    torch.set_num_threads(1)
    run(out, "group", rollout_rng="group")
    run(out, "stream", rollout_rng="stream")
    run(out, "lora", rollout_rng="group", lora_r=4, lora_alpha=8)
    # 3 groups, mini-batches of 2 and 1 groups: rank 1 has no rows in one of them. No KL term: with these
    # draws some mini-batches have no reward signal (at step 2 every group ties), and their update is then
    # Adam's normalisation of a tiny KL gradient, whose smallest components the rounding of one and two
    # processes (different layouts of the reference pass) decides; without the KL term it is exactly zero
    run(out, "uneven", rollout_rng="group", prompts_per_step=3, steps=2, kl_coef=0.0)
    # fixed lag: each rank keeps the same queue of rollouts generated ahead (the batch is gathered)
    run(out, "lag", rollout_rng="group", staleness=2, log_prob_prepass="retain")  # the kept pre-pass

    def kill_at_2(step, record):
        if step == 2:
            raise Killed

    try:
        run(out, "killed", rollout_rng="stream", callbacks=[kill_at_2])
    except Killed:
        pass
    run(out, "killed", resume=True, rollout_rng="stream")
    from echotrain.train.async_rollouts import AsyncUnsupported

    try:  # asynchronous rollouts are refused under torchrun, on every rank, before any step
        run(out, "async", async_rollouts=True)
    except AsyncUnsupported as exc:
        (out / f"async_refused_rank{torch.distributed.get_rank()}.txt").write_text(str(exc))
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
