"""``env=verifiers`` (echotrain.envs.verifiers_env): verifiers ``MultiTurnEnv``-style objects, read
by duck typing (the ``verifiers`` package is not installed), driven through ``reset``/``step``:
older sync environments (``is_completed``, ``env_response`` returning ``(messages, state)``), newer
async ones (``final_env_response`` ends the episode), failures counted, bad import paths refused."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from echotrain.envs import EnvReply, get_env_factory
from echotrain.tasks import Example

EX = Example(messages=[{"role": "user", "content": "Guess a number."}], question="Guess a number.", answer="7",
             task="guess", index=3, metadata={"low": 1})


class OldGuess:
    """Older verifiers (sync): ``is_completed`` after each turn, ``env_response`` -> ``(messages, state)``."""

    max_turns = 99  # not read: echotrain's max_turns rules

    def setup_state(self, state, **kwargs):
        return {**state, "tries": 0}

    def is_completed(self, messages, state, **kwargs):
        return messages[-1]["content"] == state["answer"]

    def env_response(self, messages, state, **kwargs):
        state = {**state, "tries": state["tries"] + 1}
        hint = "higher" if int(messages[-1]["content"]) < int(state["answer"]) else "lower"
        return {"role": "user", "content": f"{hint} (try {state['tries']}, from {state['info']['low']})"}, state


class NewGuess:
    """Newer verifiers (async): state changed in place, ``final_env_response`` ends the episode."""

    async def setup_state(self, state):
        state["seen"] = []  # returns None: changed in place

    async def is_completed(self, state):  # newer signature: state alone
        return state["responses"][-1] == "quit"

    async def env_response(self, messages, state):
        state["seen"].append(threading.current_thread().name)
        if messages[-1]["content"] == state["answer"]:
            state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
            return state["final_env_response"]
        return [{"role": "user", "content": [{"type": "text", "text": "No, "}, {"type": "text", "text": "again."}]},
                {"role": "tool", "content": None}]


class Broken:
    """``env_response`` raises at the second turn; ``setup_state`` raises for task ``bad``."""

    def setup_state(self, state):
        if state["task"] == "bad":
            raise KeyError("no sandbox")

    def env_response(self, messages, state):
        if state["turn"] > 1:
            raise RuntimeError("kaput")
        return [{"role": "user", "content": "go on"}]


def test_older_sync_environment_with_is_completed_and_state_tuples():
    env = get_env_factory("verifiers", env=OldGuess)()
    assert env.reset(EX) == EX.messages  # the prompt, unchanged
    assert env.state == {"prompt": EX.messages, "answer": "7", "info": {"low": 1}, "task": "guess", "trajectory": [],
                         "responses": [], "turn": 0, "tries": 0}
    assert env.step("3") == EnvReply(messages=[{"role": "user", "content": "higher (try 1, from 1)"}], done=False)
    assert env.step("9") == EnvReply(messages=[{"role": "user", "content": "lower (try 2, from 1)"}], done=False)
    assert env.step("7") == EnvReply(done=True)  # is_completed: no env_response
    assert (env.state["tries"], env.state["turn"], env.state["responses"]) == (2, 3, ["3", "9", "7"])
    assert [m["content"] for m in env.messages] == ["Guess a number.", "3", "higher (try 1, from 1)", "9",
                                                    "lower (try 2, from 1)", "7"]
    assert env.state["trajectory"][1] == {"prompt": env.messages[:3], "completion": [{"role": "assistant", "content": "9"}]}


def test_newer_async_environment_with_final_env_response():
    make = get_env_factory("verifiers", env=NewGuess)
    env, other = make(), make()
    assert env.vf_env is other.vf_env  # one shared object, per-episode state
    env.reset(EX)
    other.reset(EX)
    assert env.state["seen"] == [] and env.state is not other.state
    assert env.step("5") == EnvReply(messages=[{"role": "user", "content": "No, again."}, {"role": "tool", "content": ""}])
    # from a thread without an event loop, as a background collector would call it
    box = []
    t = threading.Thread(target=lambda: box.append(env.step("7")), name="collector")
    t.start()
    t.join()
    assert box == [EnvReply(done=True)]  # final_env_response: the episode ends, "Correct!" is not shown
    assert env.state["seen"] == ["MainThread", "collector"] and env.state["turn"] == 2
    assert other.state["turn"] == 0 and other.state["seen"] == []
    assert other.step("quit") == EnvReply(done=True) and other.state["seen"] == []  # is_completed(state)


def test_a_failing_environment_ends_the_episode_as_a_counted_error():
    env = get_env_factory("verifiers", env=Broken)()
    env.reset(EX)
    assert env.step("1") == EnvReply(messages=[{"role": "user", "content": "go on"}])
    assert env.step("2") == EnvReply(done=True, tool_errors=1)  # no exception
    assert env.state["error"] == "RuntimeError: kaput"
    bad = get_env_factory("verifiers", env=Broken)()
    assert bad.reset(Example(messages="1+1=", question="1+1=", answer="2", task="bad", index=0)) == "1+1="
    assert bad.state["error"] == "setup_state raised KeyError: 'no sandbox'"
    assert bad.step("2") == EnvReply(done=True, tool_errors=1)  # ends at the first turn


class NotAState:
    """``env_response`` returns ``(messages, "oops")``: no state."""

    def env_response(self, messages, state):
        return [{"role": "user", "content": "hi"}], "oops"


def test_a_reply_without_a_state_is_a_counted_error():
    env = get_env_factory("verifiers", env=NotAState)()
    env.reset(EX)
    assert env.step("1") == EnvReply(done=True, tool_errors=1)
    assert env.state["error"] == "TypeError: returned a str as the state, not a dict"


def test_bad_env_options_are_refused_with_the_name(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="env=verifiers needs env_options.env=module:load_environment"):
        get_env_factory("verifiers")
    with pytest.raises(ValueError, match="cannot import 'no_such_vf_module' for 'no_such_vf_module:load_environment'"):
        get_env_factory("verifiers", env="no_such_vf_module:load_environment")
    with pytest.raises(ValueError, match="returned a dict without env_response"):
        get_env_factory("verifiers", env=dict)
    with pytest.raises(TypeError, match=r"unknown env_options \['factory'\]"):
        get_env_factory("verifiers", env=NewGuess, factory="x:y")
    (tmp_path / "vf_kwargs_env.py").write_text(
        "class Echo:\n    def __init__(self, word):\n        self.word = word\n"
        "    def env_response(self, messages, state):\n        return [{'role': 'user', 'content': self.word}]\n")
    monkeypatch.chdir(tmp_path)
    env = get_env_factory("verifiers", env="vf_kwargs_env.py:Echo", **{"kwargs.word": "again"})()
    env.reset(EX)
    assert env.step("1").messages == [{"role": "user", "content": "again"}]
    with pytest.raises(ValueError, match="'vf_kwargs_env.py:Echo' raised TypeError"):
        get_env_factory("verifiers", env="vf_kwargs_env.py:Echo")  # word missing


class Editor:
    """Edits the prompt and info it is handed (verifiers environments may)."""

    def setup_state(self, state):
        state["prompt"].insert(0, {"role": "system", "content": "Be brief."})
        state["info"]["low"] = -1

    def env_response(self, messages, state):
        return []


def test_the_episodes_of_one_example_do_not_share_its_prompt_or_metadata():
    """The G episodes of an example share its ``Example``: ``setup_state`` editing ``state["prompt"]``
    or ``state["info"]`` in place changes that episode's state only."""
    ex = Example(messages=[{"role": "user", "content": "Q"}], question="Q", answer="1", task="t", index=0,
                 metadata={"low": 1})
    make = get_env_factory("verifiers", env=Editor)
    envs = [make() for _ in range(3)]
    prompts = [env.reset(ex) for env in envs]
    assert ex.messages == [{"role": "user", "content": "Q"}] and ex.metadata == {"low": 1}
    assert all(p == [{"role": "user", "content": "Q"}] for p in prompts)
    assert [len(env.state["prompt"]) for env in envs] == [2, 2, 2] and envs[0].state["info"] == {"low": -1}


