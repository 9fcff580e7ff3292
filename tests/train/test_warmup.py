"""The supervised warm-up on an environment's demonstrations (``sft_steps``, train/warmup.py): rows
encoded exactly as episodes, the loss a token mean exact under micro-batching, the CLI, resume."""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest
import torch

from echotrain.envs.calculator import CalculatorEnv
from echotrain.envs.base import EnvReply
from echotrain.runtime.checkpoints import latest_checkpoint
from echotrain.train.metrics import read_jsonl
from echotrain.train.warmup import (WarmupError, demonstration_rows, encode_demonstration, file_rows,
                                    read_demonstrations, reference_completion, sft_warmup)
from tests.train.test_episodes_cli import TINY
from tests.train.test_staleness import cli, strip


class SayEnv:
    """A chat environment in the tiny tokenizer's alphabet: one demonstrated exchange
    (``call d`` -> tool ``ok d`` -> the answer)."""

    def reset(self, example):
        return [{"role": "system", "content": "be brief"}] + list(example.messages)

    def step(self, completion: str) -> EnvReply:
        return EnvReply(done=True)

    def demonstration(self, example, answer):
        return [{"role": "assistant", "content": f"call {example.answer}"},
                {"role": "tool", "content": f"ok {example.answer}"},
                {"role": "assistant", "content": answer}]


def test_reference_completion_by_answer_format(digit_task):
    ex = digit_task[3]
    assert reference_completion(digit_task, ex) == "<answer>3</answer>"

    class Boxed:
        answer_format = "boxed"

    class Own:
        answer_format = "integer"

        def reference_completion(self, example):
            return f"= {example.answer}"

    assert reference_completion(Boxed(), ex) == "\\boxed{3}"
    assert reference_completion(Own(), ex) == "= 3"
    assert reference_completion(type("Bare", (), {"answer_format": "integer"})(), ex) == "3"


def test_chat_rows_are_the_episode_trajectory(tiny_model, tiny_tokenizer, digit_task):
    """Prompt (generation prompt included) | model turn + EOS | the environment's delta | answer +
    EOS; with a char-level tokenizer that is the template's rendering of the whole conversation up
    to the last EOS, and the targets are exactly the model turns' characters and EOS ids."""
    ex = digit_task[7]
    (ids, labels), = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, [ex], SayEnv)[0]
    convo = SayEnv().reset(ex) + SayEnv().demonstration(ex, "<answer>7</answer>")
    text = tiny_tokenizer.apply_chat_template(convo, tokenize=False)
    want = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == want  # ends with the last assistant turn's EOS (</s>), as an episode's last turn
    targets = [t for t, lab in zip(ids, labels) if lab != -100]
    assert all(lab in (-100, t) for t, lab in zip(ids, labels))  # a target is the id at its own position
    def chars(seq):
        return "".join(tiny_tokenizer.convert_ids_to_tokens(seq))

    assert chars(targets) == "call 7</s><answer>7</answer></s>"
    # the environment's "ok 7" and the prompt are inputs only
    assert "tool:ok 7</s>" in chars(ids) and "ok" not in chars(targets)
    first = next(i for i, lab in enumerate(labels) if lab != -100)
    assert chars(ids[:first]).endswith("<s>assistant:")


def test_a_demonstration_the_task_does_not_score_is_dropped(tiny_model, tiny_tokenizer, digit_task):
    class Wrong(SayEnv):
        def demonstration(self, example, answer):
            return [{"role": "assistant", "content": "x"}]  # contains no digit: scores 0

    class Nothing(SayEnv):
        def demonstration(self, example, answer):
            return None

    for env in (Wrong, Nothing):
        rows, dropped, too_long = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, [digit_task[1]], env)
        assert rows == [] and dropped == 1 and too_long == 0
    with pytest.raises(ValueError, match="none of 2 examples has a demonstration the task scores 1"):
        sft_warmup(tiny_model, tiny_tokenizer, digit_task, Nothing, steps=1, batch_size=2, lr=1e-3, seed=0,
                   micro_batch_size=2)

    class Bare:
        def reset(self, example):
            return example.messages

    with pytest.raises(ValueError, match="has no demonstration"):
        demonstration_rows(tiny_model, tiny_tokenizer, digit_task, [digit_task[1]], Bare)


