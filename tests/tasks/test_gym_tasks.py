"""reasoning-gym tasks, the default task and the registry."""

from __future__ import annotations

import pytest

from echotrain.tasks import DEFAULT_TASK, Example, ReasoningGymTask, Task, get_task, task_names
from echotrain.tasks.base import sample_indices


def test_default_task_prompt_structure():
    task = get_task("default")
    assert isinstance(task, Task) and task.name == "rg:basic_arithmetic" and task.answer_format == "tag"
    ex = task[0]
    assert isinstance(ex, Example)
    roles = [m["role"] for m in ex.messages]
    assert roles == ["system", "user", "assistant", "user"]  # system + one-shot exchange + question
    assert "<answer>" in ex.messages[0]["content"]
    assert ex.messages[1:3] == [
        {"role": "user", "content": DEFAULT_TASK["one_shot"][0]},
        {"role": "assistant", "content": DEFAULT_TASK["one_shot"][1]},
    ]
    assert ex.messages[-1]["content"] == ex.question
    # Two terms of 1-2 digits (0-100) with + or -, as configured: the gold answer is the expression's value.
    for ex in task.sample(20, seed=0):
        a, op, b = ex.metadata["entry"]["metadata"]["expression"].split()
        assert 0 <= int(a) <= 100 and 0 <= int(b) <= 100 and op in "+-"  # reasoning-gym: up to 10**digits
        assert int(ex.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_sampling_is_reproducible():
    task = get_task("default", size=50)
    first = [e.index for e in task.sample(10, seed=1)]
    assert first == [e.index for e in task.sample(10, seed=1)]
    assert first != [e.index for e in task.sample(10, seed=2)]
    assert len(set(first)) == 10  # without replacement while n <= size
    assert [e.question for e in get_task("default", size=50)] == [e.question for e in task]  # seeded generator


def test_sample_indices_cycles_when_n_exceeds_size():
    idx = sample_indices(3, 7, seed=0)
    assert len(idx) == 7 and sorted(idx[:3]) == [0, 1, 2] and sorted(idx[3:6]) == [0, 1, 2]
    with pytest.raises(ValueError, match="n must be >= 0"):
        sample_indices(3, -1, seed=0)
    with pytest.raises(ValueError, match="empty task"):
        sample_indices(0, 1, seed=0)


def test_score_uses_the_generators_scorer_and_no_fallback():
    task = get_task("default", size=10)
    ex = task[2]
    assert task.score(f"{ex.question} = {ex.answer}\n<answer>{ex.answer}</answer>", ex) == 1.0
    assert task.score(f"<answer>{int(ex.answer) + 1}</answer>", ex) == 0.0
    assert task.score(f"The answer is {ex.answer}.", ex) == 0.0  # no tag, no reward
    assert task.score(f"<answer>{int(ex.answer) - 5}</answer><answer>{ex.answer}</answer>", ex) == 1.0  # last tag
    assert task.is_formatted("<answer>3</answer>") and not task.is_formatted("3")


def test_any_reasoning_gym_dataset_and_binary_option():
    task = get_task("rg:spell_backward", size=5, seed=0, one_shot=None)
    ex = task[0]
    assert [m["role"] for m in ex.messages] == ["system", "user"]
    near = f"<answer>{ex.answer[:-1]}</answer>"  # one letter short: partial credit from reasoning-gym
    assert task.score(f"<answer>{ex.answer}</answer>", ex) == 1.0
    assert task.score(near, ex) == 0.0  # binary by default
    partial = ReasoningGymTask("spell_backward", size=5, seed=0, binary=False).score(near, ex)
    assert 0.0 < partial < 1.0


def test_auto_one_shot_comes_from_the_generator():
    task = get_task("basic_arithmetic", size=5, seed=0, min_terms=2, max_terms=2, max_digits=1)
    user, assistant = task.one_shot
    assert user.startswith("Calculate") and assistant.startswith("<answer>") and assistant.endswith("</answer>")


def test_one_shot_pair_from_yaml_is_a_list():
    """``task_options.one_shot`` from a YAML config arrives as a list of two strings: same prompt as the tuple."""
    pair = ("Calculate 47 + 38.", "Start from 47, add 30 to get 77, then 8 to get 85.\n<answer>85</answer>")
    from_list = get_task("default", one_shot=list(pair))
    assert from_list.one_shot == pair
    assert from_list[0].messages == get_task("default", one_shot=pair)[0].messages
    assert from_list[0].messages[1:3] == [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    for bad in (["only one"], ["a", "b", "c"], [1, 2]):
        with pytest.raises(ValueError, match="one_shot must be 'auto', None or a \\(user, assistant\\) pair of strings"):
            get_task("default", one_shot=bad)


def test_registry_errors():
    assert {"default", "basic_arithmetic", "gsm8k", "math500"} <= set(task_names())
    with pytest.raises(KeyError, match="valid names: .*default"):
        get_task("nope")
    with pytest.raises(KeyError, match="unknown reasoning-gym dataset 'nope'; valid names: .*basic_arithmetic"):
        get_task("rg:nope")
    with pytest.raises(ValueError, match="invalid config .*min_terms"):
        get_task("basic_arithmetic", min_terms=0)
    with pytest.raises(TypeError):
        get_task("basic_arithmetic", not_a_field=1)
    with pytest.raises(ValueError, match="one_shot must be"):
        get_task("default", one_shot="bad")
    with pytest.raises(IndexError, match="out of range"):
        get_task("default", size=3)[3]
