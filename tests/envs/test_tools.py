"""Tools (echotrain.envs.tools, echotrain.envs.python_exec): schemas from signatures, Hermes/Qwen
tool-call parsing, and every failure -- a malformed call, a tool that raises, hangs or prints
10 MB -- ending as a counted error of the episode while the run continues."""

from __future__ import annotations

import time

import pytest

from echotrain.envs import ToolEnvironment, get_env_factory, parse_tool_calls, tool_schema
from echotrain.envs.calculator import calculator
from echotrain.envs.python_exec import PythonToolError, run_python
from echotrain.envs.tools import ToolCall, call_tool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


def boom(x: int) -> int:
    """Always raises.

    Args:
        x: anything.
    """
    raise RuntimeError("kaput")


def hang(x: int) -> int:
    """Never returns.

    Args:
        x: anything.
    """
    time.sleep(60)
    return x


def chatty(x: int) -> int:
    """Prints 10 MB.

    Args:
        x: anything.
    """
    import sys

    for _ in range(5):
        print("z" * (1 << 20), file=sys.stderr)  # stderr is captured (and capped) too
        print("y" * (1 << 20))
    return x


def test_schema_from_signature_and_docstring():
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first term."},
                                                        "b": {"type": "integer", "description": "the second term."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    with pytest.raises(ValueError, match="'undocumented'"):
        def undocumented(a):  # no hints, no docstring
            return a
        tool_schema(undocumented)


def test_parse_hermes_calls_and_malformed_ones():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "add"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [("add", {"a": 1, "b": 2}, True),
                                                                            ("add", {"a": 3, "b": 4}, True)]
    assert [c.error for c in calls[2:]] == [
        "the tool call is not valid JSON (Expecting property name enclosed in double quotes at char 1)",
        'the tool call must be a JSON object with a string "name"', '"arguments" must be a JSON object',
        "<tool_call> without its closing </tool_call>"]
    assert parse_tool_calls("The answer is <answer>3</answer>") == []


def test_every_failure_is_a_counted_error_and_the_episode_goes_on():
    env = ToolEnvironment([add, boom, hang, chatty], timeout_s=0.5, max_output_chars=1000)
    turn = ("<tool_call>{oops}</tool_call>"
            '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "chatty", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>')
    t0 = time.perf_counter()
    reply = env.step(turn)
    assert time.perf_counter() - t0 < 5  # the hang is cut at 0.5 s
    assert (reply.done, reply.tool_calls, reply.tool_errors) == (False, 7, 6)
    assert [r.kind for r in env.results] == ["malformed", "raised", "timeout", "output_too_long", "unknown_tool",
                                             "bad_arguments", "ok"]
    assert [m["role"] for m in reply.messages] == ["tool"] * 7
    assert reply.messages[1]["content"] == "Error: boom raised RuntimeError: kaput"
    assert reply.messages[-1]["content"] == "42"
    assert max(len(m["content"]) for m in reply.messages) < 1000  # 10 MB never reaches the model
    assert env.step("<answer>42</answer>").done  # and the episode goes on to its final answer


def test_call_result_too_long_is_an_error():
    r = call_tool(ToolCall("calculator", {"expression": "10**20"}), {"calculator": calculator})
    assert r.error and r.kind == "raised"  # ** is not a calculator operation
    r = call_tool(ToolCall("calculator", {"expression": "(4817 + 2933) * 2"}), {"calculator": calculator})
    assert (r.content, r.error) == ("15500", False)
    r = call_tool(ToolCall("calculator", {"expression": "123456789*987654321"}), {"calculator": calculator},
                  max_output_chars=5)
    assert r.error and r.kind == "output_too_long"


@pytest.mark.parametrize("code, why", [
    ("import time; time.sleep(30)", "did not finish within 1.0 s"),
    ("while True: pass", "did not finish within 1.0 s"),
    ("print('y' * 10_000_000)", "printed more than 4096 bytes"),
    ("x = bytearray(2 << 30)", "MemoryError"),
    ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)", "OSError"),
    ("raise ValueError('bad')", "ValueError: bad"),
])
def test_python_tool_limits(code, why):
    t0 = time.perf_counter()
    with pytest.raises(PythonToolError, match=why.replace("(", r"\(").replace(".", r"\.")):
        run_python(code, timeout_s=1.0, memory_mb=256)
    assert time.perf_counter() - t0 < 10


