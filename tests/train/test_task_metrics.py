"""A task or a reward function adds metrics to each step (issue 36, item 14): ``step_metrics``
returns declared ``reduce="step"`` metrics, the trainer writes them to metrics.jsonl; bad returns
are one-line errors (exit 2). Through the real CLI with the example plugin's task and with a
``reward=`` module written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echotrain.cli import main

pytestmark = pytest.mark.usefixtures("testbed_cache")

PLUGIN_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "plugin_pkg" / "echotrain_example_plugin.py"
# 3 prompts x 2 samples = 6 rows a step, all of them in samples.jsonl (log_samples=6)
TINY = ["model=testbed", "steps=3", "prompts_per_step=3", "num_generations=2", "max_new_tokens=3",
        "num_mini_batches=1", "micro_batch_size=6", "eval_prompts=0", "num_threads=1", "save_every=0",
        "save_final_model=false", "plots=false", "progress=false", "log_samples=6"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_plugin_task_metrics_are_written_each_step(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "task=small_sums", f"plugins=[{PLUGIN_FILE}]", f"output_dir={run}"]) == 0
    records, samples = _jsonl(run / "metrics.jsonl"), _jsonl(run / "samples.jsonl")
    assert len(records) == 3 and len(samples) == 18
    for rec in records:  # recomputed by hand from every completion of the step
        rows = [s for s in samples if s["step"] == rec["step"]]
        carry = [sum(map(int, s["question"].rstrip("=").split("+"))) >= 10 for s in rows]
        assert rec["small_sums/carry_frac"] == pytest.approx(sum(carry) / 6)
        scored = [s["correct"] for s, c in zip(rows, carry) if c]
        if scored:
            assert rec["small_sums/carry_accuracy"] == pytest.approx(sum(scored) / len(scored))
        else:
            assert "small_sums/carry_accuracy" not in rec
    assert 0 < sum(r["small_sums/carry_frac"] for r in records) < 3  # the draws hold both kinds


REWARD = '''
from echotrain.metrics import declare_metric

declare_metric("mine/completion_chars", reduce="step", unit="characters", help="mean length of the completions")
declare_metric("mine/per_token", reduce="token_mean", unit="x", help="a metric of another kind")


def exact(completion, example):
    return float(completion.strip() == example.answer)


def chars(completions, examples, scores):
    return {RETURN}


exact.step_metrics = chars
'''


def _reward_module(tmp_path, monkeypatch, name: str, returned: str) -> str:
    (tmp_path / f"{name}.py").write_text(REWARD.replace("{RETURN}", returned))
    monkeypatch.chdir(tmp_path)
    return f"reward={name}:exact"


def test_reward_function_metrics_are_written(tmp_path, monkeypatch):
    reward = _reward_module(tmp_path, monkeypatch, "reward_ok",
                            '{"mine/completion_chars": sum(map(len, completions)) / len(completions)}')
    run = tmp_path / "run"
    assert main(["train", *TINY, "task=testbed", reward, f"output_dir={run}"]) == 0
    records, samples = _jsonl(run / "metrics.jsonl"), _jsonl(run / "samples.jsonl")
    for rec in records:
        texts = [s["completion"] for s in samples if s["step"] == rec["step"]]
        assert rec["mine/completion_chars"] == pytest.approx(sum(map(len, texts)) / 6)


@pytest.mark.parametrize("name,returned,message", [
    ("reward_undeclared", '{"mine/undeclared": 1.0}', "metric 'mine/undeclared' is not declared: call "
                                                       "echotrain.metrics.declare_metric('mine/undeclared', reduce='step'"),
    ("reward_kind", '{"mine/per_token": 1.0}', "is declared with reduce='token_mean'"),
    ("reward_nan", '{"mine/completion_chars": float("nan")}', "has the value nan; it must be a finite real number"),
    ("reward_builtin", '{"accuracy": 0.5}', "metric 'accuracy' is one of the step's own metrics"),
    ("reward_list", '[1.0]', "returned list, not a mapping"),
])
def test_bad_step_metrics_are_one_line_errors(tmp_path, monkeypatch, capsys, name, returned, message):
    reward = _reward_module(tmp_path, monkeypatch, name, returned)
    rc = main(["train", *TINY, "task=testbed", reward, f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