def test_step_loss_is_the_token_mean_over_the_batch_and_micro_batches_agree(make_tiny_model, tiny_tokenizer,
                                                                           digit_task):
    """losses[0] = HF's cross-entropy of the whole batch (mean over every target token of every
    row) before the step; micro-batches of 1 give the same loss and the same weights as one of 4."""
    results = {}
    for mbs in (4, 1):
        model = make_tiny_model(tiny_tokenizer)
        if mbs == 4:  # the reference: the first step's 4 rows, as sft_warmup draws them
            examples = digit_task.sample(12, 0 + 7919)  # steps x batch_size drawn, shuffled, 4 a step
            every = demonstration_rows(model, tiny_tokenizer, digit_task, examples, SayEnv)[0]
            order = list(range(12))
            random.Random(7919).shuffle(order)
            rows = [every[i] for i in order[:4]]
            width = max(len(r[0]) for r in rows)
            ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
            lab = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
            attn = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
            with torch.no_grad():
                want = float(model(input_ids=ids, attention_mask=attn, labels=lab).loss)
        res = sft_warmup(model, tiny_tokenizer, digit_task, SayEnv, steps=3, batch_size=4, lr=1e-2, seed=0,
                         micro_batch_size=mbs, max_grad_norm=0.0)
        results[mbs] = (res, torch.cat([p.detach().flatten() for p in model.parameters()]))
    (a, wa), (b, wb) = results[4], results[1]
    assert a.losses[0] == pytest.approx(want, rel=1e-5)
    assert a.losses == pytest.approx(b.losses, rel=1e-5) and torch.allclose(wa, wb, atol=1e-5)
    assert a.losses[-1] < a.losses[0] - 0.1  # it learns (lr 1e-2 on the tiny model)
    assert a.examples == 12 and a.dropped == 0


def test_testbed_rows_are_the_shipped_warmups_bytes():
    """On the calculator testbed a demonstration is byte for byte the worked tool use its shipped
    weights were warmed up on (tasks/testbed_calc.py: tool_trace), targets included: the weights
    predict it (low loss)."""
    from echotrain.models import load_policy
    from echotrain.models.testbed import _encode_examples
    from echotrain.tasks import get_task
    from echotrain.tasks.testbed_calc import tool_trace

    model, tok = load_policy("testbed-calc", dtype=torch.float32, device="cpu")
    task = get_task("testbed-calc", split="train")
    examples = task.sample(3, 0)
    rows, dropped, too_long = demonstration_rows(model, tok, task, examples, CalculatorEnv)
    assert dropped == 0 and too_long == 0
    for (ids, labels), ex in zip(rows, examples):
        ref_ids, ref_lab = _encode_examples([(ex.messages, tool_trace(ex.question.rstrip("="), ex.answer))], tok)
        assert ids == ref_ids[0].tolist() and labels == ref_lab[0].tolist()
    res = sft_warmup(model, tok, task, CalculatorEnv, steps=1, batch_size=8, lr=1e-6, seed=0, micro_batch_size=8)
    assert res.losses[0] < 0.2


def test_cli_warm_up_then_rl_and_resume_rebuilds_the_kl_reference(monkeypatch, tmp_path, capsys):
    """``sft_steps`` through the CLI on the calculator testbed: the warm-up's record in run_info.json
    and its line; with a KL reference (the warmed-up policy) a run resumed from step 1's checkpoint
    ends where the uninterrupted one does."""
    (tmp_path / "parity.py").write_text("def reward(completion, example):\n    return float(len(completion) % 2)\n")
    monkeypatch.chdir(tmp_path)  # a reward that varies within groups: the updates are not zero
    args = [*TINY, "model=testbed-calc", "task=testbed-calc", "env=calculator", "max_turns=2", "max_new_tokens=96",
            "sft_steps=2", "sft_batch_size=4", "sft_lr=1e-4", "kl_coef=0.1", "save_every=1", "keep_last=3",
            "num_generations=4", "lr=1e-3", "temperature=1.5", "reward=parity:reward"]
    full = tmp_path / "full"
    assert cli(monkeypatch, "train", *args, "steps=2", f"output_dir={full}") == 0
    assert "warm-up: 2 supervised steps on 8 demonstrations of env=calculator" in capsys.readouterr().err
    info = json.loads((full / "run_info.json").read_text())["warmup"]
    assert info["steps"] == 2 and info["examples"] == 8 and info["too_long"] == 0
    assert 0 < info["loss_first"] < 0.2  # the policy knows the format
    part = tmp_path / "part"
    shutil.copytree(full, part)
    latest_checkpoint(part).unlink()
    assert cli(monkeypatch, "train", "--resume", str(part)) == 0
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert strip(a) == strip(b)
    # the reference is the warmed-up policy: step 1's one update starts at it (KL exactly 0), step 2 has moved
    assert a[0]["kl/ref"] == pytest.approx(0.0, abs=1e-7) and a[1]["kl/ref"] > 1e-6
    assert all(r["grad_norm"] > 0 for r in a)
    assert json.loads((part / "run_info.json").read_text())["warmup"]["loss_first"] == info["loss_first"]