def test_python_tool_runs_code():
    assert run_python("print(sum(range(10)))") == "45\n"


def test_env_registry_and_bad_options():
    make = get_env_factory("calculator", timeout_s=1.0)
    assert make() is not make()  # one instance per episode
    with pytest.raises(ValueError, match="env='nope' is unknown; valid: \\['calculator', 'feedback', 'python', 'tools', 'trl', 'verifiers'\\]"):
        get_env_factory("nope")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        get_env_factory("calculator", timeout_s=0)


def test_failing_tools_in_an_episode_are_counted_and_the_episode_reaches_its_answer(monkeypatch):
    """Through run_episodes: turn 1 calls a tool that hangs, turn 2 one that prints 10 MB, turn 3
    a malformed call, turn 4 a tool that raises, turn 5 answers; each error is counted and the
    episode goes on to its final answer (the sampler is scripted, the environment real)."""
    import torch

    from echotrain.models.byte_tokenizer import ByteTokenizer
    from echotrain.runtime import episodes as episodes_mod
    from echotrain.runtime.episodes import EPISODE_STATS, run_episodes
    from echotrain.tasks import Example

    tok = ByteTokenizer()
    turns = ['<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>\n',
             '<tool_call>{"name": "chatty", "arguments": {"x": 1}}</tool_call>\n',
             '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>\n',
             '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>\n',
             "42\n"]

    def fake(model, ids, attn, *, max_new_tokens, **kw):
        t = torch.tensor([tok.encode(turns[fake.turn])] * ids.shape[0])
        fake.turn += 1
        return episodes_mod.Turn(t, torch.zeros(t.shape), torch.zeros(t.shape))

    fake.turn = 0
    monkeypatch.setattr(episodes_mod, "_sample", fake)
    model = torch.nn.Linear(1, 1)
    env = lambda: ToolEnvironment([add, boom, hang, chatty], timeout_s=0.5)  # noqa: E731
    ex = Example(messages="40+2=", question="40+2=", answer="42", task="t", index=0)
    res = run_episodes(model, tok, [ex], 1, env, max_new_tokens=80, max_turns=6, max_episode_tokens=2000)
    stats = dict(zip(EPISODE_STATS, res.batch.episode_stats[0].tolist()))
    assert (stats["turns"], stats["tool_calls"], stats["tool_errors"]) == (5, 4, 4)
    assert res.final_texts == ["42"] and not bool(res.batch.truncated[0])
    assert [m["content"][:40] for m in res.transcripts[0] if m["role"] == "tool"] == [
        "Error: hang did not finish within 0.5 s", "Error: chatty printed more than 2000 cha",
        "Error: the tool call is not valid JSON (", "Error: boom raised RuntimeError: kaput"]


def test_python_env_runs_a_call_and_counts_a_hang():
    env = get_env_factory("python")()
    reply = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
                     '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')
    assert [m["content"] for m in reply.messages] == ["42\n", "Error: python raised PythonToolError: did not finish within 5.0 s"]
    assert (reply.tool_calls, reply.tool_errors) == (2, 1)


class Counter:
    """A TRL-style environment_factory class: reset(**row), public methods as tools, get_reward."""

    def reset(self, **row):
        self.total, self.answer = 0, int(row["answer"])
        return f" (start from {self.total})"

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add.
        """
        self.total += step
        return self.total

    def get_reward(self) -> float:
        return float(self.total == self.answer)


def test_trl_environment_factory_objects():
    from echotrain.tasks import Example

    env = get_env_factory("trl", factory=Counter)()
    ex = Example(messages=[{"role": "user", "content": "Count to 5"}], question="Count to 5", answer="5", task="t",
                 index=0)
    prompt = env.reset(ex)
    assert prompt[-1]["content"] == "Count to 5 (start from 0)" and '"name": "increment"' in prompt[0]["content"]
    reply = env.step('<tool_call>{"name": "increment", "arguments": {"step": 5}}</tool_call>')
    assert reply.messages == [{"role": "tool", "content": "5"}] and not reply.done
    final = env.step("<answer>5</answer>")
    assert final.done and final.reward == 1.0  # get_reward() at the final answer
    with pytest.raises(ValueError, match="env=trl needs env_options.factory"):
        get_env_factory("trl")


class Shouter:
    """A second TRL-style environment: one tool, no reward."""

    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Upper-case a text.

        Args:
            text: what to shout.
        """
        return text.upper()


