"""The calculator testbed (``model=testbed-calc task=testbed-calc env=calculator``): splits, the
warm-up's worked tool uses (the environment's reply not trained), and token continuity between
the warm-up's sequences and the episodes RL plays."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from echotrain.envs import get_env_factory
from echotrain.models import testbed as tb
from echotrain.models.byte_tokenizer import ByteTokenizer
from echotrain.runtime.episodes import EPISODE_STATS, run_episodes
from echotrain.tasks import get_task
from echotrain.tasks.testbed_calc import TOOL_SHARE, CalcTestbedTask, _held_out, tool_trace


def test_splits_are_disjoint_and_all_keeps_every_draw():
    train = CalcTestbedTask(size=2000, seed=0, split="train")
    test = CalcTestbedTask(size=300, seed=0, split="test")
    q = lambda task: {task[i].question for i in range(len(task))}  # noqa: E731
    assert not q(train) & q(test) and len(test) == 300
    for task, held in ((train, False), (test, True)):
        for i in range(0, len(task), 97):
            a, op, b = task[i].question.rstrip("=").partition("+") if "+" in task[i].question else \
                task[i].question.rstrip("=").partition("-")
            assert _held_out(int(a), op, int(b)) is held
    assert CalcTestbedTask(size=5, seed=3)[0].question == CalcTestbedTask(size=5, seed=3, split="all")[0].question
    assert CalcTestbedTask(size=5, seed=0, split="train").eval_task().split == "test"
    with pytest.raises(ValueError, match="split='dev' is unknown"):
        CalcTestbedTask(split="dev")


def test_tool_trace_and_the_warm_up_mix():
    segs = tool_trace("4817+2933", "7750")
    assert segs == [('<tool_call>{"name":"calculator","arguments":{"expression":"4817+2933"}}</tool_call>\n', True),
                    ("<tool_response>7750</tool_response>\n", False), ("7750", True)]
    task = CalcTestbedTask(size=400, seed=0, split="train")
    rng = random.Random(0)
    targets = [task.warmup_target(task[i], rng) for i in range(400)]
    tools = [t for t in targets if not isinstance(t, str)]
    assert abs(len(tools) / 400 - TOOL_SHARE) < 0.08
    assert all(t == task[i].answer for i, t in enumerate(targets) if isinstance(t, str))


def test_the_environment_reply_is_input_not_target():
    tok = ByteTokenizer()
    ids, labels = tb._encode_examples([("1+2=", tool_trace("1+2", "3")), ("1+2=", "3")], tok)
    row = tok.decode([i for i in ids[0].tolist() if i != tok.pad_token_id])
    assert row == '1+2=<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>\n' \
                  "<tool_response>3</tool_response>\n3\n"
    trained = "".join(chr(b) if b >= 0 else "_" for b in labels[0].tolist()[:len(row)])
    reply = "<tool_response>3</tool_response>\n"
    call = row[4:row.index(reply)]
    assert trained == "_" * 4 + call + "_" * len(reply) + "3\n"
    assert tok.decode([b for b in labels[1].tolist() if b >= 0]) == "3\n"  # a bare answer: as before


def test_warm_up_sequences_are_the_episodes_rl_plays(monkeypatch):
    """A policy that writes the trace's trained segments as its turns, in the calculator
    environment, produces exactly the warm-up's sequence (prompt, call, the environment's reply as
    the episode runtime renders it, answer): the warm-up teaches the format RL samples in."""
    from tests.runtime.test_episodes import _scripted_bytes

    example = CalcTestbedTask(size=1, seed=4, split="train")[0]
    segs = tool_trace(example.question.rstrip("="), example.answer)
    tok = _scripted_bytes(monkeypatch, [segs[0][0], segs[2][0] + "\n"])  # the trace's trained segments as turns
    res = run_episodes(torch.nn.Linear(1, 1), tok, [example], 1, get_env_factory("calculator"), max_new_tokens=96,
                       max_turns=2, max_episode_tokens=256)
    b = res.batch
    stats = dict(zip(EPISODE_STATS, b.episode_stats[0].tolist()))
    assert (stats["turns"], stats["tool_calls"], stats["tool_errors"]) == (2, 1, 0)
    assert res.final_texts == [example.answer]
    n = int(b.attended_mask[0].sum())
    episode = b.prompt_ids[0][b.prompt_mask[0].bool()].tolist() + b.response_ids[0, :n].tolist()
    ids, labels = tb._encode_examples([(example.messages, segs)], tok)
    assert episode == [i for i in ids[0].tolist() if i != tok.pad_token_id]
    p = len(tok.encode(example.messages))
    trained = (labels[0, p:p + n] >= 0).float()
    assert torch.equal(trained, b.response_mask[0, :n])  # trained bytes = the model's tokens


def test_the_calc_testbed_config():
    cfg = tb.TESTBED_CONFIGS["testbed-calc"]
    assert cfg.task == "testbed-calc" and cfg.init_from == tb.TestbedConfig() and cfg.max_steps == 1500
    assert cfg.target_accuracy == 1.0  # no early stop: the single-turn check scores a tool call 0
    tiny = dataclasses.replace(cfg, init_from=None, train_examples=64, batch_size=8, max_steps=3, eval_every=3,
                               eval_problems=4)
    model, report = tb.build_testbed(tiny)
    assert report["steps"] == 3 and len(report["history"]) == 1
    assert get_task("testbed-calc", split="test", size=4, seed=0)[0].metadata["split"] == "test"


@pytest.mark.parametrize("tool", [True, False], ids=["with_tool", "alone"])
def test_docs_commands_train_from_the_shipped_calc_policy(tmp_path, capsys, monkeypatch, tool):
    """``echotrain testbed --model testbed-calc`` shows the shipped file; ``echotrain train --config
    configs/testbed_calc.yaml`` runs a step of episodes from it (and, with ``env=null``, of single
    completions), offline, evaluating as it trains."""
    import json
    from pathlib import Path

    from echotrain.cli import main
    from echotrain.models import testbed_weights as tw

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ECHOTRAIN_CACHE", str(tmp_path / "cache"))  # nothing there: the shipped file is used
    assert main(["testbed", "--model", "testbed-calc"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "shipped" and shown["sha256"] == tw.manifest()["testbed-calc"]["sha256"]
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    extra = [] if tool else ["env=null"]
    assert main(["train", "--config", str(root / "configs" / "testbed_calc.yaml"), "preset=echo", "steps=1",
                 "prompts_per_step=2", "num_generations=4", "num_mini_batches=1", "eval_prompts=4", "eval_every=1",
                 "progress=false",
                 *extra, f"output_dir={out}"]) == 0
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["step"] == 1 and 0 <= row["eval/accuracy"] <= 1
    assert ("episode/tool_calls" in row) is tool
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.pt"))  # never built


def test_the_held_out_tenth_is_not_tied_to_the_answer():
    """Every last digit of the answer, for both operators, in both splits at about a tenth each
    (a hash of the answer's digits would hold out only some)."""
    from collections import Counter

    for split in ("train", "test"):
        task = CalcTestbedTask(size=4000, seed=0, split=split)
        for op in "+-":
            digits = Counter(abs(int(e.answer)) % 10 for e in task if op in e.question[1:])
            total = sum(digits.values())
            assert set(digits) == set(range(10)) and all(0.06 < n / total < 0.14 for n in digits.values()), (split, op)
    held = sum(_held_out(a, "+", b) for a in range(1000, 1100) for b in range(2000, 2100))
    assert 0.08 < held / 10_000 < 0.12
