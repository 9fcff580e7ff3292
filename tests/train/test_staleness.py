"""Fixed-lag off-policy training (``staleness=k``, train/lag.py): step t trains on rollouts sampled by
the weights of step t - k, the learner recomputes old_log_prob, runs are bit-identical, resume is
exact (the queue is in the checkpoint), with every loss, LoRA and ``echotrain compare`` arms."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from echotrain.runtime.checkpoints import latest_checkpoint, list_checkpoints, load_checkpoint
from echotrain.train.config import ConfigError, resolve_config
from echotrain.train.lag import STALENESS_METRICS, LaggedRollouts, StalenessMismatch
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl
from echotrain.runtime.rollout import RolloutBatch, forward_log_probs
from echotrain.train.step import StepData
from tests.train.conftest import Killed, kill_at

BASE = dict(steps=4, prompts_per_step=4, num_generations=4, max_new_tokens=8, micro_batch_size=4,
            num_mini_batches=2, lr=1e-2, temperature=1.0, device="cpu", progress=False, plots=False,
            save_final_model=False, log_samples=2, seed=0, eval_prompts=0, save_every=0)
#: the testbed policy through the CLI, tiny settings
TESTBED = ["model=testbed", "task=testbed", "prompts_per_step=4", "num_generations=4", "max_new_tokens=8",
           "num_mini_batches=2", "micro_batch_size=8", "lr=3e-4", "num_threads=1", "eval_prompts=0",
           "plots=false", "save_final_model=false", "progress=false", "seed=0", "preset=gspo"]
#: runs the real CLI; preflight's model check is bypassed for ``testbed`` only (a built-in
#: local model it may not know yet); everything else is ``echotrain.cli.main``
CLI = r"""
import sys
import echotrain.runtime.preflight as p
_check = p.check_model
p.check_model = lambda name, key="model": None if name == "testbed" else _check(name, key)
from echotrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def strip(records):
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in records]


def cli(monkeypatch, *args: str) -> int:
    """``echotrain.cli.main(args)`` in this process (preflight's model check bypassed for testbed)."""
    import echotrain.runtime.preflight as p
    from echotrain.cli import main

    check = p.check_model
    monkeypatch.setattr(p, "check_model", lambda name, key="model": None if name == "testbed" else check(name, key))
    return main(list(args))


# ---------------------------------------------------------------------------- the queue, by hand
def _fake_collect():
    """collect() returning batch number n (1, 2, ...) in ``rewards``, 2 rows, with times 1 s / 0.5 s."""
    count = [0]

    def collect():
        count[0] += 1
        z = torch.zeros(2, 3, dtype=torch.long)
        batch = RolloutBatch(prompt_ids=z, prompt_mask=z + 1, response_ids=z, response_mask=torch.ones(2, 3),
                             group_index=torch.zeros(2, dtype=torch.long), truncated=torch.zeros(2, dtype=torch.bool))
        return StepData(batch=batch, rewards=torch.full((2,), float(count[0])), correct=torch.zeros(2),
                        format_ok=torch.ones(2, dtype=torch.bool), examples=[None, None], texts=["", ""],
                        time_generation=1.0, time_scoring=0.5)

    return collect


def test_queue_generates_ahead_with_the_versions_of_then():
    lag = LaggedRollouts(_fake_collect(), staleness=2, steps=5, behaviour_log_prob=lambda b: torch.full((2, 3), -1.0))
    got = []
    for step in range(1, 6):
        data = lag.rollouts_for(step)
        data.old_log_prob = torch.full((2, 3), -1.5)
        got.append((int(data.rewards[0]), int(data.rollout_version[0]), data.time_generation,
                    lag.step_metrics(step, data)))
    # step t trains on the t-th generated batch; batches 1-3 at step 1 (initial weights), then t+2 at step t
    assert [g[0] for g in got] == [1, 2, 3, 4, 5]
    assert [g[1] for g in got] == [0, 0, 0, 1, 2]  # version of the weights that sampled it
    # seconds generating in that step (3 batches, then 1 each: steps 6 and 7's at steps 4 and 5 too,
    # so the final queue continues the run; plus the tiny behaviour log-prob call)
    assert [g[2] for g in got] == pytest.approx([3.0, 1.0, 1.0, 1.0, 1.0], abs=0.05)
    assert [g[3]["staleness/max"] for g in got] == [0, 1, 2, 2, 2]  # min(k, t - 1)
    assert [g[3]["staleness/queue_depth"] for g in got] == [2, 2, 2, 2, 2]
    assert [t for t, _ in lag.state_dict()["queue"]] == [6, 7] and lag.next_target == 8
    # one queued batch: prompt/response ids and masks, rollout_log_prob (2 x 3 each), 6 per-row tensors
    one = 2 * 3 * (8 + 8 + 8 + 4 + 4) + 2 * (8 + 1 + 4 + 4 + 1 + 8)
    assert got[3][3]["staleness/queue_mb"] == pytest.approx(2 * one / 2**20)
    assert set(got[0][3]) == set(STALENESS_METRICS)


