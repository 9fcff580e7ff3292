"""The CPU testbed: byte tokenizer, testbed task, deterministic cached warm-up, one RL step on it.

A tiny testbed (d_model 32, a few warm-up steps) keeps this fast; the documented one is measured
in docs/testbed.md.
"""

from __future__ import annotations

import json

import pytest
import torch

from echotrain.models import ByteTokenizer
from echotrain.models import testbed as tb
from echotrain.models.testbed import TestbedConfig, build_testbed, ensure_testbed, load_testbed
from echotrain.tasks import get_task
from echotrain.tasks.testbed import TestbedTask, is_heldout, prompt_of

TINY = TestbedConfig(train_examples=512, d_model=32, n_heads=2, n_layers=1, max_steps=6, eval_every=3,
                     eval_problems=16, batch_size=16, warmup_steps=2)


def test_byte_tokenizer_pads_left_and_round_trips():
    from echotrain.runtime.rollout import encode_prompts

    tok = ByteTokenizer()
    enc = tok(["1+2=", "81-88="])
    assert enc["input_ids"].tolist() == [[0, 0, 49, 43, 50, 61], [56, 49, 45, 56, 56, 61]]
    assert enc["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    # like a Hugging Face tokenizer: one string without tensors gives a flat list (the prompt encoder relies on it)
    assert tok("1+2=", return_tensors=None)["input_ids"] == [49, 43, 50, 61]
    assert encode_prompts(tok, ["1+2=", "81-88="])[0].tolist() == enc["input_ids"].tolist()
    assert tok.decode([45, 55, 10, 0, 0], skip_special_tokens=True) == "-7"
    assert tok.decode([45, 55, 10]) == "-7\n" and tok.eos_token_id == 10 and len(tok) == 256
    with pytest.raises(ValueError, match="must differ"):
        ByteTokenizer(eos_token_id=0, pad_token_id=0)


def test_testbed_task_format_splits_and_exact_integer_reward():
    assert prompt_of("81 - 88") == "81-88="
    train, test = get_task("testbed", size=300), get_task("testbed").eval_task()
    ex = train[0]
    assert ex.messages == ex.question and ex.messages.endswith("=") and " " not in ex.messages
    assert int(ex.answer) == eval(ex.messages[:-1])  # noqa: S307 - the gold answer is the arithmetic value
    assert not any(is_heldout(e.metadata["expression"]) for e in train)
    test_exprs = [e.metadata["expression"] for e in test]
    assert all(map(is_heldout, test_exprs)) and len(set(test_exprs)) == len(test_exprs) == 512
    assert train.score(ex.answer, ex) == 1.0 and train.score(f" {ex.answer}\n", ex) == 1.0
    assert train.score(str(int(ex.answer) + 1), ex) == 0.0 and train.score(f"{ex.answer}0", ex) == 0.0
    assert train.score(f"{ex.answer} ", ex) == 1.0 and train.score("", ex) == 0.0 and not train.is_formatted("x7")
    with pytest.raises(ValueError, match="split='dev' is unknown"):
        TestbedTask(split="dev")


def test_tiny_warm_up_is_deterministic_and_cached_atomically(tmp_path):
    m1, r1 = build_testbed(TINY)
    m2, r2 = build_testbed(TINY)
    assert r1["steps"] == r2["steps"] == 6 and r1["history"] == r2["history"]
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    # the key covers every field
    assert tb.testbed_key(TINY) != tb.testbed_key(TestbedConfig(**{**TINY.__dict__, "seed": 1}))
    assert tb.testbed_key(TINY) != tb.testbed_key(TestbedConfig(**{**TINY.__dict__, "lr": 1e-3}))
    logs: list[str] = []
    folder = ensure_testbed(TINY, cache_dir=tmp_path, log=logs.append)
    assert folder.parent == tmp_path / "testbed" and folder.name == tb.testbed_key(TINY)
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt", "testbed.json"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert json.loads((folder / "testbed.json").read_text())["history"] == r1["history"] and logs
    logs.clear()
    model, tok = load_testbed(TINY, cache_dir=tmp_path, log=logs.append)
    assert not logs  # cached: no rebuild
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m1.state_dict().values()))
    assert not model.training and isinstance(tok, ByteTokenizer) and model.testbed_report["steps"] == 6