def test_resume_without_a_reference_does_not_warm_up_again(monkeypatch, tmp_path, capsys):
    args = [*TINY, "model=testbed-calc", "task=testbed-calc", "env=calculator", "max_turns=2", "max_new_tokens=96",
            "sft_steps=1", "sft_batch_size=2", "save_every=1", "steps=1"]
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *args, f"output_dir={run}") == 0
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(run), "steps=2") == 0
    assert "warm-up" not in capsys.readouterr().err
    assert "checkpoint" in json.loads((run / "run_info.json").read_text())["warmup"]["note"]


@pytest.mark.parametrize("over, message", [
    (["sft_steps=2"], "sft_steps=2: warms up on an environment's demonstrations or a file's: set env=<name> or "
                      "sft_data=<file.jsonl> too"),
    (["env=feedback", "sft_steps=2"], "env='feedback' demonstrates no worked episode to warm up on"),
    (["env=calculator", "sft_steps=-1"], "sft_steps=-1: must be >= 0"),
    (["env=calculator", "sft_steps=1", "sft_lr=0"], "sft_lr=0.0: must be > 0"),
    (["env=calculator", "sft_steps=1", "sft_batch_size=0"], "sft_batch_size=0: must be >= 1"),
])
def test_bad_warmup_settings_exit_2_with_one_line(monkeypatch, tmp_path, capsys, over, message):
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", *over, "steps=1", f"output_dir={tmp_path / 'r'}") == 2
    assert message in capsys.readouterr().err


def test_two_steps_equal_a_hand_written_loop(make_tiny_model, tiny_tokenizer, digit_task):
    """sft_warmup's weights after 2 steps = AdamW (weight decay 0) on the step's shuffled rows, the
    gradient of the token-mean cross-entropy clipped to norm 0.05 (active), zeroed every step."""
    model, ref = make_tiny_model(tiny_tokenizer), make_tiny_model(tiny_tokenizer)
    rows = demonstration_rows(ref, tiny_tokenizer, digit_task, digit_task.sample(6, 7919), SayEnv)[0]
    order = list(range(6))
    random.Random(7919).shuffle(order)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    norms = []
    for step in range(2):
        pick = [rows[i] for i in order[3 * step: 3 * step + 3]]
        width = max(len(r[0]) for r in pick)
        ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in pick])
        lab = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in pick])
        attn = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in pick])
        opt.zero_grad()
        ref(input_ids=ids, attention_mask=attn, labels=lab).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)))
        opt.step()
    assert min(norms) > 0.05  # the clip acted
    model.eval()
    sft_warmup(model, tiny_tokenizer, digit_task, SayEnv, steps=2, batch_size=3, lr=1e-2, seed=0, micro_batch_size=2,
               max_grad_norm=0.05)
    assert not model.training  # left in the mode it came in (the trainer's policy runs in eval mode)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_demonstrations_longer_than_an_episode_are_left_out(tiny_model, tiny_tokenizer, digit_task):
    ex = [digit_task[1], digit_task[2]]
    # "call 1" + EOS = 7 ids, "<answer>1</answer>" + EOS = 19: a turn of 18 tokens cannot hold the answer
    assert demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex, SayEnv, max_new_tokens=19)[2] == 0
    rows, dropped, too_long = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex, SayEnv, max_new_tokens=18)
    assert rows == [] and dropped == 0 and too_long == 2
    assert demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex, SayEnv, max_turns=1)[2] == 2
    full = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex[:1], SayEnv)[0][0]
    after_prompt = len(full[0]) - next(i for i, lab in enumerate(full[1]) if lab != -100)
    for budget, left_out in ((after_prompt, 0), (after_prompt - 1, 1)):
        assert demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex[:1], SayEnv,
                                  max_episode_tokens=budget)[2] == left_out
    with pytest.raises(ValueError, match="1 too long for max_new_tokens=5"):
        sft_warmup(tiny_model, tiny_tokenizer, digit_task, SayEnv, steps=1, batch_size=1, lr=1e-3, seed=0,
                   micro_batch_size=1, max_new_tokens=5)

    class ToolFirst(SayEnv):
        def demonstration(self, example, answer):
            return [{"role": "tool", "content": "ok"}, {"role": "assistant", "content": answer}]

    with pytest.raises(ValueError, match="must start and end with an assistant turn"):
        demonstration_rows(tiny_model, tiny_tokenizer, digit_task, ex, ToolFirst)


