"""The testbeds' measurement scripts (docs/testbed.md shows their commands) run as a user runs
them, in a subprocess, on a few problems, and their numbers are consistent with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args, "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_measure_testbed_calc_reports_the_within_group_gap(tmp_path):
    facts = _run("measure_testbed_calc.py", "--problems", "24", "--samples", "4", tmp_path=tmp_path)
    mixed = facts["sampled_mixed_groups"]
    assert facts["sampled_within_group_gap_groups"] == round(mixed * 24)  # one gap per mixed group
    assert facts["sampled_within_group_gap_groups"] > 1
    # the shipped policy's right answers are tool calls (~84 bytes), its wrong ones mostly bare answers
    assert facts["sampled_within_group_gap_mean"] > 20 and facts["sampled_within_group_gap_sd"] > 0
    assert facts["sampled_pooled_gap"] > 20
    assert 0 < facts["sampled_accuracy_with_tool"] and facts["greedy_accuracy_alone"] == 0.0
