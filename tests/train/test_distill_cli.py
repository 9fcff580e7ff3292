"""On-policy distillation through the real CLI, offline: the teacher is a testbed run directory
(trained here for 1 step; its latest checkpoint, as the testbed policy writes no final_model/), the student the testbed policy; a teacher with another
tokenizer is exit 2 naming both models."""

from __future__ import annotations

import json

import pytest

from echotrain.cli import main
from tests.train.conftest import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("real_testbed")

TINY = ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=6",
        "micro_batch_size=2", "num_threads=1", "save_every=0", "plots=false", "progress=false", "log_samples=0"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["train", *TINY, "steps=1", "lr=1e-2", "entropy_coeff=0.1", "save_final_model=true", f"output_dir={run}"]) == 0
    # (entropy_coeff: a gradient whatever the rewards, so the teacher differs from the student;
    # the testbed policy has no save_pretrained: the run's teacher is its base model + latest checkpoint)
    assert list((run / "checkpoints").glob("*.pt"))
    return run


@pytest.mark.parametrize("extra", [["objective=distill"], ["objective=distill", "distill_top_k=8"],
                                   ["distill_coeff=0.5", "distill_beta=0.5"]], ids=["exact", "top_k", "rl_term"])
def test_distillation_run_from_a_run_directory(teacher_run, tmp_path, capsys, extra):
    out = tmp_path / "student"
    rc = main(["train", *TINY, "steps=2", "save_final_model=false", f"teacher={teacher_run}", *extra,
               f"output_dir={out}"])
    text = capsys.readouterr()
    assert rc == 0, text.err[-2000:]
    assert "no learning signal" not in text.err or "objective=distill" not in extra
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["distill/kl"] > 0 and r["time/teacher"] > 0 and r["memory/teacher_mb"] > 0
        if "objective=distill" in extra:
            assert r["advantages/abs_mean"] == 0.0 and "pg_clipfrac" not in r
        else:
            assert "pg_clipfrac" in r
    if "distill_top_k=8" in extra:  # (N, T, k) float32 values + int64 ids: 4 x 6 x 8 x 12 bytes at most
        assert recs[0]["memory/teacher_mb"] <= 4 * 6 * 8 * 12 / 2**20


def test_teacher_with_another_tokenizer_is_exit_2(tmp_path, capsys):
    tok = make_tokenizer()
    d = tmp_path / "other-teacher"
    make_model(tok).save_pretrained(d)
    tok.save_pretrained(d)
    rc = main(["train", *TINY, "steps=1", f"teacher={d}", "objective=distill", f"output_dir={tmp_path / 'x'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"teacher='{d}'" in err and "model='testbed'" in err and "same tokenizer" in err
    assert "Traceback" not in err