def test_the_trainer_passes_the_run_settings(monkeypatch, tmp_path):
    """The trainer hands sft_warmup its settings and the episode limits, and keeps its policy in
    eval mode after the warm-up."""
    import echotrain.train.warmup as warmup

    seen = {}
    real = warmup.sft_warmup
    monkeypatch.setattr(warmup, "sft_warmup", lambda *a, **k: seen.update(k) or real(*a, **k))
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "model=testbed-calc", "task=testbed-calc", "env=calculator", "max_turns=2",
               "max_new_tokens=90", "max_episode_tokens=300", "sft_steps=1", "sft_batch_size=3", "sft_lr=3e-6",
               "max_grad_norm=0.37", "micro_batch_size=2", "seed=5", "steps=1", "save_every=0",
               f"output_dir={run}") == 0
    assert {k: seen[k] for k in ("steps", "batch_size", "lr", "seed", "micro_batch_size", "max_grad_norm",
                                 "max_new_tokens", "max_turns", "max_episode_tokens", "autocast_dtype")} == {
        "steps": 1, "batch_size": 3, "lr": 3e-6, "seed": 5, "micro_batch_size": 2, "max_grad_norm": 0.37,
        "max_new_tokens": 90, "max_turns": 2, "max_episode_tokens": 300, "autocast_dtype": None}


# ------------------------------------------------------------------ sft_data: demonstrations from a file
def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_file_demonstrations_encode_as_the_environments(tiny_model, tiny_tokenizer, digit_task, tmp_path):
    """A file line holding what env.reset and env.demonstration give (``prompt`` + ``turns``, or the same as
    ``messages``) is the same row as the environment's demonstration; ``prompt`` + ``completion`` is one turn."""
    ex = digit_task[7]
    prompt, turns = SayEnv().reset(ex), SayEnv().demonstration(ex, "<answer>7</answer>")
    want = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, [ex], SayEnv)[0]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "turns": turns}, "", {"messages": prompt + turns},
                                               {"prompt": prompt, "completion": "<answer>7</answer>"}])
    rows, too_long = file_rows(tiny_model, tiny_tokenizer, path)
    assert too_long == 0 and rows[:2] == want + want
    # TRL's conversational prompt-completion: the completion's messages are the turns
    conv = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": prompt, "completion": turns}])
    assert file_rows(tiny_model, tiny_tokenizer, conv) == (want, 0)
    # the text is taken as written (no stripping), the end-of-turn id appended
    eos = tiny_tokenizer.eos_token_id
    ids, labels = encode_demonstration(tiny_tokenizer, eos, prompt, [{"role": "assistant", "content": " 7 "}])
    assert [t for t in labels if t != -100] == tiny_tokenizer(" 7 ", add_special_tokens=False)["input_ids"] + [eos]
    one = demonstration_rows(tiny_model, tiny_tokenizer, digit_task, [ex],
                             type("One", (SayEnv,), {"demonstration": lambda self, e, a: [{"role": "assistant",
                                                                                              "content": a}]}))[0]
    assert rows[2:] == one
    # the episode limits leave out what a turn, the turns or the budget cannot hold
    n_turn = len(tiny_tokenizer("call 7", add_special_tokens=False)["input_ids"]) + 1
    assert file_rows(tiny_model, tiny_tokenizer, path, max_turns=1)[1] == 2
    assert file_rows(tiny_model, tiny_tokenizer, path, max_new_tokens=n_turn - 1)[1] == 3
    prompt_len = next(i for i, lab in enumerate(one[0][1]) if lab != -100)
    assert file_rows(tiny_model, tiny_tokenizer, path, max_episode_tokens=len(one[0][0]) - prompt_len)[1] == 2
    assert file_rows(tiny_model, tiny_tokenizer, path, max_episode_tokens=len(one[0][0]) - prompt_len - 1)[1] == 3


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not JSON"),
    ("[1, 2]", ":1: a line must be a JSON object, got list"),
    ({"text": "x"}, "a line is {\"messages\": [...]}, {\"prompt\": ..., \"completion\": ...} or {\"prompt\": ..., "
                    "\"turns\": [...]}; got the keys ['text']"),
    ({"prompt": "a", "completion": "b", "turns": []}, "got the keys ['completion', 'prompt', 'turns']"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages need a prompt (system/user messages) before"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages need a prompt"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "tool", "content": "t"}]}, "must start and end with an assistant message, got 'assistant' "
                                                       "... 'tool'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0] must be {\"role\": one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0] must be"),
    ({"messages": []}, "messages must be a non-empty list of messages"),
    ({"prompt": "", "completion": "b"}, ":1: prompt is empty"),
    ({"prompt": "a", "completion": 5}, "completion must be a string or a list of messages, got int"),
    ({"prompt": "a", "completion": [{"role": "user", "content": "b"}]}, "must start and end with an assistant message"),
    ({"prompt": "a", "turns": [{"role": "tool", "content": "t"}, {"role": "assistant", "content": "b"}]},
     "must start and end with an assistant message, got 'tool'"),
    ({"prompt": "a", "completion": ""}, "assistant turn 1 is empty (no content, no tool_calls)"),
    ({"prompt": "a", "completion": " \n "}, "assistant turn 1 is empty"),
    ({"prompt": "a", "turns": [{"role": "assistant", "content": "b"}, {"role": "user", "content": "no"},
                               {"role": "assistant", "content": ""}]}, "assistant turn 2 is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     "messages[1] must be {\"role\": one of"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": "f"}]},
     "messages[1].tool_calls must be a list, got str"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0] must be {\"type\": \"function\", \"function\": {\"name\": a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls[0] must be"),
])
def test_bad_demonstration_lines_are_named(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "d.jsonl", [line])
    with pytest.raises(ValueError) as err:
        read_demonstrations(path)
    assert f"sft_data {path}:1: " in str(err.value) and message in str(err.value)