def test_staleness_zero_is_the_synchronous_collect():
    lag = LaggedRollouts(_fake_collect(), staleness=0, steps=3)
    data = [lag.rollouts_for(s) for s in (1, 2, 3)]
    assert [int(d.rewards[0]) for d in data] == [1, 2, 3] and [int(d.rollout_version[0]) for d in data] == [0, 1, 2]
    assert data[0].time_generation == 1.0 and lag.queue == [] and lag.step_metrics(1, data[0]) == {}


def test_queue_state_round_trip_and_mismatch():
    a = LaggedRollouts(_fake_collect(), staleness=1, steps=4)
    a.rollouts_for(1)
    b = LaggedRollouts(_fake_collect(), staleness=1, steps=4)
    b.load_state_dict(a.state_dict())
    assert b.next_target == 3 and [t for t, _ in b.queue] == [2] and int(b.rollouts_for(2).rewards[0]) == 2
    with pytest.raises(StalenessMismatch, match="written with staleness=1 and this run has staleness=2"):
        LaggedRollouts(_fake_collect(), staleness=2, steps=4).load_state_dict(a.state_dict())
    with pytest.raises(StalenessMismatch, match="staleness=0 and this run has staleness=1"):
        LaggedRollouts(_fake_collect(), staleness=1, steps=4).load_state_dict(None)
    LaggedRollouts(_fake_collect(), staleness=0, steps=4).load_state_dict(None)  # a synchronous checkpoint