class NoReset:
    def tool(self, x: int) -> int:
        """Identity.

        Args:
            x: anything.
        """
        return x


def test_trl_several_environments_are_selected_per_example():
    """TRL's ``environment_factory={name: factory}``: each example's ``environment`` field picks
    its environment; only that one's tools are described and callable."""
    from echotrain.tasks import Example

    make = get_env_factory("trl", factory={"count": Counter, "shout": Shouter})

    def example(env_name):
        return Example(messages=[{"role": "user", "content": "Go"}], question="Go", answer="5", task="t", index=3,
                       metadata={} if env_name is None else {"environment": env_name})

    env = make()
    prompt = env.reset(example("shout"))
    assert '"name": "shout"' in prompt[0]["content"] and '"name": "increment"' not in prompt[0]["content"]
    assert prompt[-1]["content"] == "Go"  # Shouter.reset returns None: nothing appended
    reply = env.step('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>')
    assert reply.messages == [{"role": "tool", "content": "HI"}] and reply.tool_errors == 0
    wrong = env.step('<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call>')
    assert wrong.tool_errors == 1  # the other environment's tool is not this episode's
    assert env.step("done").done and env.step("done").reward == 0.0  # no get_reward: no shaping

    env = make()  # a fresh episode of the other environment, with its reward
    prompt = env.reset(example("count"))
    assert '"name": "increment"' in prompt[0]["content"] and prompt[-1]["content"] == "Go (start from 0)"
    env.step('<tool_call>{"name": "increment", "arguments": {"step": 5}}</tool_call>')
    assert env.step("<answer>5</answer>").reward == 1.0
    for bad in (None, "nope"):
        with pytest.raises(ValueError, match=f"example 3 of task 't' has environment={bad!r}; .*"
                                             r"one of \['count', 'shout'\]"):
            make().reset(example(bad))
    with pytest.raises(ValueError, match="env_options.factory.broken: NoReset has no reset method"):
        get_env_factory("trl", factory={"count": Counter, "broken": NoReset})
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        get_env_factory("trl", factory={"count": Counter}, timeout_s=0)


def test_trl_environment_files_are_imported_once_and_examples_stay_intact(tmp_path, monkeypatch):
    """A ``file.py:Class`` factory runs its file once per process (not once per episode); a
    ``reset`` observation never edits the example's shared messages; an integer ``environment``
    selects the factory of that name; an unknown one is a ConfigError (one line from the CLI)."""
    from echotrain.errors import ConfigError
    from echotrain.tasks import Example

    (tmp_path / "counted_env.py").write_text(
        "import builtins\nbuiltins.counted_env_runs = getattr(builtins, 'counted_env_runs', 0) + 1\n"
        "class Hi:\n    def reset(self, **row):\n        return ' (hi)'\n"
        "    def wave(self, n: int) -> int:\n        \"\"\"Wave.\n\n        Args:\n            n: times.\n        \"\"\"\n"
        "        return n\n")
    monkeypatch.chdir(tmp_path)
    import builtins

    make = get_env_factory("trl", factory={"1": "counted_env.py:Hi"}, describe_tools=False)
    messages = [{"role": "user", "content": "Go"}]
    ex = Example(messages=messages, question="Go", answer="1", task="t", index=0, metadata={"environment": 1})
    prompts = [make().reset(ex) for _ in range(3)]
    assert builtins.counted_env_runs == 1
    assert all(p == [{"role": "user", "content": "Go (hi)"}] for p in prompts)
    assert messages == [{"role": "user", "content": "Go"}]  # the example's own list untouched
    ex.metadata["environment"] = 2
    with pytest.raises(ConfigError, match="has environment=2"):
        make().reset(ex)
