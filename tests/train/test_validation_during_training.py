"""Validation during training: sampled evaluation with avg@n / pass@n, keep_best, early stopping
(issue 39 item 4), through the trainer and the CLI."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from echotrain.cli import main
from echotrain.train.best import BestTracker
from echotrain.train.metrics import read_jsonl

BASE = dict(steps=4, prompts_per_step=4, num_generations=4, max_new_tokens=6, micro_batch_size=8,
            num_mini_batches=1, lr=1e-2, device="cpu", progress=False, plots=False, save_final_model=False,
            log_samples=0, seed=0, eval_prompts=4, eval_every=1, save_every=0)


@pytest.fixture
def run(run_trainer):
    return functools.partial(run_trainer, BASE)


def test_best_tracker_rule_and_state():
    t = BestTracker("eval/accuracy", patience=2)
    assert [t.update(s, {"eval/accuracy": v}) for s, v in [(0, 0.2), (1, 0.5), (2, 0.5), (3, 0.4)]] == [
        True, True, False, False]
    assert t.should_stop and t.best == 0.5 and t.best_step == 1
    u = BestTracker("eval/accuracy", patience=2)
    u.load_state_dict(t.state_dict())
    assert (u.best, u.best_step, u.since) == (0.5, 1, 2)
    assert not BestTracker("eval/accuracy").should_stop  # patience 0: never
    with pytest.raises(ValueError, match="best_metric"):
        BestTracker("reward/mean")


def test_sampled_evaluation_reports_avg_and_pass_at_n(run, tmp_path):
    trainer, recs = run("samp", steps=1, eval_n=4, eval_temperature=1.0, eval_top_p=0.9)
    evals = read_jsonl(tmp_path / "samp" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1]
    for e in evals:
        assert 0 <= e["eval/accuracy"] <= e["eval/pass@n"] <= 1
    assert recs[-1]["eval/pass@n"] == evals[-1]["eval/pass@n"]


def script_evaluations(monkeypatch, accuracies):
    """Make ``Trainer.evaluate`` log and return ``accuracies`` in turn (step 0 first)."""
    from echotrain.train import trainer as trainer_mod

    values = iter(accuracies)

    def fake_evaluate(self, step):
        out = {"eval/accuracy": next(values), "eval/format_rate": 1.0}
        self.logger.log_eval({"step": step, **out, "eval/prompts": 4, "time/eval": 0.0})
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "evaluate", fake_evaluate)


def test_early_stop_and_keep_best(run, tmp_path, monkeypatch):
    # a scripted evaluation: 0.3 (step 0), 0.6, 0.5, 0.4 -> no new best at steps 2 and 3: stop after 3
    script_evaluations(monkeypatch, [0.3, 0.6, 0.5, 0.4, 0.9])
    trainer, recs = run("stop", steps=6, early_stop_patience=2, keep_best=True)
    assert [r["step"] for r in recs] == [1, 2, 3]
    d = tmp_path / "stop"
    assert json.loads((d / "best" / "best.json").read_text()) == {"step": 1, "metric": "eval/accuracy", "value": 0.6}
    assert [p.name for p in (d / "best" / "checkpoints").iterdir()] == ["step_00000001.pt"]
    assert (d / "checkpoints" / "step_00000003.pt").exists()  # the stop step's checkpoint
    best = torch.load(d / "best" / "checkpoints" / "step_00000001.pt", weights_only=False)
    assert best["step"] == 1 and best["extra"]["best"]["best"] == 0.6
    last = torch.load(d / "checkpoints" / "step_00000003.pt", weights_only=False)
    assert last["extra"]["best"] == {"best": 0.6, "best_step": 1, "since": 2}


def test_the_step_0_evaluation_is_not_a_best_candidate(run, tmp_path, monkeypatch):
    """As best_metric's help says: the untrained policy's evaluation (0.9 here, the highest) is no
    candidate; the first best is step 1's 0.5, and patience counts from there."""
    script_evaluations(monkeypatch, [0.9, 0.5, 0.4, 0.3, 0.2])
    _, recs = run("zero", steps=6, early_stop_patience=2, keep_best=True)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert json.loads((tmp_path / "zero" / "best" / "best.json").read_text())["step"] == 1


def test_a_new_best_restarts_the_patience_count():
    t = BestTracker("eval/accuracy", patience=2)
    for s, v in [(1, 0.5), (2, 0.4), (3, 0.6), (4, 0.6)]:
        t.update(s, {"eval/accuracy": v})
    # 0.4 did not improve (1), 0.6 did (back to 0), the equal 0.6 did not (1): not yet 2 in a row
    assert (t.best, t.best_step, t.since) == (0.6, 3, 1) and not t.should_stop


def _scripted_evaluation(monkeypatch, values):
    from echotrain.train import trainer as trainer_mod

    it = iter(values)

    def fake_evaluate(self, step):
        out = {"eval/accuracy": next(it), "eval/format_rate": 1.0}
        self.logger.log_eval({"step": step, **out, "eval/prompts": 4, "time/eval": 0.0})
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "evaluate", fake_evaluate)


def test_patience_running_out_at_the_last_step_is_no_early_stop_and_keep_best_off_writes_no_best(
        run, tmp_path, monkeypatch, capsys):
    # step 0: 0.3 (not judged), steps 1..3: 0.6, 0.5, 0.4 -> patience 2 runs out at step 3 = steps
    _scripted_evaluation(monkeypatch, [0.3, 0.6, 0.5, 0.4])
    trainer, recs = run("last", steps=3, early_stop_patience=2, keep_best=False)
    assert [r["step"] for r in recs] == [1, 2, 3] and trainer.best.should_stop
    assert "early stop" not in capsys.readouterr().err  # the run simply ended
    assert not (tmp_path / "last" / "best").exists()  # keep_best=false: no best checkpoint


_TINY = ["model=testbed", "task=testbed", "steps=2", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=4", "eval_prompts=4", "eval_every=1", "num_threads=1",
         "save_every=0", "save_final_model=false", "plots=false", "progress=false", "log_samples=0"]


@pytest.mark.usefixtures("real_testbed")
def test_validation_keys_from_the_cli(tmp_path):
    assert main(["train", *_TINY, "eval_n=3", "eval_temperature=1.0", "best_metric=eval/pass@n", "keep_best=true",
                 "early_stop_patience=5", f"output_dir={tmp_path}"]) == 0
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2] and all("eval/pass@n" in e for e in evals)
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["metric"] == "eval/pass@n" and best["value"] == max(e["eval/pass@n"] for e in evals[1:])


@pytest.mark.parametrize("bad,key", [(["eval_n=2"], "eval_n"), (["best_metric=eval/pass@n"], "best_metric"),
                                     (["early_stop_patience=2", "eval_every=0"], "early_stop_patience"),
                                     (["eval_top_p=0"], "eval_top_p")])
def test_bad_validation_settings_exit_2(bad, key, capsys):
    assert main(["train", *_TINY, *bad, "--print-config"]) == 2
    assert key in capsys.readouterr().err