def test_bad_staleness_is_refused(capsys):
    with pytest.raises(ConfigError, match=r"staleness=-1.*>= 0"):
        resolve_config(overrides={"staleness": "-1"})
    from echotrain.cli import main

    assert main(["train", "staleness=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["echotrain train: error: staleness=-1: must be >= 0"]


# ---------------------------------------------------------------------------- the trainer (tiny Llama)
def _capture(trainer):
    """Record, per step, the learner's weights at the step's start and the StepData it trains on."""
    weights, datas = {}, {}
    inner = trainer.rollouts.rollouts_for

    def rollouts_for(step):
        weights[step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        datas[step] = inner(step)
        return datas[step]

    trainer.rollouts.rollouts_for = rollouts_for
    return weights, datas


def _log_probs(model, weights, batch):
    model.load_state_dict(weights)
    with torch.no_grad():
        return forward_log_probs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)[0]


def test_rollouts_of_step_t_come_from_the_weights_of_step_t_minus_2(build_trainer, tiny_tokenizer, make_tiny_model):
    trainer = build_trainer(BASE, staleness=2)
    weights, datas = _capture(trainer)
    records = trainer.train()
    probe = make_tiny_model(tiny_tokenizer)
    for t in (3, 4):
        data, mask = datas[t], datas[t].batch.response_mask.bool()
        assert data.rollout_version.tolist() == [t - 3] * len(data)  # sampled by the weights of step t - 2
        sampler = _log_probs(probe, weights[t - 2], data.batch)
        learner = _log_probs(probe, weights[t], data.batch)
        torch.testing.assert_close(data.rollout_log_prob[mask], sampler[mask], rtol=0, atol=1e-5)
        # old_log_prob is the learner's (proximal policy), not the sampler's
        torch.testing.assert_close(data.old_log_prob[mask], learner[mask], rtol=0, atol=1e-5)
        assert (learner - sampler)[mask].abs().max() > 1e-3  # lr 1e-2 moved the weights: the check can fail
        r = records[t - 1]
        assert r["staleness/min"] == r["staleness/max"] == 2
        expected_kl = float((data.rollout_log_prob.double() - data.old_log_prob.double())[mask].mean())
        assert r["rollout_corr/kl"] == pytest.approx(expected_kl, rel=1e-6)
        w = (data.old_log_prob.double() - data.rollout_log_prob.double())[mask].exp()
        assert r["rollout_corr/behaviour_ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * (w * w).sum())), rel=1e-6)
        assert r["rollout_corr/behaviour_ess"] < 1.0
    assert [r["staleness/mean"] for r in records] == [0, 1, 2, 2]
    assert [r["staleness/token_mean"] for r in records] == [0, 1, 2, 2]  # one version a step: the same figure
    # step 1: sampler = learner (generation's incremental forward vs the full one: rounding only)
    assert abs(records[0]["rollout_corr/kl"]) < 1e-6
    assert records[0]["rollout_corr/behaviour_ess"] == pytest.approx(1.0, abs=1e-9)


def test_kl_of_the_behaviour_policy_to_the_current_weights(build_trainer):
    """rollout_corr/kl_current = mean(rollout_log_prob - log_prob) at each update's forward: with one
    mini-batch the update runs at the weights that computed old_log_prob, so it equals the step's
    KL(behaviour || old); with two, the second mini-batch adds the first update's drift."""
    one = build_trainer(BASE, "one", staleness=2, num_mini_batches=1).train()
    for r in one[1:]:
        assert r["rollout_corr/kl"] != 0
        assert r["rollout_corr/kl_current"] == pytest.approx(r["rollout_corr/kl"], rel=1e-4, abs=1e-7)
    two = build_trainer(BASE, "two", staleness=2).train()
    assert any(abs(r["rollout_corr/kl_current"] - r["rollout_corr/kl"]) > 1e-4 for r in two[1:])


def test_coupled_old_log_prob_is_the_samplers(build_trainer, tiny_tokenizer, make_tiny_model):
    """recompute_old_log_prob=false: old_log_prob and entropy are the sampler's (the weights of
    step t - 2), so the first mini-batch's ratio is pi_t / pi_{t-2}, not 1."""
    trainer = build_trainer(BASE, staleness=2, recompute_old_log_prob=False)
    weights, datas = _capture(trainer)
    records = trainer.train()
    probe = make_tiny_model(tiny_tokenizer)
    for t in (3, 4):
        data, mask = datas[t], datas[t].batch.response_mask.bool()
        sampler = _log_probs(probe, weights[t - 2], data.batch)
        assert torch.equal(data.old_log_prob, data.rollout_log_prob)
        torch.testing.assert_close(data.old_log_prob[mask], sampler[mask], rtol=0, atol=1e-5)
        assert torch.equal(data.entropy, data.batch.rollout_entropy)
        learner = _log_probs(probe, weights[t], data.batch)
        assert (learner - sampler)[mask].abs().max() > 1e-3
        assert records[t - 1]["rollout_corr/kl"] == 0.0  # behaviour = old by construction
        assert records[t - 1]["rollout_corr/behaviour_ess"] == 1.0
        # the first update's ratio is against the sampler: ppo_kl = mean(old - current) over its rows is the drift
        assert abs(records[t - 1]["ppo_kl"]) > 1e-6
    assert records[-1]["entropy"] == pytest.approx(
        float(datas[4].batch.rollout_entropy[datas[4].batch.response_mask.bool()].mean()), rel=1e-5)


def test_coupled_echo_batch_ratio_sees_the_drift_since_sampling(build_trainer):
    """recompute_old_log_prob=false with ECHO: the first mini-batch is not on-policy (old_log_prob
    is the sampler's, two steps old), so its batch ratio R is computed from the current weights'
    log-probs, not copied from old_log_prob (which would make it exactly 1). Recomputed and
    synchronous, the first mini-batch's R is exactly 1."""
    def first_mini_batch_ratios(trainer):
        seen, inner = [], trainer.update_mini_batch

        def update(data, rows, on_policy=False, fill_old=False):
            out = inner(data, rows, on_policy=on_policy, fill_old=fill_old)
            seen.append(out["echo/R_batch"])
            return out

        trainer.update_mini_batch = update
        trainer.train()
        return seen[::2]  # num_mini_batches=2: the first of each step

    coupled = first_mini_batch_ratios(build_trainer(BASE, "c", staleness=2, recompute_old_log_prob=False,
                                                    preset="echo"))
    assert all(abs(r - 1) > 1e-5 for r in coupled[2:])  # steps 3, 4: sampled by the weights of step t - 2
    synchronous = first_mini_batch_ratios(build_trainer(BASE, "s", preset="echo"))
    assert synchronous == [1.0] * 4


def test_coupled_without_lag_matches_the_recomputed_run_closely(run_trainer):
    """staleness=0: the sampler's log-probs equal the recomputed ones up to KV-cache rounding, so
    the coupled run follows the recomputed one (same rollouts at step 1, nearly the same update)."""
    _, recomputed = run_trainer(BASE, "a", steps=2)
    _, coupled = run_trainer(BASE, "b", steps=2, recompute_old_log_prob=False)
    assert coupled[0]["reward/mean"] == recomputed[0]["reward/mean"]
    assert coupled[0]["entropy"] == pytest.approx(recomputed[0]["entropy"], abs=1e-4)
    assert coupled[0]["grad_norm"] == pytest.approx(recomputed[0]["grad_norm"], rel=1e-3)


def test_coupled_without_the_samplers_entropy_is_a_clear_error(build_trainer):
    """A rollout batch that does not carry the sampler's entropy (a generate that did not record
    it) cannot train coupled: the step names the setting instead of failing on None."""
    trainer = build_trainer(BASE, steps=1, recompute_old_log_prob=False)
    inner = trainer.rollouts.rollouts_for

    def without_entropy(step):
        data = inner(step)
        data.batch.rollout_entropy = None
        return data

    trainer.rollouts.rollouts_for = without_entropy
    with pytest.raises(RuntimeError, match="recompute_old_log_prob=false needs the sampler's log-probs and entropy"):
        trainer.train()


def test_coupled_with_a_correction_is_refused(capsys):
    from echotrain.cli import main

    assert main(["train", "recompute_old_log_prob=false", "rollout_correction=token_is"]) == 2
    err = capsys.readouterr().err
    assert "recompute_old_log_prob=False" in err and "rollout_correction='token_is'" in err


@pytest.mark.parametrize("loss_mode", sorted(__import__("echotrain.rl", fromlist=["POLICY_LOSSES"]).POLICY_LOSSES))
def test_every_loss_trains_with_a_lag(run_trainer, loss_mode):
    _, records = run_trainer(BASE, loss_mode=loss_mode, staleness=1, steps=2)
    assert [r["staleness/max"] for r in records] == [0, 1]
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["ppo_kl"]) for r in records)
    assert records[1]["rollout_corr/kl"] != 0  # step 2 trained on step 1's weights' rollouts


def test_lora_with_a_lag_resumes_exactly(run_trainer, tmp_path):
    pytest.importorskip("peft")

    over = dict(BASE, lora_r=4, lora_alpha=8, staleness=2, save_every=2, keep_last=2)
    _, full = run_trainer(over, "full")
    with pytest.raises(Killed):
        run_trainer(over, "killed", callbacks=[kill_at(3)])
    ck = load_checkpoint(latest_checkpoint(tmp_path / "killed"))
    assert all("lora_" in k for k in ck["model"])  # the model part is the adapters; no weight snapshots
    assert [t for t, _ in ck["extra"]["rollouts"]["queue"]] == [3, 4]
    trainer, resumed = run_trainer(over, "killed", resume=True)
    assert trainer.start_step == 2 and strip(resumed) == strip(full)
    with pytest.raises(StalenessMismatch):
        run_trainer({**over, "staleness": 1}, "killed", resume=True)


# ---------------------------------------------------------------------------- the testbed through the CLI
def test_cli_testbed_lag_2_versions_and_log_probs_match_saved_snapshots(monkeypatch, tmp_path):
    """Each checkpoint holds the queue of rollouts generated ahead; a queued batch of step t was
    sampled by the weights of step t - 2, i.e. the checkpoint of step t - 3 (the saved snapshot)."""
    from echotrain.models import load_policy

    run = tmp_path / "lag"
    assert cli(monkeypatch, "train", *TESTBED, "steps=5", "staleness=2", "save_every=1", "keep_last=5",
               f"output_dir={run}") == 0
    ckpts = {int(p.stem.split("_")[1]): load_checkpoint(p) for p in list_checkpoints(run)}
    assert sorted(ckpts) == [1, 2, 3, 4, 5]
    model, _ = load_policy("testbed")
    snapshots = {0: {k: v.clone() for k, v in model.state_dict().items()}, **{s: c["model"] for s, c in ckpts.items()}}
    samples = read_jsonl(run / "samples.jsonl")
    checked = 0
    for s, ck in ckpts.items():
        queue = ck["extra"]["rollouts"]["queue"]
        assert [t for t, _ in queue] == [s + 1, s + 2]  # past steps=5 too: the run can be continued
        for t, data in queue:
            version = max(t - 3, 0)
            assert data.rollout_version.tolist() == [version] * len(data)
            mask = data.batch.response_mask.bool()
            behaviour = _log_probs(model, snapshots[version], data.batch)
            # recorded inside generation (KV-cache steps) vs one full forward: float32 rounding only
            torch.testing.assert_close(data.rollout_log_prob[mask], behaviour[mask], rtol=0, atol=5e-5)
            if version < s:  # the learner at the checkpoint is another policy: the comparison can fail
                other = _log_probs(model, snapshots[s], data.batch)
                assert (other - data.rollout_log_prob)[mask].abs().max() > 1e-4
                checked += 1
            # what step t trained on is this queued batch: its samples are among the batch's texts
            assert {r["completion"] for r in samples if r["step"] == t} <= set(data.texts)
    assert checked >= 3
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["staleness/max"] for r in records] == [0, 1, 2, 2, 2]


