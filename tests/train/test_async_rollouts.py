"""Asynchronous rollouts (``async_rollouts=true``, train/async_rollouts.py): a worker process
generates with the newest published weights, the learner never trains on a batch older than
``max_staleness``, the sampler's log-probs are those of the version recorded, and a dead or
stalled worker ends the run with a message naming it, a checkpoint and a working ``--resume``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from echotrain.cli import main
from echotrain.runtime.checkpoints import latest_checkpoint
from echotrain.runtime.rollout import forward_log_probs
from echotrain.train.config import resolve_config
from echotrain.train.metrics import read_jsonl

RUN = ["model=testbed", "task=testbed", "prompts_per_step=4", "num_generations=4", "max_new_tokens=6",
       "micro_batch_size=16", "num_threads=2", "eval_prompts=0", "plots=false", "save_final_model=false",
       "progress=false", "seed=0", "lr=3e-4", "async_rollouts=true"]


def _over(tokens):
    return dict(t.split("=", 1) for t in tokens)


def test_async_run_never_trains_on_a_batch_older_than_max_staleness(tmp_path, capsys):
    run = tmp_path / "a"
    assert main(["train", *RUN, "steps=6", "max_staleness=2", f"output_dir={run}"]) == 0
    assert "1 learner + 1 rollout-worker threads" in capsys.readouterr().err
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= 2
        assert r["async/regenerated"] == r["async/dropped"] == 0  # async_stale=wait
        assert 0 <= r["async/learner_wait_frac"] <= 1 and 0 <= r["async/worker_wait_frac"] <= 1
        assert "throughput/decode_bw_util" not in r  # the learner did not generate
    assert recs[0]["staleness/max"] == 0  # step 1 is sampled by the initial weights (version 0)
    ck = torch.load(latest_checkpoint(run), weights_only=False)
    assert ck["extra"]["rollouts"]["mode"] == "async"


def test_no_generated_batch_is_wasted_through_the_cli(tmp_path):
    """Issue 40: with max_staleness=1 the worker queued batches that were one version too old by
    the time the learner took them (5 of 17 dropped in 12 steps, one every other step). The worker
    now waits for fresh enough weights before generating: every batch it generates is trained on,
    in order, no prompt draw is skipped, and the bound holds."""
    run = tmp_path / "w"
    assert main(["train", *RUN, "steps=12", "max_staleness=1", "save_every=0", f"output_dir={run}"]) == 0
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert [r["async/dropped"] for r in recs] == [0] * 12 and [r["async/regenerated"] for r in recs] == [0] * 12
    assert [r["async/worker_generated"] for r in recs] == list(range(1, 13))  # generated = trained
    assert all(0 <= r["staleness/min"] <= r["staleness/max"] <= 1 for r in recs)
    ck = torch.load(latest_checkpoint(run), weights_only=False)
    assert ck["data"]["draws"] == 12  # one prompt draw a step: none skipped


@pytest.mark.parametrize("lora_r", [0, 4])
def test_rollout_log_probs_are_those_of_the_recorded_version(tmp_path, lora_r):
    """The worker samples with the weights the learner published: recompute the batch's log-probs
    with the saved weights of its rollout_version and compare (a torn or stale copy would differ).
    With LoRA only the adapters are published."""
    if lora_r:
        pytest.importorskip("peft")
    from echotrain.train.trainer import Trainer

    cfg = resolve_config(overrides={**_over(RUN), "steps": 5, "max_staleness": 1, "lr": 1e-2, "lora_r": lora_r,
                                    "lora_alpha": 2 * lora_r or 16,
                                    "output_dir": str(tmp_path / "b"), "recompute_old_log_prob": False})
    trainer = Trainer(cfg)
    weights = {0: {k: v.clone() for k, v in trainer.model.state_dict().items()}}
    datas = {}
    inner = trainer.rollouts.rollouts_for

    def rollouts_for(step):
        datas[step] = inner(step)
        return datas[step]

    trainer.rollouts.rollouts_for = rollouts_for
    trainer.callbacks.append(lambda step, rec: weights.__setitem__(
        step, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    trainer.train()
    probe = trainer.model
    seen = set()
    for step, data in datas.items():
        v = int(data.rollout_version[0])
        assert (data.rollout_version == v).all() and step - 1 - 1 <= v <= step - 1
        seen.add(step - 1 - v)
        probe.load_state_dict(weights[v])
        b, m = data.batch, data.batch.response_mask.bool()
        with torch.no_grad():
            lp = forward_log_probs(probe, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)[0]
        torch.testing.assert_close(data.rollout_log_prob[m], lp[m], rtol=0, atol=1e-4)
        if v != step - 1:  # and not those of the learner's current weights (lr 1e-2 moved them)
            probe.load_state_dict(weights[step - 1])
            with torch.no_grad():
                now = forward_log_probs(probe, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)[0]
            assert (now - lp)[m].abs().max() > 1e-3
    assert 1 in seen  # the lag happened at least once


@pytest.mark.parametrize("stale", ["wait", "drop"])
def test_a_slow_learner_never_deadlocks_and_the_worker_waits_instead_of_wasting_batches(tmp_path, stale):
    """A learner slower than the worker: under async_stale=wait the worker waits for the weights
    (every batch it generates is trained on); under drop it generates on with the weights it has
    and the learner drops what went too old (counted: generated = trained + dropped)."""
    from echotrain.train.trainer import Trainer

    cfg = resolve_config(overrides={**_over(RUN), "steps": 4, "max_staleness": 1, "async_stale": stale,
                                    "output_dir": str(tmp_path / "slow")})
    trainer = Trainer(cfg, callbacks=[lambda step, rec: time.sleep(1.5)])  # the queue fills meanwhile
    t0 = time.perf_counter()
    recs = trainer.train()
    assert time.perf_counter() - t0 < 60 and trainer.rollouts.proc is None  # the worker was stopped
    assert all(r["staleness/max"] <= 1 for r in recs)
    dropped = sum(r["async/dropped"] for r in recs)
    assert recs[-1]["async/worker_generated"] == 4 + dropped
    if stale == "wait":
        assert [r["async/worker_generated"] for r in recs] == [1, 2, 3, 4] and dropped == 0
        assert max(r["async/worker_wait_frac"] for r in recs[1:]) > 0.3  # most of the 1.5 s sleep
    else:
        assert dropped >= 1


class _Alive:
    pid, exitcode = 1234, None

    def is_alive(self):
        return True


def _hand_batch(version, n=2):
    """A queued StepData of ``n`` rows sampled by ``version`` (its rewards say the version)."""
    from echotrain.runtime.rollout import RolloutBatch
    from echotrain.train.step import StepData

    z = torch.zeros(n, 3, dtype=torch.long)
    b = RolloutBatch(prompt_ids=z, prompt_mask=z + 1, response_ids=z, response_mask=torch.ones(n, 3),
                     group_index=torch.zeros(n, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool))
    d = StepData(batch=b, rewards=torch.full((n,), float(version)), correct=torch.zeros(n),
                 format_ok=torch.ones(n, dtype=torch.bool), examples=[None] * n, texts=[""] * n)
    d.rollout_version = torch.full((n,), version, dtype=torch.long)
    return d


def test_a_learner_that_only_gets_stale_batches_stops_after_the_timeout():
    import queue

    from echotrain.train.async_rollouts import AsyncRollouts, RolloutWorkerError, _encode
    from echotrain.train.collect import PromptStream

    ar = AsyncRollouts(spec=None, model=None, prompts=PromptStream(None, 0), regenerate=lambda: None,
                       max_staleness=1, timeout_s=1e-6)
    ar.proc, ar.queue = _Alive(), queue.Queue()
    for _ in range(3):
        ar.queue.put(("batch", _encode(_hand_batch(0)), 1, 1.0, 0.0, 0))
    with pytest.raises(RolloutWorkerError, match="sent only batches older than max_staleness=1"):
        ar.rollouts_for(10)
    assert ar.queue.qsize() == 2  # it stopped after the first drop past the timeout


@pytest.mark.parametrize("stale", ["drop", "regenerate"])
def test_the_learner_drops_or_regenerates_a_batch_older_than_max_staleness(stale):
    """The learner's side alone, on a hand-filled queue: at step 5 (version 4) with k = 1, a batch
    of version 2 is too old, one of version 3 is not."""
    import queue

    from echotrain.train.async_rollouts import AsyncRollouts, _encode
    from echotrain.train.collect import PromptStream

    batch = _hand_batch

    prompts = PromptStream(None, 0)
    ar = AsyncRollouts(spec=None, model=None, prompts=prompts, regenerate=lambda: batch(99), max_staleness=1,
                       stale=stale)
    ar.proc, ar.queue = _Alive(), queue.Queue()
    for v, draws in ((2, 7), (3, 8)):
        ar.queue.put(("batch", _encode(batch(v)), draws, 1.0, 0.5, v))
    data = ar.rollouts_for(5)
    m = ar.step_metrics(5, data, step_seconds=2.0)
    if stale == "drop":
        assert float(data.rewards[0]) == 3 and prompts.draws == 8  # the version-3 batch; stream after both
        assert m["async/dropped"] == 1 and m["async/regenerated"] == 0 and m["async/worker_generated"] == 3
        assert m["staleness/max"] == 1
    else:
        assert float(data.rewards[0]) == 99 and data.rollout_version.tolist() == [4, 4]  # the learner's own
        assert m["async/dropped"] == 0 and m["async/regenerated"] == 1 and prompts.draws == 7
        assert m["staleness/max"] == 0
    assert m["async/worker_wait_frac"] == pytest.approx(0.5 / 1.5)


def test_killing_the_worker_ends_the_run_with_its_name_and_resume_continues(tmp_path, capsys, monkeypatch):
    from echotrain.train import trainer as trainer_mod

    run = tmp_path / "k"
    real_train_step = trainer_mod.Trainer.train_step

    def train_step(self, step):
        if step == 3:  # the worker dies between steps 2 and 3
            os.kill(self.rollouts.proc.pid, signal.SIGKILL)
        return real_train_step(self, step)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)
    t0 = time.perf_counter()
    assert main(["train", *RUN, "steps=5", "save_every=0", f"output_dir={run}"]) == 1
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err
    assert "rollout worker process (echotrain-rollout-worker, pid" in err and "died" in err and "--resume" in err
    # the last completed step: 2, or 3 when a batch was already queued at the kill
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert done in (2, 3) and latest_checkpoint(run).name == f"step_{done:08d}.pt"
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", real_train_step)
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_stalled_worker_times_out_with_a_message(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the worker imports async_helpers too
    from async_helpers import SlowReward

    from echotrain.tasks import get_task
    from echotrain.train.async_rollouts import RolloutWorkerError
    from echotrain.train.trainer import Trainer

    cfg = resolve_config(overrides={**_over(RUN), "steps": 3, "async_timeout_s": 3.0, "output_dir": str(tmp_path / "s")})
    task = get_task("testbed")
    trainer = Trainer(cfg, task=task, reward_fn=SlowReward(task))
    t0 = time.perf_counter()
    with pytest.raises(RolloutWorkerError, match=r"sent no rollout batch for \d+ s \(async_timeout_s=3\)"):
        trainer.train()
    assert time.perf_counter() - t0 < 25 and trainer.rollouts.proc is None  # stopped, not waited for
    assert latest_checkpoint(tmp_path / "s").name == "step_00000001.pt"


@pytest.mark.parametrize("tokens, message", [
    (["staleness=2"], "staleness=2: fixed lag and async_rollouts=true are two modes"),
    (["device=cuda"], "device='cuda': async_rollouts=true runs on the CPU only"),
    (["max_staleness=0"], "max_staleness=0: must be >= 1"),
    (["async_stale=pause"], "async_stale"),
    (["async_timeout_s=0"], "async_timeout_s=0.0: must be > 0 seconds"),
])
def test_bad_async_settings_are_refused(tokens, message, capsys):
    assert main(["train", "async_rollouts=true", *tokens]) == 2
    assert message in capsys.readouterr().err


def test_a_worker_that_raises_ends_the_run_with_its_traceback(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the worker imports async_helpers too
    from async_helpers import RaisingReward

    from echotrain.tasks import get_task
    from echotrain.train.async_rollouts import RolloutWorkerError
    from echotrain.train.trainer import Trainer

    cfg = resolve_config(overrides={**_over(RUN), "steps": 2, "output_dir": str(tmp_path / "r")})
    trainer = Trainer(cfg, task=get_task("testbed"), reward_fn=RaisingReward())
    with pytest.raises(RolloutWorkerError, match="raised an exception") as info:
        trainer.train()
    assert "ValueError: the reward function exploded on purpose" in str(info.value)  # its traceback
    assert "Traceback (most recent call last)" in str(info.value) and trainer.rollouts.proc is None


def test_publish_copies_the_weights_and_raises_the_version_under_the_lock(monkeypatch):
    """The worker copies the buffer under the same lock, so it never reads half-written weights
    or a version that does not match them: both writes happen while the lock is held."""
    import echotrain.train.async_rollouts as mod

    class SpyLock:
        held = False

        def __enter__(self):
            self.held = True

        def __exit__(self, *exc):
            self.held = False

    lock = SpyLock()

    class Version:
        _v = 0

        @property
        def value(self):
            return self._v

        @value.setter
        def value(self, v):
            assert lock.held, "version raised outside the lock"
            self._v = v

    copies, real_copy = [], mod._copy_into
    monkeypatch.setattr(mod, "_copy_into", lambda dst, src: (copies.append(lock.held), real_copy(dst, src)))
    ar = mod.AsyncRollouts(spec=None, model=None, prompts=None, regenerate=lambda: None, max_staleness=1)
    ar.lock, ar.version = lock, Version()
    ar._mine, ar._shared = [torch.arange(3.0), torch.ones(2, 2)], [torch.zeros(3), torch.zeros(2, 2)]
    ar.publish(4)
    assert copies == [True] and ar.version.value == 4 and ar.version_now == 4 and not lock.held
    assert torch.equal(ar._shared[0], torch.arange(3.0)) and torch.equal(ar._shared[1], torch.ones(2, 2))


def test_a_batch_is_stamped_with_the_version_that_sampled_it_not_the_one_at_its_end(tmp_path, monkeypatch):
    """The worker's second batch is sampled by version 0 (taken before the learner's first step
    ends), and its scoring sleeps 1.5 s, during which the learner publishes version 1: the batch
    is still version 0, so step 2 (learner version 1) trains on it at staleness 1."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the worker imports async_helpers too
    from async_helpers import SlowReward

    from echotrain.tasks import get_task
    from echotrain.train.trainer import Trainer

    cfg = resolve_config(overrides={**_over(RUN), "steps": 2, "max_staleness": 1, "output_dir": str(tmp_path / "v")})
    task = get_task("testbed")
    recs = Trainer(cfg, task=task, reward_fn=SlowReward(task, sleep_s=1.5)).train()
    assert [r["staleness/max"] for r in recs] == [0, 1]