class Hangs:
    """``env_response`` hangs at the second turn in ``time.sleep`` (a plain method)."""

    def env_response(self, messages, state):
        if state["turn"] > 1:
            time.sleep(30)
        return [{"role": "user", "content": "go on"}]


class HangsAsync:
    """The same, ``async def``, awaiting."""

    async def env_response(self, messages, state):
        if state["turn"] > 1:
            await asyncio.sleep(30)
        return [{"role": "user", "content": "go on"}]


class HangsInIsCompleted:
    """``is_completed`` (newer signature) hangs at the second turn."""

    def is_completed(self, state):
        if state["turn"] > 1:
            time.sleep(30)
        return False

    def env_response(self, messages, state):
        return [{"role": "user", "content": "go on"}]


@pytest.mark.parametrize("cls", [Hangs, HangsAsync, HangsInIsCompleted], ids=["sync", "async", "is_completed"])
def test_a_hanging_environment_ends_the_episode_at_its_timeout(cls):
    """A method past ``timeout_s`` ends the episode as a counted error, within about the limit; the shared
    object then plays the next episode normally (its event loop is not left stuck)."""
    env = get_env_factory("verifiers", env=cls, timeout_s=0.3)()
    env.reset(EX)
    assert env.step("1") == EnvReply(messages=[{"role": "user", "content": "go on"}])
    t = time.monotonic()
    assert env.step("2") == EnvReply(done=True, tool_errors=1)
    assert time.monotonic() - t < 5
    name = "is_completed" if cls is HangsInIsCompleted else "env_response"
    assert env.state["error"].endswith(f"{name} did not finish within 0.3 s"), env.state["error"]
    again = get_env_factory("verifiers", env=cls, timeout_s=0.3)()
    again.reset(EX)
    assert again.step("1") == EnvReply(messages=[{"role": "user", "content": "go on"}])
    for bad in (0, -1, float("inf"), "5", True):
        with pytest.raises(ValueError, match="env_options.timeout_s must be a positive number of seconds"):
            get_env_factory("verifiers", env=cls, timeout_s=bad)()