def test_trl_tool_calls_become_the_text_the_episodes_parse(tiny_model, tiny_tokenizer, tmp_path):
    """An assistant message's structured tool_calls (TRL / OpenAI; content null, missing or text; arguments an object
    or a JSON string) are the Hermes text after its content, a call a line, which the environment's parser reads back;
    the row equals that of the same line written as text."""
    from echotrain.envs.tools import parse_tool_calls

    (_, _, (solo,)), = read_demonstrations(_write_jsonl(tmp_path / "n.jsonl", [{"prompt": "q", "completion": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "now", "arguments": ""}},
                                             {"function": {"name": "café", "arguments": None}}]}]}]))
    assert solo["content"] == ('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
                               '<tool_call>{"name": "café", "arguments": {}}</tool_call>')  # (no arguments; not \\u00e9)
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    other = {"type": "function", "function": {"name": "neg", "arguments": {"x": 5}}}
    structured = [{"role": "user", "content": "add 2 3"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "content": "5", "name": "add", "tool_call_id": "0"},
                  {"role": "assistant", "content": "so", "tool_calls": [other, call]},
                  {"role": "tool", "content": "-5"}, {"role": "tool", "content": "5"},
                  {"role": "assistant", "content": "5"}]
    text_one = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    text_two = 'so\n<tool_call>{"name": "neg", "arguments": {"x": 5}}</tool_call>\n' + text_one
    (_, prompt, turns), = read_demonstrations(_write_jsonl(tmp_path / "s.jsonl", [{"messages": structured}]))
    assert prompt == structured[:1]
    assert [t["content"] for t in turns] == [text_one, "5", text_two, "-5", "5", "5"]
    assert [(c.name, c.arguments) for c in parse_tool_calls(text_two)] == [("neg", {"x": 5}), ("add", {"a": 2, "b": 3})]
    as_text = [{**m, "content": c} for m, c in zip(structured[1:], [text_one, "5", text_two, "-5", "5", "5"])]
    for m in as_text:
        m.pop("tool_calls", None)
    plain = _write_jsonl(tmp_path / "t.jsonl", [{"messages": structured[:1] + as_text}])
    assert file_rows(tiny_model, tiny_tokenizer, tmp_path / "s.jsonl") == file_rows(tiny_model, tiny_tokenizer, plain)