def test_cli_testbed_same_seed_same_lag_bit_identical(monkeypatch, tmp_path):
    runs = {}
    for name, k in (("a", 2), ("b", 2), ("sync", 0)):
        assert cli(monkeypatch, "train", *TESTBED, "steps=4", f"staleness={k}", f"output_dir={tmp_path / name}") == 0
        runs[name] = (strip(read_jsonl(tmp_path / name / "metrics.jsonl")),
                      read_jsonl(tmp_path / name / "samples.jsonl"),
                      load_checkpoint(latest_checkpoint(tmp_path / name))["model"])
    a, b, sync = runs["a"], runs["b"], runs["sync"]
    assert a[0] == b[0] and a[1] == b[1] and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    assert a[1][:2] == sync[1][:2]  # step 1 samples the same prompts with the same (initial) weights
    assert any(not torch.equal(a[2][k], sync[2][k]) for k in a[2])  # the lag changes the run
    assert not any(k.startswith("staleness/") for k in sync[0][0])  # the synchronous record is unchanged


def test_cli_continuing_a_finished_run_keeps_the_lag(monkeypatch, tmp_path, capsys):
    """Issue 40: 3 steps at staleness=2, then ``--resume RUN steps=6``, restarted the lag (staleness
    0, 1, 2, 0, 1, 2). The final checkpoint now holds the next 2 steps' rollouts: the continued run
    is the uninterrupted 6-step run (staleness 0, 1, 2, 2, 2, 2; metrics, samples and weights)."""
    full, cont = tmp_path / "full", tmp_path / "cont"
    assert cli(monkeypatch, "train", *TESTBED, "steps=6", "staleness=2", f"output_dir={full}") == 0
    assert cli(monkeypatch, "train", *TESTBED, "steps=3", "staleness=2", f"output_dir={cont}") == 0
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(cont), "steps=6") == 0
    assert "generated ahead" not in capsys.readouterr().err  # nothing to say: the lag continues
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(cont / "metrics.jsonl")
    assert [r["staleness/max"] for r in b] == [r["staleness/min"] for r in b] == [0, 1, 2, 2, 2, 2]
    assert strip(b) == strip(a)
    assert read_jsonl(cont / "samples.jsonl") == read_jsonl(full / "samples.jsonl")
    wa, wb = load_checkpoint(latest_checkpoint(full))["model"], load_checkpoint(latest_checkpoint(cont))["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cli_resume_of_a_short_queue_says_the_lag_restarts(monkeypatch, tmp_path, capsys):
    """A checkpoint whose queue stops at its last step (written by an echotrain before the change):
    the resume generates the missing batches with the current weights and its first line says so."""
    run = tmp_path / "old"
    assert cli(monkeypatch, "train", *TESTBED, "steps=3", "staleness=2", f"output_dir={run}") == 0
    path = latest_checkpoint(run)
    ck = torch.load(path, weights_only=False)
    ck["extra"]["rollouts"]["queue"], ck["extra"]["rollouts"]["next_target"] = [], 4  # the old format
    torch.save(ck, path)
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(run), "steps=6") == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("echotrain: run directory") and (
        "staleness=2: the checkpoint holds 0 of the 2 batches generated ahead" in first
        and "steps 4-5 are sampled by the weights of step 4 instead" in first), first
    assert [r["staleness/max"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 0, 1, 2]


def test_cli_resume_with_another_staleness_exits_2(monkeypatch, tmp_path, capsys):
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TESTBED, "steps=2", "staleness=1", "save_every=1", f"output_dir={run}") == 0
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(run), "steps=3", "staleness=0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "written with staleness=1 and this run has staleness=0" in err[0]  # before loading


