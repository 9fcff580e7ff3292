"""The calculator environment's prompt-side warm-up (``env_options.demonstrate``): the longest
evaluable expression of a question, and worked examples turned into worked tool uses."""

from __future__ import annotations

import json

import pytest

from echotrain.envs.calculator import CalculatorEnv, demonstrate_calls, find_expression
from echotrain.tasks.base import Example

SYSTEM = {"role": "system", "content": "Give the answer in <answer> </answer> tags."}
SHOT_Q = {"role": "user", "content": "Calculate 717 + -55 * -709 - -697 + 810 * 904."}
SHOT_A = {"role": "assistant", "content": "<answer>772649</answer>"}
QUESTION = {"role": "user", "content": "Calculate ( -6 * 9 * -2 / 1 ) - 2 + 6."}


@pytest.mark.parametrize("text, expected", [
    ("Calculate 717 + -55 * -709 - -697 + 810 * 904.", ("717 + -55 * -709 - -697 + 810 * 904", "772649")),
    ("Calculate -( -9 + 7 * 5 * -4 + -5 ).", ("-( -9 + 7 * 5 * -4 + -5 )", "154")),
    ("Calculate ( -6 * 9 * -2 / 1 ) - 2 + 6.", ("( -6 * 9 * -2 / 1 ) - 2 + 6", "112")),
    ("7 / 2 then 12 * 12 + 1", ("12 * 12 + 1", "145")),     # the longest evaluable run
    ("What is 1 / 0 or 2 + 3?", ("2 + 3", "5")),            # 1 / 0 does not evaluate: skipped
    ("There are 12 apples.", None),                          # a number is no expression
    ("", None),
    ("Compute " + "+".join(["1"] * 1500) + ".", None),      # past MAX_EXPRESSION_CHARS: skipped
    ("Compute " + "(" * 210 + "1+1" + ")" * 210 + ".", None),  # nesting too deep for the parser: skipped, no crash
])
def test_find_expression(text, expected):
    assert find_expression(text) == expected


def test_worked_examples_become_worked_tool_uses():
    call = json.dumps({"name": "calculator", "arguments": {"expression": "717 + -55 * -709 - -697 + 810 * 904"}})
    assert demonstrate_calls([SYSTEM, SHOT_Q, SHOT_A, QUESTION]) == [
        SYSTEM, SHOT_Q, {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": "772649"}, SHOT_A, QUESTION]
    # no worked example, or one without an expression: unchanged (and a new list, the input intact)
    plain = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, QUESTION]
    out = demonstrate_calls(plain)
    assert out == plain and out is not plain
    assert demonstrate_calls([SYSTEM, QUESTION]) == [SYSTEM, QUESTION]


def test_calculator_env_demonstrates_only_when_asked():
    ex = Example(messages=[SYSTEM, SHOT_Q, SHOT_A, QUESTION], question=QUESTION["content"], answer="112",
                 task="rg:basic_arithmetic", index=0)
    plain, shown = CalculatorEnv().reset(ex), CalculatorEnv(demonstrate=True).reset(ex)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert shown[0] == plain[0] and "<tools>" in shown[0]["content"]  # the tool still described
    assert shown[2]["content"].startswith('<tool_call>{"name": "calculator"') and shown[3]["content"] == "772649"
    # plain-string prompts (the byte-level testbed) are left as they are
    assert CalculatorEnv(demonstrate=True).reset(
        Example(messages="4817+2933=", question="4817+2933=", answer="7750", task="testbed-calc", index=0)) == "4817+2933="
    with pytest.raises(ValueError, match="env_options.demonstrate must be true or false, got 'yes'"):
        CalculatorEnv(demonstrate="yes")


def test_only_worked_examples_before_the_question_are_demonstrated():
    """The question being asked (the last user message, even before an assistant prefill) never
    gets a worked call with its answer; an example that already calls a tool is kept."""
    prefill = {"role": "assistant", "content": "Let me think."}
    out = demonstrate_calls([SYSTEM, QUESTION, prefill])
    assert out == [SYSTEM, QUESTION, prefill]
    called = {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'}
    assert demonstrate_calls([SYSTEM, SHOT_Q, called, QUESTION]) == [SYSTEM, SHOT_Q, called, QUESTION]
