"""The metric schema (echotrain.metrics): every key a run writes is declared, every built-in
declaration is written by some configured run, and docs/metrics.md is the generated list."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from echotrain.cli import main
from echotrain.metrics import METRICS, REDUCTIONS, StepMetrics, declare_metric, reduce_updates

# model=testbed: the cached testbed policy (slow when it must be built; tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_testbed")

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
_BUILTIN = ("import json; from echotrain.train.metrics import builtin_metrics; builtin_metrics(); "
            "from echotrain.metrics import METRICS, markdown_table; "
            "print(json.dumps({'names': list(METRICS), 'table': markdown_table()}))")
#: runs that together switch on every condition a built-in metric is written under
RUNS = {
    "echo-flags-kl-sam-eval": ["loss_mode=echo", "echo_pessimistic=true", "echo_token_clip=truncate", "kl_coef=0.01",
                               "optimizer=sam", "eval_prompts=2", "eval_every=1", "eval_n=2", "eval_temperature=1.0"],
    "clip_cov-entropy": ["loss_mode=clip_cov", "entropy_coeff=0.001"],
    "vespo": ["loss_mode=vespo"],
    "corrections-staleness": ["rollout_correction=token_is,token_mask,rejection", "rollout_is_batch_normalize=true",
                              "rollout_is_threshold_lower=0.5", "staleness=1", "steps=2"],
    "async": ["async_rollouts=true", "num_threads=2", "steps=2"],
    "episodes": ["task=testbed-calc", "env=calculator", "max_turns=2"],
    "distill": ["teacher=testbed", "objective=distill", "distill_top_k=8"],
}
_TINY = ["model=testbed", "task=testbed", "steps=1", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=2", "num_threads=1", "save_every=0", "save_final_model=false",
         "plots=false", "progress=false", "log_samples=0"]


@pytest.fixture(scope="module")
def builtin():
    """The built-in declarations, from a fresh process (no test's or plugin's registrations)."""
    out = subprocess.run([sys.executable, "-c", _BUILTIN], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_written_keys_are_declared_and_every_declaration_is_written(tmp_path, builtin):
    written: set[str] = set()
    for name, tokens in RUNS.items():
        run = tmp_path / name
        assert main(["train", *_TINY, *tokens, f"output_dir={run}"]) == 0
        for f in ("metrics.jsonl", "eval.jsonl"):
            for line in (run / f).read_text().splitlines():
                written |= set(json.loads(line)) - {"step"}
    assert sorted(written - set(METRICS)) == []  # written without a declaration
    assert sorted(set(builtin["names"]) - written) == []  # declared, never written by any configured run


def test_docs_metric_list_is_the_generated_table(builtin):
    text = DOC.read_text()
    assert builtin["table"] in text, "docs/metrics.md is stale: regenerate it with echotrain.metrics.markdown_table()"


def test_reductions_by_declaration_hand_values():
    """token_mean weights by tokens, mean takes the step value, min/max/sum over micro-batches and
    ranks; over optimizer steps as declared (of= derives min/max); undeclared keys are refused."""
    with METRICS.restoring():
        for name, red in (("t/tok", "token_mean"), ("t/mean", "mean"), ("t/min", "min"), ("t/sum", "sum"),
                          ("t/last", "last")):
            declare_metric(name, reduce=red, unit="u", help="h")
        declare_metric("t/mean_max", reduce="max", of="t/mean", unit="u", help="h")
        rank0, rank1 = StepMetrics(), StepMetrics()
        rank0.add({"t/tok": 1.0, "t/mean": 0.9, "t/min": 3.0, "t/sum": 1.0, "t/last": 5.0}, 1.0)
        rank0.add({"t/tok": 4.0, "t/mean": 0.9, "t/min": 2.0, "t/sum": 2.0, "t/last": 6.0}, 3.0)
        rank1.add({"t/tok": 0.0, "t/mean": 0.9, "t/min": 7.0, "t/sum": 4.0, "t/last": 7.0}, 4.0)
        rank0.merge(rank1)
        step = rank0.result()
        assert step == {"t/tok": (1 * 1 + 4 * 3 + 0 * 4) / 8, "t/mean": 0.9, "t/min": 2.0, "t/sum": 7.0, "t/last": 6.0}
        out = reduce_updates([{"t/mean": 0.9, "t/last": 1.0, "t/sum": 1.0}, {"t/mean": 1.1, "t/last": 2.0, "t/sum": 2.0}])
        assert out == {"t/last": 2.0, "t/mean": pytest.approx(1.0), "t/mean_max": 1.1, "t/sum": 3.0}
        with pytest.raises(ValueError, match="'t/undeclared' has no declaration"):
            StepMetrics().add({"t/undeclared": 1.0}, 1.0)
        with pytest.raises(ValueError, match="already declared differently"):
            declare_metric("t/tok", reduce="sum", unit="u", help="h")
        assert declare_metric("t/tok", reduce="token_mean", unit="u", help="h") is METRICS["t/tok"]
    assert "t/tok" not in METRICS and set(REDUCTIONS) == {"token_mean", "mean", "min", "max", "sum", "last", "step"}
