"""The length testbed: its task (generator, traces, scorer), the length facts, the shipped weights
(SHA-256 checked on load) and the CLI on ``model=testbed-length task=testbed-length``.

The documented policy's measured facts are in docs/testbed.md; here a tiny warm-up (d_model 32,
a few steps) or the shipped file keeps every test to seconds.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import statistics

import pytest
import torch

from echotrain.models import testbed as tb
from echotrain.models import testbed_weights as tw
from echotrain.tasks import get_task
from echotrain.tasks.testbed_length import (
    WARMUP_MIX,
    LengthTestbedTask,
    clean_length,
    clean_trace,
    is_heldout,
    make_trace,
    parse_answer,
)

TINY_LENGTH = dataclasses.replace(tb.TESTBED_LENGTH_CONFIG, init_from=None, train_examples=256, d_model=32, n_heads=2, n_layers=1,
                                  max_steps=4, eval_every=2, eval_problems=8, batch_size=16, warmup_steps=1,
                                  eval_max_new_tokens=12)


def test_traces_by_hand():
    assert clean_trace([7, 25, 3]) == "7+25=32;32+3=35;#35"
    assert clean_trace([3, 4]) == "3+4=7;#7" and clean_length([3, 4]) == 9  # the shortest response, EOS included
    rng = random.Random(0)
    assert make_trace([7, 25, 3, 14], "skip", rng) in ("7+25+3=35;35+14=49;#49", "7+25=32;32+3+14=49;#49")
    rep = make_trace([7, 25, 3], "repeat", random.Random(1))
    assert rep in ("7+25=32;7+25=32;32+3=35;#35", "7+25=32;32+3=35;32+3=35;#35")
    guesses = {make_trace([7, 25, 3], "guess", random.Random(s)) for s in range(20)}
    assert guesses == {"#35", "7+25=32;#35"}  # j in [0, n - 2] steps, then the sum at once
    assert make_trace([3, 4], "skip", rng) == "3+4=7;#7"  # nothing to merge with two terms
    with pytest.raises(ValueError, match="at least 2 terms"):
        make_trace([5], "clean", rng)
    with pytest.raises(ValueError, match="kind='long' is unknown"):
        make_trace([5, 6], "long", rng)


def test_scorer_correct_wrong_truncated_and_imperfect():
    task = LengthTestbedTask(size=4)
    ex = next(e for e in LengthTestbedTask(size=200) if e.metadata["n_terms"] >= 3)
    terms, gold = ex.metadata["terms"], ex.answer
    assert int(gold) == sum(terms) and ex.messages == "+".join(map(str, terms)) + "="
    full = clean_trace(terms)
    assert task.score(full, ex) == 1.0 and task.score(full + "\n", ex) == 1.0 and task.is_formatted(full)
    assert task.score(full[: full.index("#")], ex) == 0.0  # truncated before the answer line
    assert not task.is_formatted(full[: full.index("#") - 3])
    assert task.score(full[:-1] + str((int(full[-1]) + 1) % 10), ex) == 0.0  # wrong final digit
    for kind in WARMUP_MIX:  # every imperfect warm-up trace still ends with the right sum
        assert task.score(make_trace(terms, kind, random.Random(3)), ex) == 1.0
    # only the final answer counts: a wrong step with the right sum scores 1, a right chain with a wrong sum 0
    assert task.score(f"1+1=3;#{gold}", ex) == 1.0 and task.score(f"#{int(gold) + 1}", ex) == 0.0
    assert task.score(f"#{gold};", ex) == 0.0 and task.score(f"#{gold}#", ex) == 0.0  # something after the answer
    assert parse_answer("12+3=15;#15 ") == "15" and parse_answer("#-3") is None and parse_answer("") is None


def test_generator_ranges_splits_and_options():
    train = get_task("testbed-length", size=2000, seed=0)
    assert isinstance(train, LengthTestbedTask) and train[0].messages == LengthTestbedTask(size=2000)[0].messages
    ns = [e.metadata["n_terms"] for e in train]
    assert min(ns) == 2 and max(ns) == 8
    assert all(1 <= t <= 9 if e.metadata["digits"] == 1 else 10 <= t <= 99 for e in train for t in e.metadata["terms"])
    assert not any(is_heldout(e.messages) for e in train)
    test = train.eval_task()
    prompts = [e.messages for e in test]
    assert test.split == "test" and len(set(prompts)) == len(prompts) == 512 and all(map(is_heldout, prompts))
    small = LengthTestbedTask(size=50, min_terms=3, max_terms=3, max_digits=1)
    assert {e.metadata["n_terms"] for e in small} == {3} and all(len(e.messages) == 6 for e in small)
    with pytest.raises(ValueError, match="min_terms <= max_terms"):
        LengthTestbedTask(min_terms=5, max_terms=4)
    with pytest.raises(ValueError, match="split='dev' is unknown"):
        LengthTestbedTask(split="dev")


def test_length_facts_on_a_small_sample():
    """Clean responses range 9-81 tokens and grow with the problem; the warm-up mix spreads them wider."""
    task = LengthTestbedTask(size=3000, seed=1)
    clean = [e.metadata["clean_length"] for e in task]
    assert min(clean) == 9 and 78 <= max(clean) <= 81 and 35 <= statistics.mean(clean) <= 46
    by_n = {n: statistics.mean(e.metadata["clean_length"] for e in task if e.metadata["n_terms"] == n)
            for n in range(2, 9)}
    assert all(by_n[n] < by_n[n + 1] for n in range(2, 8))  # longer with every term
    rng = random.Random(0)
    warm = [len(task.warmup_target(e, rng)) + 1 for e in task]
    assert min(warm) <= 4 and max(warm) >= 85 and statistics.pstdev(warm) > statistics.pstdev(clean)


def test_the_length_testbed_config_and_cache_key():
    cfg = tb.TESTBED_CONFIGS["testbed-length"]
    assert cfg.task == "testbed-length" and cfg.bucket_by_length and cfg.eval_max_new_tokens >= 81
    assert cfg.init_from is not None and cfg.init_from.init_from is None  # two warm-up stages
    assert cfg.looped_config().n_layers == 2 and tb.TESTBED_CONFIGS["testbed"] == tb.TestbedConfig()
    # fields added later enter the key only off their default: the testbed's cache key is unchanged
    blob = {**dataclasses.asdict(tb.TestbedConfig())}
    for name in tb._ADDED_FIELDS:
        blob.pop(name)
    assert tb._config_fields(tb.TestbedConfig()) == json.loads(json.dumps(blob))
    assert tb.testbed_key(cfg) != tb.testbed_key(dataclasses.replace(cfg, bucket_by_length=False))
    with pytest.raises(ValueError, match="not a testbed task"):
        tb.TestbedConfig(task="gsm8k")


def test_tiny_length_warm_up_is_deterministic_and_trains_on_traces():
    m1, r1 = tb.build_testbed(TINY_LENGTH)
    m2, r2 = tb.build_testbed(TINY_LENGTH)
    assert r1["steps"] == 4 and r1["history"] == r2["history"]
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    lengths = torch.tensor([5, 1, 4, 2, 3, 9, 8, 7])
    batches = tb._length_buckets(lengths, 2, torch.Generator().manual_seed(0), pool_batches=4)
    epoch = [next(batches) for _ in range(4)]
    assert sorted(torch.cat(epoch).tolist()) == list(range(8))  # each example once an epoch
    assert all(abs(int(lengths[b[0]]) - int(lengths[b[1]])) <= 2 for b in epoch)  # neighbours in length


def test_shipped_weights_load_with_their_hash(tmp_path, monkeypatch):
    entries = tw.manifest()
    assert set(entries) >= {"testbed"}
    total = sum(e["bytes"] for e in entries.values())
    assert total < 6_000_000  # a few MB for all shipped testbeds
    for name, entry in entries.items():
        path = tw.verify(name)
        assert tw.file_sha256(path) == entry["sha256"] and entry["config"] == json.loads(
            json.dumps(dataclasses.asdict(tb.TESTBED_CONFIGS[name])))
        model, tok = tb.load_testbed(tb.TESTBED_CONFIGS[name], cache_dir=tmp_path)  # never builds: shipped
        assert model.testbed_report["source"] == "shipped" and model.testbed_report["sha256"] == entry["sha256"]
        assert model.num_params() == entry["report"]["num_params"] and not list(tmp_path.iterdir())
        assert tw.weights_sha256(model) == entry["sha256"]  # same weights -> same bytes
    # a damaged file is refused, naming both hashes
    bad = tmp_path / "weights"
    shutil.copytree(tw.WEIGHTS_DIR, bad)
    target = bad / entries["testbed"]["file"]
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(tw.WeightsError, match="differs from the manifest"):
        tw.verify("testbed", bad)
    monkeypatch.setattr(tw, "WEIGHTS_DIR", bad)
    from echotrain.train.config import ConfigError
    from echotrain.runtime.preflight import check_model

    with pytest.raises(ConfigError, match="model=testbed: shipped weights .* differs"):
        check_model("testbed")


def test_export_and_prefer_shipped(tmp_path):
    model, report = tb.build_testbed(TINY_LENGTH)
    entry = tw.export("tiny", model, TINY_LENGTH, {**report, "key": "k"}, tmp_path)
    assert entry["sha256"] == tw.file_sha256(tmp_path / "tiny.safetensors") == tw.weights_sha256(model)
    assert tw.shipped_entry(TINY_LENGTH, tmp_path)[0] == "tiny" and tw.shipped_entry(tb.TestbedConfig(), tmp_path) is None
    again = tb.LoopedTransformer(TINY_LENGTH.looped_config())
    tw.load_into(again, tw.verify("tiny", tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_cli_train_smoke_on_the_length_testbed(tmp_path, monkeypatch):
    """``echotrain train model=testbed-length task=testbed-length`` runs offline (the tiny policy
    stands in for the shipped one to keep it to seconds)."""
    from echotrain.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(tb.TESTBED_CONFIGS, "testbed-length", TINY_LENGTH)
    monkeypatch.setenv("ECHOTRAIN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    rc = main(["train", "model=testbed-length", "task=testbed-length", "steps=2", "prompts_per_step=2",
               "num_generations=4", "max_new_tokens=16", "micro_batch_size=8", "eval_prompts=4", "eval_every=0",
               "num_threads=1", "progress=false", "plots=false", "save_final_model=false", "save_every=0",
               f"output_dir={out}"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "response_length/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(1 <= r["response_length/max"] <= 16 for r in steps)


def test_length_facts_by_hand():
    from echotrain.train.length_stats import length_facts

    lengths = torch.tensor([10, 20, 30, 40, 12, 14])
    correct = torch.tensor([1, 0, 1, 0, 1, 1])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    f = length_facts(lengths, correct, groups)
    assert f["mean"] == pytest.approx(21.0) and f["min"] == 10 and f["max"] == 40
    assert f["var"] == pytest.approx(sum((x - 21.0) ** 2 for x in (10, 20, 30, 40, 12, 14)) / 6)
    assert f["mean_correct"] == pytest.approx(16.5) and f["mean_wrong"] == pytest.approx(30.0)
    assert f["gap"] == pytest.approx(-13.5)
    assert f["within_group_gap"] == pytest.approx(-10.0)  # groups 0 and 1: -10 each; group 2 is not mixed
    assert f["mixed_groups"] == pytest.approx(2 / 3) and f["accuracy"] == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="1-D of one length"):
        length_facts(lengths, correct[:3], groups)
    with pytest.raises(ValueError, match="NaN or Inf"):
        length_facts(torch.tensor([1.0, float("nan")]), torch.tensor([1, 0]), torch.tensor([0, 0]))


def test_configs_resolve_and_the_compare_plan_lists_its_arms(tmp_path, capsys):
    from pathlib import Path

    from echotrain.cli import main
    from echotrain.train.config import load_yaml, resolve_config

    root = Path(__file__).resolve().parents[2]
    cfg = resolve_config(load_yaml(root / "configs" / "testbed_length.yaml"))
    assert cfg.model == cfg.task == "testbed-length" and cfg.max_new_tokens < 81  # the longest chains truncate
    assert main(["compare", str(root / "configs" / "compare" / "testbed_length.yaml"), "--dry-run",
                 f"output_dir={tmp_path / 'cmp'}"]) == 0
    plan = capsys.readouterr().out
    assert "20 cells" in plan and all(arm in plan for arm in ("grpo", "echo", "dapo_nods", "gspo"))


def test_a_warm_up_in_stages_continues_from_the_cached_parent(tmp_path):
    child = dataclasses.replace(TINY_LENGTH, init_from=TINY_LENGTH, seed=1, max_steps=2)
    folder = tb.ensure_testbed(child, cache_dir=tmp_path, log=lambda s: None)
    assert tb.testbed_dir(TINY_LENGTH, tmp_path).is_dir()  # the parent was built (and cached) first
    report = json.loads((folder / "testbed.json").read_text())
    assert report["stage_steps"] == [4, 2] and report["steps"] == 2
    assert tb.testbed_key(child) != tb.testbed_key(dataclasses.replace(child, init_from=None))
    # the child starts from the parent's weights: with lr -> 0 it stays there
    frozen = dataclasses.replace(child, lr=1e-12)
    parent, _ = tb.load_testbed(TINY_LENGTH, cache_dir=tmp_path)
    model, _ = tb.build_testbed(frozen, cache_dir=tmp_path)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.state_dict().values(), parent.state_dict().values()))
    with pytest.raises(ValueError, match="init_from must be a TestbedConfig of the same network"):
        dataclasses.replace(TINY_LENGTH, init_from=dataclasses.replace(TINY_LENGTH, d_model=64))


def test_docs_commands_show_the_shipped_policy_and_train_from_it(tmp_path, capsys, monkeypatch):
    """``echotrain testbed --model testbed-length`` (docs/testbed.md) shows the shipped file without
    building; ``echotrain train --config configs/testbed_length.yaml`` runs a step from it, offline."""
    from pathlib import Path

    from echotrain.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ECHOTRAIN_CACHE", str(tmp_path / "cache"))  # nothing there: the shipped file is used
    assert main(["testbed", "--model", "testbed-length"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "shipped" and shown["sha256"] == tw.manifest()["testbed-length"]["sha256"]
    assert shown["num_params"] == 426_624
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    assert main(["train", "--config", str(root / "configs" / "testbed_length.yaml"), "preset=echo", "steps=1",
                 "eval_prompts=16", "eval_every=1", "progress=false", f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and 1 <= rows[-1]["response_length/max"] <= 72 and 0 <= rows[-1]["eval/accuracy"] <= 1
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.pt"))  # never built


def test_check_steps_scores_skips_and_guesses_wrong_and_repeats_right():
    """check_steps=True: hand-made chains of 7+25+3+14 (sum 49)."""
    from echotrain.tasks import Example
    from echotrain.tasks.testbed_length import steps_are_clean

    strict = LengthTestbedTask(size=4, check_steps=True)
    loose = LengthTestbedTask(size=4)
    ex = Example(messages="7+25+3+14=", question="7+25+3+14=", answer="49", task="testbed-length", index=0,
                 metadata={"terms": [7, 25, 3, 14]})
    cases = {"7+25=32;32+3=35;35+14=49;#49": 1.0,             # clean
             "7+25=32;7+25=32;32+3=35;35+14=49;#49": 1.0,     # a line repeated: harmless
             "7+25=32;32+3=35;32+3=35;35+14=49;#49 ": 1.0,
             "7+25+3=35;35+14=49;#49": 0.0,                   # a skipped step
             "7+25=32;#49": 0.0, "#49": 0.0,                  # guesses
             "7+25=32;32+3=36;36+14=49;#49": 0.0,             # a wrong partial sum
             "7+25=32;32+3=35;35+14=49;#48": 0.0,             # a clean chain, a wrong answer
             "7+25=32;32+3=35;7+25=32;35+14=49;#49": 0.0}     # not in order
    for text, want in cases.items():
        assert strict.score(text, ex) == want, text
        assert loose.score(text, ex) == float(text.strip().endswith("#49")), text
    assert steps_are_clean("3+4=7;#7", [3, 4]) and not steps_are_clean("3+4=7", [3, 4])
    for kind, want in (("clean", 1.0), ("repeat", 1.0), ("skip", 0.0), ("guess", 0.0)):  # the warm-up's kinds
        assert strict.score(make_trace([7, 25, 3, 14], kind, random.Random(1)), ex) == want, kind
    assert strict.eval_task().check_steps and not loose.eval_task().check_steps
    with pytest.raises(ValueError, match="check_steps must be true or false"):
        LengthTestbedTask(check_steps="yes")