@pytest.mark.slow
def test_cli_kill_9_then_resume_gives_the_uninterrupted_run(monkeypatch, tmp_path):
    """A subprocess running ``echotrain train staleness=2`` is killed with SIGKILL mid-run, then
    ``--resume`` finishes it: metrics, samples and weights equal the uninterrupted run's."""
    steps = 16
    args = [*TESTBED, f"steps={steps}", "staleness=2", "save_every=2", "keep_last=1"]
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "train", *args, f"output_dir={killed}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    metrics = killed / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:  # mid-step 6, checkpoint 4 written
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    done = len(read_jsonl(metrics))
    assert done < steps
    assert cli(monkeypatch, "train", "--resume", str(killed)) == 0
    full = tmp_path / "full"
    assert cli(monkeypatch, "train", *args, f"output_dir={full}") == 0
    assert strip(read_jsonl(killed / "metrics.jsonl")) == strip(read_jsonl(full / "metrics.jsonl"))
    assert read_jsonl(killed / "samples.jsonl") == read_jsonl(full / "samples.jsonl")
    a = load_checkpoint(latest_checkpoint(full))["model"]
    b = load_checkpoint(latest_checkpoint(killed))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kill_and_resume_with_a_lag_is_exact(run_trainer, tmp_path):
    """The short version of the SIGKILL test: the run stops after step 3's metrics (before its
    checkpoint), the resume from the step-2 checkpoint (with its queue) gives the full run."""

    over = dict(BASE, staleness=2, save_every=2, keep_last=1, steps=5)
    _, full = run_trainer(over, "full")
    with pytest.raises(Killed):
        run_trainer(over, "killed", callbacks=[kill_at(3)])
    trainer, resumed = run_trainer(over, "killed", resume=True)
    assert trainer.start_step == 2 and strip(resumed) == strip(full)
    a = load_checkpoint(latest_checkpoint(tmp_path / "full"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "killed"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- echotrain compare
def test_compare_arms_and_sweeps_set_staleness(tmp_path):
    from echotrain.compare.config import expand_cells, load_spec

    data = {"name": "lag", "output_dir": str(tmp_path / "cmp"), "seeds": 1, "baseline": "sync[staleness=0]",
            "base": {"steps": 4, "model": "x"}, "arms": {"sync": {"preset": "grpo"}},
            "sweep": {"name": "staleness", "keys": ["staleness"], "values": [0, 2]}}
    cells = expand_cells(load_spec(None, [], data=data))
    assert [(c.arm, c.config.staleness) for c in cells] == [("sync[staleness=0]", 0), ("sync[staleness=2]", 2)]
    data = {**data, "baseline": "sync", "sweep": None,
            "arms": {"sync": {"preset": "grpo"}, "lag4": {"preset": "grpo", "staleness": 4}}}
    data.pop("sweep")
    assert [c.config.staleness for c in expand_cells(load_spec(None, [], data=data))] == [0, 4]
    with pytest.raises(ConfigError, match="staleness=-2: must be >= 0"):
        expand_cells(load_spec(None, [], data={**data, "arms": {"sync": {"staleness": -2}}, "baseline": "sync"}))


def test_token_weighted_staleness_by_hand():
    """Rollouts of different ages and lengths in one step (async can mix them): the per-sample mean
    (0 + 2 + 2) / 3 against the token-weighted (0 * 4 + 2 * 1 + 2 * 1) / 6; a step without tokens
    falls back to the per-sample mean."""
    from types import SimpleNamespace

    from echotrain.train.lag import staleness_summary

    data = SimpleNamespace(rollout_version=torch.tensor([4, 2, 2]),
                           response_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0]]))
    out = staleness_summary(5, data)  # step 5: the learner's version is 4
    assert out == {"staleness/min": 0.0, "staleness/mean": pytest.approx(4 / 3), "staleness/max": 2.0,
                   "staleness/token_mean": pytest.approx(4 / 6)}
    empty = SimpleNamespace(rollout_version=torch.tensor([4, 2]), response_mask=torch.zeros(2, 3))
    assert staleness_summary(5, empty)["staleness/token_mean"] == 1.0
