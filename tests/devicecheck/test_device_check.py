"""``echotrain device-check``: its CPU dry run through the real CLI (every check of the GPU
script on the testbed with tiny settings), the summary it writes, and how it reports failures."""

from __future__ import annotations

import json

import pytest

from echotrain.cli import main


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    rc = main(["device-check", "--dry-run", "--out", str(out)])
    return rc, json.loads((out / "summary.json").read_text()), out


def test_the_dry_run_passes_every_check_but_vllm(dry_run):
    rc, summary, out = dry_run
    status = {name: row["status"] for name, row in summary["checks"].items()}
    assert rc == 0 and summary["passed"], {k: v.get("error") for k, v in summary["checks"].items()}
    assert status == {"default_job": "passed", "placement": "passed", "optimizers": "passed", "decode": "passed",
                      "resume": "passed", "torchrun": "passed", "trl_vllm": "skipped", "overlap": "passed"}
    assert summary["checks"]["trl_vllm"]["reason"] == "vLLM needs a CUDA GPU (dry run on the CPU)"
    assert summary["machine"]["dry_run"] is True and summary["machine"]["device"] == "cpu"
    assert "| resume | passed |" in (out / "summary.md").read_text()


def test_the_dry_run_figures(dry_run):
    """The figures the checks assert on: the default job's accuracy rose and it said why it runs
    where it runs; resume is bit-exact on the CPU; the optimizers' state bytes per parameter are
    AdamW's 8 (+ the step counts) and 4-bit's <= 1.07; torchrun recorded its group."""
    checks = dry_run[1]["checks"]
    job = checks["default_job"]
    assert job["eval_accuracy_end"] > job["eval_accuracy_start"]
    assert (job["device"], job["device_reason"], job["autocast"]) == ("cpu", "device=cpu is set", "off")
    assert checks["resume"]["weights_bit_equal"] and checks["resume"]["optimizer_bit_equal"]
    assert checks["resume"]["nondeterministic_ops"] == []
    per = checks["optimizers"]["state_bytes_per_param"]
    assert per["adamw_fused"] == pytest.approx(8.0, abs=1e-3) and 1.0 < per["adamw4bit"] <= 1.07
    assert checks["optimizers"]["adamw4bit_m_code_mismatch"] < 1e-3
    assert checks["placement"]["heavy_ops_by_device"]["cpu"] > 0
    assert (checks["torchrun"]["backend"], checks["torchrun"]["world_sizes"]) == ("gloo", [1])
    assert checks["decode"]["greedy_rows_equal_frac"] == 1.0 and checks["decode"]["sampled_rows_equal_frac"] == 1.0
    assert 3 <= checks["resume"]["killed_after_step"] < 6


def test_a_failing_check_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    import echotrain.devicecheck as dc
    from echotrain.devicecheck.common import CheckFailed, Context

    def failing(ctx):
        raise CheckFailed("figure 3 > bound 2")

    def crashing(ctx):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(dc, "CHECKS", {"a": "x:y", "b": "x:z", "c": "x:w"})
    funcs = {"x:y": failing, "x:z": crashing, "x:w": lambda ctx: {"figure": 1.5}}
    monkeypatch.setattr(dc, "_load", funcs.__getitem__)
    import torch

    summary = dc.run_checks(Context(device=torch.device("cpu"), dry_run=True, out=tmp_path), ["a", "b", "c"])
    assert not summary["passed"]
    rows = summary["checks"]
    assert (rows["a"]["status"], rows["a"]["error"]) == ("failed", "figure 3 > bound 2")
    assert rows["b"]["status"] == "failed" and rows["b"]["error"] == "ZeroDivisionError: boom"
    assert (rows["c"]["status"], rows["c"]["figure"]) == ("passed", 1.5)
    assert "FAILED" in (tmp_path / "summary.md").read_text()


def test_an_unknown_check_is_one_error_line(capsys):
    assert main(["device-check", "--dry-run", "--only", "decode,gpu_magic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["echotrain: error: --only: unknown check(s) gpu_magic; valid: default_job, placement, optimizers, "
                   "decode, resume, torchrun, trl_vllm, overlap"]


def test_the_vllm_check_says_why_it_cannot_run(tmp_path, monkeypatch):
    import importlib.util

    import torch

    from echotrain.devicecheck.common import Context
    from echotrain.devicecheck.trl_check import vllm_unavailable

    cpu = Context(device=torch.device("cpu"), dry_run=True, out=tmp_path)
    assert vllm_unavailable(cpu) == "vLLM needs a CUDA GPU (dry run on the CPU)"
    gpu = Context(device=torch.device("cuda"), dry_run=False, out=tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert vllm_unavailable(gpu) == "vLLM is not installed (pip install -e '.[vllm]')"


def test_the_optimizer_comparison_allows_rare_code_flips_only():
    """Parameters agree when at most 0.1% of elements are beyond rtol 1e-5 / atol 1e-6 (a 4-bit
    code flipped at a near-tie) and none is further off than the steps' bound."""
    import torch

    from echotrain.devicecheck.kernel_checks import _close

    a = torch.zeros(10_000)
    one = a.clone()
    one[7] = 1e-3  # one flipped element: 0.01%
    many = a.clone()
    many[:20] = 1e-3  # 0.2%
    far = a.clone()
    far[3] = 0.05
    assert _close([a], [a], bound=0.03) == (True, 0.0, 0.0)
    assert _close([a], [one], bound=0.03) == (True, pytest.approx(1e-3), 1e-4)
    assert _close([a], [many], bound=0.03)[0] is False
    assert _close([a], [far], bound=0.03)[0] is False


def test_a_non_cuda_device_is_refused_on_a_gpu_machine(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["device-check", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("echotrain: error: --device 'cpu': the device check tests a CUDA GPU "
                                               "(cuda or cuda:N); --dry-run runs it on the CPU")