@pytest.mark.parametrize("text", ["c</s>", "c</s>d"])
def test_a_turn_holding_the_end_of_turn_token_is_refused(tiny_model, tiny_tokenizer, tmp_path, text):
    """The warm-up appends the end-of-turn id to each assistant turn, and an episode's turn ends at its first one: a
    turn that holds it (at its end: trained twice; inside: a turn no episode can make) is refused, named."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "c d"}, {"prompt": "ab", "completion": text}])
    with pytest.raises(WarmupError, match=rf"d.jsonl:2: the assistant turn '{text}' contains the end-of-turn token "
                                          r"'</s>': a model turn ends there"):
        file_rows(tiny_model, tiny_tokenizer, path)


def test_an_empty_or_missing_file_and_a_chat_prompt_without_a_template(tmp_path, tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="has no demonstration"):
        read_demonstrations(_write_jsonl(tmp_path / "e.jsonl", ["", " "]))
    with pytest.raises(ValueError, match="cannot be read"):
        read_demonstrations(tmp_path / "missing.jsonl")
    tiny_tokenizer.chat_template = None
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": "ab", "completion": "c"},
                                               {"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}])
    with pytest.raises(WarmupError, match=":2: a chat prompt, but the model's tokenizer has no chat template"):
        file_rows(tiny_model, tiny_tokenizer, path)
    # a UTF-8 BOM is read; line numbers count blank lines
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"prompt": "ab", "completion": "c"}\n\n{"prompt": "d", "turns": 1}\n')
    with pytest.raises(ValueError, match=r"bom.jsonl:3: turns must be a non-empty list"):
        read_demonstrations(bom)


def test_cli_warm_up_on_a_file_without_an_environment(monkeypatch, tmp_path, capsys):
    """``sft_data`` through the CLI on the testbed (no env): every file line is a demonstration (one too long for
    max_new_tokens is left out and counted), the loss falls over the steps, and the record says so; a resumed
    run with a KL reference warms up again on the same file and ends where the uninterrupted one does."""
    rng = random.Random(0)
    lines = []
    for _ in range(12):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        lines.append({"prompt": f"{a}+{b}=", "completion": "77"})  # something the testbed does not write: learnt
    lines.append({"prompt": "1+1=", "completion": "2" * 40})  # longer than max_new_tokens=6
    data = _write_jsonl(tmp_path / "sums.jsonl", lines)
    args = [*TINY, "task=testbed", "sft_steps=4", "sft_batch_size=6", "sft_lr=1e-3", f"sft_data={data}", "steps=2",
            "kl_coef=0.05", "save_every=1", "keep_last=3"]
    full = tmp_path / "full"
    assert cli(monkeypatch, "train", *args, f"output_dir={full}") == 0
    err = capsys.readouterr().err
    assert (f"warm-up: 4 supervised steps on 12 demonstrations of sft_data={data}; 1 left out, longer than an "
            "episode allows") in err
    info = json.loads((full / "run_info.json").read_text())["warmup"]
    assert (info["examples"], info["too_long"], info["dropped"], info["data_rows"]) == (12, 0 + 1, 0, 12)
    assert info["data"] == str(data) and info["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert info["loss_last"] < 0.5 * info["loss_first"]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    latest_checkpoint(part).unlink()
    again = tmp_path / "again"
    shutil.copytree(part, again)
    assert cli(monkeypatch, "train", "--resume", str(part)) == 0
    assert strip(read_jsonl(full / "metrics.jsonl")) == strip(read_jsonl(part / "metrics.jsonl"))
    # a file changed since: the reference would differ, refused (one line, exit 2); without a reference not read at all
    data.write_text(data.read_text().replace("77", "78"))
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(again)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"echotrain train: error: sft_data={str(data)!r} changed since the run warmed up on it")
    data.unlink()
    assert cli(monkeypatch, "train", "--resume", str(again), "kl_coef=0") == 0
    assert cli(monkeypatch, "train", "--resume", str(again), "kl_coef=0.05", "steps=3") == 2
    assert "cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("over, message", [
    (["sft_steps=0", "sft_data={data}"], "sft_data='{data}': is set but sft_steps=0"),
    (["sft_steps=1", "sft_data={missing}"], "sft_data='{missing}' cannot be read"),
    (["sft_steps=1", "sft_data={bad}"], "sft_data {bad}:2: not JSON"),
    (["env=feedback", "sft_steps=1", "sft_data={bad}"], "sft_data {bad}:2: not JSON"),
])
def test_bad_sft_data_exits_2_with_one_line(monkeypatch, tmp_path, capsys, over, message):
    paths = {"data": _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2"}]),
             "missing": tmp_path / "none.jsonl",
             "bad": _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1=", "completion": "2"}, "{oops"])}
    over = [o.format(**paths) for o in over]
    assert cli(monkeypatch, "train", *TINY, "task=testbed", *over, "steps=1", f"output_dir={tmp_path / 'r'}") == 2
    err = capsys.readouterr().err
    assert message.format(**paths) in err and err.count("\n") == 1, err


def test_a_file_replaces_the_environments_demonstrations(monkeypatch, tmp_path, capsys):
    """With env and sft_data the file's demonstrations are used (feedback has none of its own), as episodes."""
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12+34=", "turns": [
        {"role": "assistant", "content": "45"}, {"role": "user", "content": "wrong, try again"},
        {"role": "assistant", "content": "46"}]}])
    assert cli(monkeypatch, "train", *TINY, "task=testbed", "env=feedback", "max_turns=2", "sft_steps=1",
               "sft_batch_size=2", f"sft_data={data}", "steps=1", f"output_dir={tmp_path / 'r'}") == 0
    assert f"warm-up: 1 supervised step on 1 demonstration of sft_data={data}" in capsys.readouterr().err
    # one model turn at most: the same file is too long for the episode, and then nothing is left: one line, exit 2
    assert cli(monkeypatch, "train", *TINY, "task=testbed", "env=feedback", "max_turns=1", "sft_steps=1",
               f"sft_data={data}", "steps=1", f"output_dir={tmp_path / 'r2'}") == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"echotrain train: error: sft_data {data}: all 1 demonstrations are longer "
                                            "than an episode allows (max_new_tokens=6, max_turns=1, max_episode_tokens=12)")
    assert "Traceback" not in err


