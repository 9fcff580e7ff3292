"""The compare grid runner: cells are plain run directories run as ``echotrain train`` subprocesses;
a re-invocation skips finished cells and resumes a killed one exactly."""

import json

import pytest

from echotrain.compare.config import expand_cells, load_spec
from echotrain.compare.runner import cell_status, run_cells
from echotrain.train.metrics import NONDETERMINISTIC_PREFIXES, read_jsonl


@pytest.fixture
def tiny_dir(tmp_path, tiny_tokenizer, make_tiny_model):
    """The tiny Llama + char tokenizer saved as a local model folder (prompts of the default task fit 512)."""
    path = tmp_path / "tiny"
    make_tiny_model(tiny_tokenizer, max_position_embeddings=512).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def strip(r):
    return {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}


def test_grid_runs_skips_done_and_resumes_killed(tmp_path, tiny_dir):
    data = {"name": "t", "output_dir": str(tmp_path / "cmp"), "seeds": 2,
            "base": {"model": str(tiny_dir), "task": "default", "steps": 3, "prompts_per_step": 2,
                     "num_generations": 4, "max_new_tokens": 6, "eval_prompts": 2, "save_every": 1, "keep_last": 5,
                     "save_final_model": False, "plots": False},
            "arms": {"echo": {"preset": "echo", "num_mini_batches": 2}}}
    spec = load_spec(None, [], data=data)
    cells = expand_cells(spec)
    logs = []
    out = run_cells(spec, cells, jobs=2, log=logs.append)
    assert out == {"echo__s0": "ok", "echo__s1": "ok"}
    for c in cells:  # ordinary run directories
        assert cell_status(c) == "done"
        for name in ("config.yaml", "metrics.jsonl", "eval.jsonl", "stability.json", "cell.json", "train.log"):
            assert (c.run_dir / name).is_file(), name
        assert [r["step"] for r in read_jsonl(c.run_dir / "metrics.jsonl")] == [1, 2, 3]
        stab = json.loads((c.run_dir / "stability.json").read_text())
        assert stab["flags"]["nan"] is False and stab["steps"] == 3
        # the held-out accuracy flag reads eval.jsonl: from the step-0 evaluation to the last
        assert stab["flags"]["accuracy_collapse"] in (True, False)
        assert stab["values"]["accuracy_collapse"]["start_step"] == 0
        assert stab["values"]["accuracy_collapse"]["end_step"] == 3
    done, killed = cells
    full = read_jsonl(killed.run_dir / "metrics.jsonl")
    done_mtime = (done.run_dir / "metrics.jsonl").stat().st_mtime_ns
    # "kill" cell 1 after its step-2 checkpoint: no step-3 checkpoint, no step-3 logs, no stability.json
    (killed.run_dir / "checkpoints" / "step_00000003.pt").unlink()
    (killed.run_dir / "stability.json").unlink()
    for name in ("metrics.jsonl", "eval.jsonl"):
        rows = read_jsonl(killed.run_dir / name)
        (killed.run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 2))
    assert cell_status(killed) == "resume"
    logs.clear()
    out = run_cells(spec, expand_cells(spec), jobs=2, log=logs.append)
    assert out == {"echo__s0": "done before", "echo__s1": "ok"}
    assert any("1 done, 1 to resume, 0 new" in m for m in logs)
    assert (done.run_dir / "metrics.jsonl").stat().st_mtime_ns == done_mtime  # not rerun
    assert "--resume" in (killed.run_dir / "train.log").read_text()
    resumed = read_jsonl(killed.run_dir / "metrics.jsonl")
    assert [strip(r) for r in resumed] == [strip(r) for r in full]  # exact resume