def test_the_regeneration_stream_position_is_checkpointed_and_restored():
    from echotrain.train.async_rollouts import AsyncRollouts
    from echotrain.train.collect import PromptStream

    def rollouts(draws):
        regen = PromptStream(None, 0)
        regen.draws = draws
        return AsyncRollouts(spec=None, model=None, prompts=PromptStream(None, 0), regenerate=lambda: None,
                             max_staleness=3, stale="regenerate", regen_prompts=regen)

    state = rollouts(11).state_dict()
    assert state == {"mode": "async", "max_staleness": 3, "regen_draws": 11}
    resumed = rollouts(0)
    resumed.load_state_dict(state)
    assert resumed.regen_prompts.draws == 11
    resumed.load_state_dict({"queue": [], "staleness": 2})  # a fixed-lag checkpoint: the stream starts fresh
    assert resumed.regen_prompts.draws == 11


def test_learner_wait_frac_is_the_wait_over_the_whole_step():
    """Two takes of 0.1 s each (the first batch too old, dropped) in a step of 2 s: 0.2 / 2."""
    import queue

    from echotrain.train.async_rollouts import AsyncRollouts, _encode
    from echotrain.train.collect import PromptStream

    class SlowQueue(queue.Queue):
        def get(self, block=True, timeout=None):
            time.sleep(0.1)
            return super().get(block, timeout)

    def batch(version):
        from echotrain.runtime.rollout import RolloutBatch
        from echotrain.train.step import StepData

        z = torch.zeros(2, 3, dtype=torch.long)
        b = RolloutBatch(prompt_ids=z, prompt_mask=z + 1, response_ids=z, response_mask=torch.ones(2, 3),
                         group_index=torch.zeros(2, dtype=torch.long), truncated=torch.zeros(2, dtype=torch.bool))
        d = StepData(batch=b, rewards=torch.zeros(2), correct=torch.zeros(2), format_ok=torch.ones(2, dtype=torch.bool),
                     examples=[None] * 2, texts=[""] * 2)
        d.rollout_version = torch.full((2,), version, dtype=torch.long)
        return d

    ar = AsyncRollouts(spec=None, model=None, prompts=PromptStream(None, 0), regenerate=lambda: None, max_staleness=1)
    ar.proc, ar.queue = _Alive(), SlowQueue()
    for v in (2, 3):
        ar.queue.put(("batch", _encode(batch(v)), 1, 1.0, 0.0, 0))
    m = ar.step_metrics(5, ar.rollouts_for(5), step_seconds=2.0)
    assert m["async/dropped"] == 1
    assert 0.2 / 2 <= m["async/learner_wait_frac"] < 0.2 / 2 + 0.05
