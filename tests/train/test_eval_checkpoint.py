"""pass@k, evaluation, atomic checkpoints and RNG round trips."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from echotrain.runtime.checkpoints import list_checkpoints, load_checkpoint
from echotrain.runtime.sampling_stats import pass_at_k
from echotrain.train.checkpoint import rng_state, save_checkpoint, set_rng_state
from echotrain.train.evaluate import evaluate


def test_pass_at_k_closed_forms():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0  # n - c < k
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # agrees with the product form of Chen et al. (2021)
    n, c, k = 20, 4, 5
    assert pass_at_k(n, c, k) == pytest.approx(1 - np.prod(1 - k / np.arange(n - c + 1, n + 1)))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_evaluate_tiny_model(tiny_model, tiny_tokenizer, digit_task):
    res = evaluate(tiny_model, tiny_tokenizer, digit_task, num_prompts=6, n=4, ks=(1, 4), max_new_tokens=8,
                   temperature=1.0, batch_prompts=4)
    assert res["num_prompts"] == 6 and res["n"] == 4
    assert res["pass@1"] == pytest.approx(res["accuracy"])  # unbiased pass@1 = mean correctness
    assert res["accuracy"] <= res["pass@4"] <= 1
    with pytest.raises(ValueError, match="k=5"):
        evaluate(tiny_model, tiny_tokenizer, digit_task, num_prompts=2, n=4, ks=(5,))


def test_checkpoint_atomic_keep_last_and_rng(tmp_path, tiny_model):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=tiny_model, optimizer=opt, scheduler=sched, data_state={"draws": step},
                        keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000002.pt", "step_00000003.pt"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]  # no leftovers
    state = load_checkpoint(tmp_path / "checkpoints" / names[-1])
    assert state["step"] == 3 and state["data"] == {"draws": 3}
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.pt")
    s = rng_state()
    assert {"python", "numpy", "torch"} <= set(s) and not math.isnan(float(torch.rand(())))


def test_checkpoint_write_is_durable(tmp_path, tiny_model, monkeypatch):
    """fsync of the new file before the rename, of the folder after it (the rename itself is
    durable only then), and of the folder again after old checkpoints are removed."""
    import os
    import stat

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(tmp_path, 1, model=tiny_model, optimizer=opt, scheduler=None, data_state={})
    assert events == ["fsync file", "replace", "fsync dir"]
    events.clear()
    save_checkpoint(tmp_path, 2, model=tiny_model, optimizer=opt, scheduler=None, data_state={}, keep_last=1)
    assert events == ["fsync file", "replace", "fsync dir", "fsync dir"]  # the last one: step 1 removed
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt"]