def test_one_off_policy_rl_step_on_the_testbed(tmp_path):
    from echotrain.train.config import resolve_config
    from echotrain.train.trainer import Trainer

    model, tok = load_testbed(TINY, cache_dir=tmp_path, log=lambda s: None)
    cfg = resolve_config(overrides=dict(
        task="testbed", task_options={"size": 64}, preset="echo", echo_pessimistic=True, steps=1,
        prompts_per_step=4, num_generations=4, num_mini_batches=2, max_new_tokens=6, lr=1e-2, eval_prompts=8,
        device="cpu", progress=False, plots=False, save_final_model=False, output_dir=str(tmp_path / "run")))
    trainer = Trainer(cfg, model=model, tokenizer=tok)
    assert isinstance(trainer.eval_task, TestbedTask) and trainer.eval_task.split == "test"
    (record,) = trainer.train()
    assert record["optimizer_steps"] == 2 and 1 <= record["response_length/max"] <= 6
    assert "pg_echo_unscaled_frac" in record and 0 <= record["eval/accuracy"] <= 1
    assert record["echo/R_batch_min"] == pytest.approx(1.0, abs=1e-6)  # first mini-batch is on-policy


def test_concurrent_callers_build_once(tmp_path):
    import threading

    logs: list[str] = []
    threads = [threading.Thread(target=ensure_testbed, args=(TINY,), kwargs=dict(cache_dir=tmp_path, log=logs.append))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(line.startswith("building") for line in logs) == 1
    assert (tb.testbed_dir(TINY, tmp_path) / "model.pt").is_file()


def test_cli_builds_with_overrides_and_load_policy_routes_testbed(tmp_path, capsys, monkeypatch):
    from echotrain.cli import main
    from echotrain.models import load_policy

    overrides = [f"{k}={v}" for k, v in dict(train_examples=512, d_model=32, n_heads=2, n_layers=1, max_steps=6,
                                               eval_every=3, eval_problems=16, batch_size=16, warmup_steps=2).items()]
    assert main(["testbed", "--cache-dir", str(tmp_path), *overrides]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(tb.testbed_dir(TINY, tmp_path)) and out["steps"] == 6
    with pytest.raises(SystemExit, match="d_model must be an int >= 1"):
        main(["testbed", "--cache-dir", str(tmp_path), "d_model=0"])
    seen = {}
    monkeypatch.setattr(tb, "load_testbed", lambda **kw: seen.update(kw) or ("model", "tok"))
    assert load_policy("testbed", cache_dir=tmp_path) == ("model", "tok") and seen["cache_dir"] == tmp_path


def test_a_forced_rebuild_swaps_the_folder_without_a_gap(tmp_path, monkeypatch):
    """``ensure_testbed(force=True)`` over a cached folder: the live folder is never deleted (it
    was ``rmtree(final)`` then ``os.replace``: between them no folder existed), every removal or
    rename finds a complete folder there, and the new build ends up in place."""
    import os
    import shutil
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the gap-free swap is Linux's renameat2 exchange (elsewhere: one rename's gap)")
    builds = iter([1, 2])

    def fake_build(cfg, log=None, cache_dir=None):
        return torch.nn.Linear(1, 1), {"build": next(builds), "steps": 1, "accuracy": 0.0, "seconds": 0.0}

    monkeypatch.setattr(tb, "build_testbed", fake_build)
    final = ensure_testbed(TINY, cache_dir=tmp_path)
    assert json.loads((final / "testbed.json").read_text())["build"] == 1
    seen = []
    for mod, name in ((shutil, "rmtree"), (os, "rename"), (os, "replace")):
        real = getattr(mod, name)

        def spy(path, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, str(path), (final / "testbed.json").is_file()))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(mod, name, spy)
    assert ensure_testbed(TINY, cache_dir=tmp_path, force=True) == final
    monkeypatch.undo()
    assert json.loads((final / "testbed.json").read_text())["build"] == 2
    assert [s for s in seen if s[1] == str(final) and s[0] == "rmtree"] == []
    assert [s for s in seen if not s[2]] == []
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name, f"{final.name}.lock"]