def test_without_an_environment_a_demonstration_is_one_model_turn(monkeypatch, tmp_path, capsys):
    """No env: a line of two model turns is left out before it is encoded (a template need not render it), counted;
    the episode budget (max_episode_tokens) is an environment's: not applied; fewer rows used than the file holds
    are said ("N of M"), and the order is the seed's."""
    data = _write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "completion": "3"},
        {"prompt": "2+2=", "turns": [{"role": "assistant", "content": "5"}, {"role": "user", "content": "no"},
                                     {"role": "assistant", "content": "4"}]},
        {"prompt": "3+4=", "completion": "7"}, {"prompt": "4+4=", "completion": "8888"}])
    assert cli(monkeypatch, "train", *TINY, "task=testbed", "sft_steps=1", "sft_batch_size=1", f"sft_data={data}",
               "max_episode_tokens=3", "steps=1", f"output_dir={tmp_path / 'r'}") == 0
    assert f"warm-up: 1 supervised step on 1 of 3 demonstrations of sft_data={data}; 1 left out" in capsys.readouterr().err
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())["warmup"]
    assert (info["examples"], info["data_rows"], info["too_long"]) == (1, 3, 1)
    # which one: the first of the seed's order over the 3 usable rows (targets: its answer's bytes + EOS)
    order = list(range(3))
    random.Random(0 + 7919).shuffle(order)
    assert info["target_tokens_per_step"] == [2, 2, 5][order[0]]


def test_chat_demonstrations_end_turns_with_the_templates_eos(tiny_model, tiny_tokenizer, tmp_path):
    """Generation config eos ids [3, 2] with a template that closes turns with 2 (</s>): chat rows end each model
    turn with 2 (and equal the template's rendering), string prompts keep the first id (3), as the episodes do."""
    tiny_model.generation_config.eos_token_id = [3, 2]
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
        {"prompt": "ab", "completion": "c"}])
    (chat, _), (plain, plain_labels) = file_rows(tiny_model, tiny_tokenizer, path)[0]
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                               {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
                                              tokenize=False)
    assert chat == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain[-1] == 3 and plain_labels[-1] == 3


