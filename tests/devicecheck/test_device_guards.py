"""CPU-side guards of the CUDA path (issue 34): no hard-coded CPU device where a CUDA run passes
through, every CUDA-only branch named by a device check, and the pure math run on the ``meta``
device (a tensor created on the CPU inside a function meets a meta input there and fails)."""

from __future__ import annotations

import shutil
import textwrap

import pytest
import torch

from echotrain.devicecheck import CHECKS, CUDA_BRANCHES
from echotrain.devicecheck.scan import (ALLOWED_CPU, PACKAGE_ROOT, cuda_branches, hard_coded_cpu, scan_package,
                                        unexplained_cpu)

SYNTHETIC = textwrap.dedent('''
    import torch

    def update(batch, device):
        a = torch.device("cpu")                       # 1: a device object
        b = batch.to("cpu")                           # 2: .to
        c = torch.zeros(3, device="cpu")              # 3: device= keyword
        d = x.to(device="cpu" if flag else device)    # 4: a conditional choice
        g = torch.Generator("cpu")                    # 5: a generator's device
        device = "cpu"                                # 6: assigned to a *device name
        with torch.random.fork_rng(devices=[]):       # 7: the CPU generator only
            pass
        if batch.device.type == "cpu":                # a test, not a choice
            pass
        return batch.cpu(), torch.load(f, map_location=device)

    def load(path, map_location="cpu"):              # 8: a parameter default
        return path

    class Step:
        def run(self, x):
            return x.to("cuda") if x.is_cuda else x

    def sync(device):
        if device.type == "cuda":
            torch.cuda.synchronize()
        ok = torch.cuda.is_available() and device.index
''')


def test_the_scanner_finds_every_planted_cpu_choice_and_nothing_else():
    found = hard_coded_cpu(SYNTHETIC, "train/fake.py")
    assert [(f.where, f.line) for f in found] == [
        ("train/fake.py:load", 17),
        ("train/fake.py:update", 5), ("train/fake.py:update", 6), ("train/fake.py:update", 7),
        ("train/fake.py:update", 8), ("train/fake.py:update", 9), ("train/fake.py:update", 10),
        ("train/fake.py:update", 11)]
    assert found[1].what == 'torch.device("cpu")'


def test_the_scanner_finds_cuda_only_branches_by_function():
    found = cuda_branches(SYNTHETIC, "m.py")
    assert sorted({f.where for f in found}) == ["m.py:Step.run", "m.py:sync"]
    assert [f.line for f in found if f.where == "m.py:sync"] == [25, 27]


def test_no_hard_coded_cpu_device_outside_the_explained_places():
    """Every place where the package picks "cpu" as a device is in ALLOWED_CPU with the reason
    it is right on a CUDA run too, and every allowance still matches a place (none stale)."""
    cpu, _ = scan_package()
    assert unexplained_cpu(cpu) == []
    assert set(ALLOWED_CPU) == {f.where for f in cpu}


def test_a_planted_cpu_device_in_a_training_path_fails_the_guard(tmp_path):
    """A copy of the package with ``torch.device("cpu")`` planted in train/update.py: the guard
    reports exactly that place."""
    root = tmp_path / "echotrain"
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.gguf"))
    path = root / "train" / "update.py"
    path.write_text(path.read_text() + "\n\ndef planted(batch):\n    return batch.to(torch.device('cpu'))\n")
    bad = unexplained_cpu(scan_package(root)[0])
    assert [f.where for f in bad] == ["train/update.py:planted"]


def test_every_cuda_only_branch_is_reached_by_a_named_device_check():
    """The functions with a CUDA-only branch are exactly the keys of CUDA_BRANCHES, and each
    names a check of ``echotrain device-check``."""
    _, cuda = scan_package()
    assert {f.where for f in cuda} == set(CUDA_BRANCHES)
    assert set(CUDA_BRANCHES.values()) <= set(CHECKS)


META = torch.device("meta")


def _meta_batch(B: int = 6, T: int = 5):
    mask = torch.ones(B, T, dtype=torch.bool, device=META)
    return mask, torch.zeros(B, T, device=META), torch.zeros(B, T, device=META)


def _pure_math_on_meta():
    """The pure functions that run without a host sync, on meta inputs (name, output)."""
    from echotrain import rl
    from echotrain.optim import quant
    from echotrain.rl import aggregation, shaping, surrogate

    mask, log_prob, adv = _meta_batch()
    out = [(f"agg_weights {m}", aggregation.agg_weights(mask, m, advantages=adv, norm_constant=5.0))
           for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                     "token-sum")]
    out += [(f"kl {k}", rl.kl_penalty(log_prob, log_prob, k)) for k in sorted(rl.KL_ESTIMATORS)]
    out.append(("clamped_log_ratio", surrogate.clamped_log_ratio(log_prob, log_prob, 20.0, mask)))
    out.append(("ppo_clip_loss", surrogate.ppo_clip_loss(log_prob.exp(), adv, 0.2, 0.28, 3.0)[0]))
    out.append(("truncated_response_mask", shaping.truncated_response_mask(mask, torch.zeros(6, dtype=torch.bool,
                                                                                           device=META))))
    out.append(("weighted_sum", rl.weighted_sum(log_prob, mask, torch.ones(6, device=META))))
    out.append(("quantize_de", quant.quantize_de(torch.zeros(4096, device=META))))
    out.append(("hash_uniform", quant.hash_uniform(torch.arange(10, device=META), 3)))
    return out


def test_pure_math_keeps_the_device_of_its_inputs():
    results = _pure_math_on_meta()
    assert len(results) >= 12
    assert [name for name, t in results if t.device != META] == []


def test_a_cpu_tensor_made_inside_a_function_fails_on_meta():
    """What the meta run catches: a mask built with a CPU ``arange`` against a device input."""
    mask, _, _ = _meta_batch()
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.arange(mask.shape[1]) < mask.sum(-1, keepdim=True)
    assert (torch.arange(mask.shape[1], device=mask.device) < mask.sum(-1, keepdim=True)).device == META
