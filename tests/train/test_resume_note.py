"""``echotrain train --resume`` says in its startup output which checkpoint it continued from and
which logged steps after it it dropped from metrics.jsonl (and samples.jsonl, eval.jsonl), to run
them again (issue 40 item 7). Through the real CLI, the testbed policy, tiny settings."""

from __future__ import annotations

import json

from echotrain import cli

TINY = ["model=testbed", "task=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=4",
        "micro_batch_size=8", "eval_prompts=2", "eval_every=0", "num_threads=1", "progress=false", "plots=false",
        "save_final_model=false", "log_samples=1"]


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_names_its_checkpoint_and_the_dropped_steps(tmp_path, monkeypatch, testbed_cache, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert cli.main(["train", *TINY, "steps=4", "save_every=2", "keep_last=2", f"output_dir={run}"]) == 0
    # the step-4 checkpoint is lost (as after a kill while writing it): steps 3-4 are logged past step 2's
    (run / "checkpoints" / "step_00000004.pt").unlink()
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4] and _steps(run / "eval.jsonl") == [0, 4]
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr().err.splitlines()
    start = next(i for i, line in enumerate(err) if line.startswith("echotrain: run directory"))
    assert err[start + 1] == (f"echotrain: resumed from {run / 'checkpoints' / 'step_00000002.pt'} (step 2); dropped "
                              "steps 3-4 logged after it from metrics.jsonl, samples.jsonl, eval.jsonl: they are run "
                              "again")
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4] and _steps(run / "eval.jsonl") == [0, 4]
    # a continuation of a finished run drops nothing, and says so
    assert cli.main(["train", "--resume", str(run), "steps=5"]) == 0
    err = capsys.readouterr().err
    assert (f"echotrain: resumed from {run / 'checkpoints' / 'step_00000004.pt'} (step 4); nothing was logged after "
            "it\n") in err
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5]