def test_history_dependent_template_rows_equal_the_whole_conversation(tiny_tokenizer, tmp_path):
    """A template whose rendering of a message depends on the history before it (it numbers the messages): three
    model turns, one reply of two messages; the row still equals the template's rendering of the whole conversation,
    so each delta was rendered after the right history (the prompt, every model turn and every earlier reply)."""
    tok = tiny_tokenizer
    tok.chat_template = ("{% for m in messages %}<s>{{ loop.index }}{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>{{ messages | length + 1 }}assistant:{% endif %}")
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 3"}]
    turns = [{"role": "assistant", "content": "call 2 3"}, {"role": "tool", "content": "5"},
             {"role": "user", "content": "sure"}, {"role": "assistant", "content": "call 5 0"},
             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    ids, labels = encode_demonstration(tok, tok.eos_token_id, prompt, turns)
    text = tok.apply_chat_template(prompt + turns, tokenize=False)
    assert "<s>8assistant:5</s>" in text  # (the numbering is there to be matched)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert "".join(tok.convert_ids_to_tokens([t for t in labels if t != -100])) == "call 2 3</s>call 5 0</s>5</s>"


def test_a_string_prompt_gets_the_tokenizers_bos_and_plain_deltas(tiny_tokenizer):
    """A string prompt is encoded as the rollouts encode it (one BOS where the tokenizer's post-processor puts one;
    :func:`~echotrain.runtime.rollout.encode_prompts`), and its environment replies are the plain-text deltas even
    when the tokenizer has a chat template: the prompt's type decides, as in the episodes."""
    from tokenizers.processors import TemplateProcessing

    from echotrain.runtime.episodes import TurnRenderer
    from echotrain.runtime.rollout import encode_prompts

    tok = tiny_tokenizer
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok("ab")["input_ids"][0] == 1 and tok.chat_template  # BOS added; a chat template present
    eos = tok.eos_token_id
    turns = [{"role": "assistant", "content": "c"}, {"role": "user", "content": "no"}, {"role": "assistant", "content": "d"}]
    ids, labels = encode_demonstration(tok, eos, "ab", turns)
    prompt_ids = encode_prompts(tok, ["ab"])[0][0].tolist()
    assert prompt_ids[0] == 1
    delta = TurnRenderer(tok, False, None).delta("ab", [turns[1]])
    c, d = (tok(x, add_special_tokens=False)["input_ids"] for x in "cd")
    assert ids == prompt_ids + c + [eos] + delta + d + [eos]
    assert labels == [-100] * len(prompt_ids) + c + [eos] + [-100] * len(delta) + d + [eos]


def test_cli_tools_without_an_environment_warm_up_on_multi_turn_lines(monkeypatch, tmp_path, capsys):
    """``tools=[...]`` without ``env`` runs episodes (max_turns model turns), so a file line of a tool call, its
    result and the answer is a demonstration of it, not left out as longer than one model turn."""
    (tmp_path / "my_tools.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: first.\n'
                                          '        b: second.\n    """\n    return a + b\n')
    monkeypatch.chdir(tmp_path)
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+3=", "turns": [
        {"role": "assistant", "content": "c2+3"}, {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]}])
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "tools=[my_tools.py:add]", "max_turns=2", "max_episode_tokens=64",
               "sft_steps=1", "sft_batch_size=1", f"sft_data={data}", "steps=1", "save_every=0", f"output_dir={tmp_path / 'r'}") == 0
    assert f"warm-up: 1 supervised step on 1 demonstration of sft_data={data}\x20(" in capsys.readouterr().err
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())["warmup"]
    assert (info["examples"], info["too_long"]) == (1, 0)


def test_a_relative_sft_data_path_is_kept_absolute_and_resumes_from_another_folder(monkeypatch, tmp_path, capsys):
    """``sft_data=demos.jsonl`` is read from the working directory and kept absolute in config.yaml and run_info.json,
    so a resume from another folder that warms up again (KL reference) reads the same file."""
    import yaml

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    _write_jsonl(work / "demos.jsonl", [{"prompt": "1+2=", "completion": "3"}, {"prompt": "2+2=", "completion": "4"}])
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    assert cli(monkeypatch, "train", *TINY, "task=testbed", "sft_steps=1", "sft_batch_size=2", "sft_data=demos.jsonl",
               "kl_coef=0.05", "steps=1", "save_every=1", f"output_dir={run}") == 0
    absolute = str(work / "demos.jsonl")
    assert yaml.safe_load((run / "config.yaml").read_text())["sft_data"] == absolute
    assert json.loads((run / "run_info.json").read_text())["warmup"]["data"] == absolute
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli(monkeypatch, "train", "--resume", str(run), "steps=2") == 0
    assert f"warm-up: 1 supervised step on 2 demonstrations of sft_data={absolute}" in capsys.readouterr().err


def test_a_file_reply_the_template_refuses_is_a_template_error_with_its_line(tiny_model, tiny_tokenizer, tmp_path):
    """A line whose tool reply the chat template cannot render: TemplateError naming PATH:LINE, whole (the remedy,
    chat_template=FILE, at its end is not cut whatever the path's length)."""
    from echotrain.runtime.episodes import TemplateError
    from tests.runtime.test_episodes import GEMMA_LIKE

    tiny_tokenizer.chat_template = GEMMA_LIKE
    deep = tmp_path / ("a-rather-long-folder-name-" * 8)
    deep.mkdir()
    path = _write_jsonl(deep / "d.jsonl", [{"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}, {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"}]}])
    with pytest.raises(TemplateError) as err:
        file_rows(tiny_model, tiny_tokenizer, path)
    text = str(err.value)
    assert text.startswith(f"sft_data {path}:1: the chat template cannot render the environment's reply (role 'tool')")
    assert text.endswith("or an environment whose replies have roles this template accepts")
