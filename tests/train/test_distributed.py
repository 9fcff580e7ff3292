"""Data-parallel ``echotrain train``: 2 gloo processes on CPU (torchrun) against 1 process on the
same global batch, a kill-and-resume with 2 processes, and the world-size check on resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echotrain.runtime.checkpoints import latest_checkpoint, load_checkpoint
from echotrain.train.config import resolve_config
from echotrain.train.dist import DistContext
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from echotrain.train.trainer import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from dist_worker import DIST_BASE  # noqa: E402


def strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}


def test_shard_covers_everything_once():
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            parts = [list(DistContext(rank=r, world_size=world).shard(n)) for r in range(world)]
            assert sum(parts, []) == list(range(n))  # contiguous, in rank order
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert DistContext().is_main and not DistContext().enabled
    assert not DistContext(rank=1, world_size=2).is_main


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Launch dist_worker.py under torchrun with 2 gloo processes (one launch for all runs)."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(HERE / "dist_worker.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def one_process(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, name, **over):
    """The same run in this process, on one thread as each worker (a GEMM's rounding depends on its threads)."""
    cfg = resolve_config(overrides={**DIST_BASE, "output_dir": str(tmp_path / name), **over})
    trainer = Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return trainer, trainer.train()
    finally:
        torch.set_num_threads(threads)


def test_two_processes_equal_one_process(two_process_runs, tmp_path, tiny_tokenizer, make_tiny_model, digit_task):
    trainer, one = one_process(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "one", rollout_rng="group")
    two = read_jsonl(two_process_runs / "group" / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2, 3]
    assert set(two[0]) == set(one[0])
    for a, b in zip(one, two):
        for k, v in strip(a).items():
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # the step moved the model and ECHO's batch ratio was off-policy in a later mini-batch
    assert any(abs(r["echo/R_batch_min"] - 1) > 1e-4 for r in one)
    p2 = load_checkpoint(latest_checkpoint(two_process_runs / "group"))["model"]
    p1 = trainer.model.state_dict()
    init = make_tiny_model(tiny_tokenizer).state_dict()
    moved = max(float((p1[k] - init[k]).abs().max()) for k in p1)
    assert moved > 1e-3
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-4, atol=1e-5)
    # rank 0 alone wrote the outputs: one line per step, samples of the step's first groups
    samples = read_jsonl(two_process_runs / "group" / "samples.jsonl")
    assert len(samples) == 3 * DIST_BASE["log_samples"]
    assert samples == read_jsonl(tmp_path / "one" / "samples.jsonl")


def test_a_rank_without_rows_still_gives_the_one_process_run(two_process_runs, tmp_path, tiny_tokenizer,
                                                            make_tiny_model, digit_task):
    _, one = one_process(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "one", rollout_rng="group",
                         prompts_per_step=3, steps=2, kl_coef=0.0)  # as dist_worker's "uneven"
    two = read_jsonl(two_process_runs / "uneven" / "metrics.jsonl")
    assert [r["groups/kept"] for r in two] == [3, 3]
    bad = [(r, k, v, b[k]) for r, (a, b) in enumerate(zip(one, two, strict=True), 1)
           for k, v in strip(a).items() if b[k] != pytest.approx(v, rel=1e-5, abs=1e-6)]
    assert not bad


def test_two_processes_equal_one_process_with_lora(two_process_runs, tmp_path, tiny_tokenizer, make_tiny_model,
                                                   digit_task):
    pytest.importorskip("peft")
    trainer, one = one_process(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "one", rollout_rng="group",
                               lora_r=4, lora_alpha=8)
    two = read_jsonl(two_process_runs / "lora" / "metrics.jsonl")
    for a, b in zip(one, two, strict=True):
        for k, v in strip(a).items():
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    p2 = load_checkpoint(latest_checkpoint(two_process_runs / "lora"))["model"]  # adapters only
    p1 = {k.replace(".default", ""): v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert p2.keys() == p1.keys()
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-4, atol=1e-5)


def test_two_processes_equal_one_process_with_a_lag(two_process_runs, tmp_path, tiny_tokenizer, make_tiny_model,
                                                   digit_task):
    _, one = one_process(tmp_path, tiny_tokenizer, make_tiny_model, digit_task, "one", rollout_rng="group",
                         staleness=2, log_prob_prepass="retain")
    two = read_jsonl(two_process_runs / "lag" / "metrics.jsonl")
    assert [r["staleness/max"] for r in two] == [0, 1, 2]
    for a, b in zip(one, two, strict=True):
        for k, v in strip(a).items():
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # rank 0's checkpoint holds the queue (every rank's is the same): step 3's rollouts after step 1
    ck = load_checkpoint(two_process_runs / "lag" / "checkpoints" / "step_00000001.pt")
    assert [t for t, _ in ck["extra"]["rollouts"]["queue"]] == [2, 3]


def test_two_process_kill_and_resume_is_exact(two_process_runs):
    full = read_jsonl(two_process_runs / "stream" / "metrics.jsonl")
    resumed = read_jsonl(two_process_runs / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [strip(r) for r in resumed] == [strip(r) for r in full]
    a = load_checkpoint(latest_checkpoint(two_process_runs / "stream"))
    b = load_checkpoint(latest_checkpoint(two_process_runs / "killed"))
    assert a["extra"]["world_size"] == 2 and len(a["extra"]["rng_ranks"]) == 2
    # rank 1 samples its own stream (rollout_rng=stream): its RNG state differs from rank 0's
    assert not torch.equal(a["extra"]["rng_ranks"][0]["torch"], a["extra"]["rng_ranks"][1]["torch"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_with_another_world_size_is_refused(two_process_runs, tiny_tokenizer, make_tiny_model, digit_task):
    cfg = resolve_config(overrides={**DIST_BASE, "output_dir": str(two_process_runs / "stream"),
                                    "rollout_rng": "stream"})
    with pytest.raises(RuntimeError, match=r"2 process\(es\) and this run has 1.*--nproc_per_node 2"):
        Trainer(cfg, model=make_tiny_model(tiny_tokenizer), tokenizer=tiny_tokenizer, task=digit_task, resume=True)


def test_rank_seeds_are_the_run_seed_on_rank_0_and_distinct_elsewhere():
    """rollout_rng=stream: each rank samples its own stream (review: a mutant giving every rank the
    run seed, i.e. G identical copies of each rank's rollouts, passed the suite)."""
    from echotrain.train.dist import rank_seed

    for seed in (0, 1, 1234):
        seeds = [rank_seed(seed, r) for r in range(8)]
        assert seeds[0] == seed and len(set(seeds)) == 8
        assert all(0 <= s < 2**63 for s in seeds)
    assert rank_seed(0, 1) != rank_seed(1, 1)


def test_async_rollouts_are_refused_under_torchrun(two_process_runs):
    for rank in (0, 1):
        text = (two_process_runs / f"async_refused_rank{rank}.txt").read_text()
        assert "async_rollouts=true is not supported under torchrun" in text and "staleness=k" in text
    assert not (two_process_runs / "async" / "metrics.jsonl").exists()
