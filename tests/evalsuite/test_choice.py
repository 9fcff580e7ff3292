"""Multiple choice: letter extraction (true and false cases), row formats, the task's score."""

from __future__ import annotations

import json

import pytest

from echotrain.evalsuite import ChoiceTask, SuiteInputError, extract_choice_letter, load_suite, normalize_choice_row


@pytest.mark.parametrize("text, letter", [
    ("The answer is (C)", "C"),
    ("The answer is C.", "C"),
    ("Answer: B", "B"),
    ("**Answer:** D", "D"),
    ("answer: (a)... no wait. Final answer: A", "A"),
    ("The correct option is B, because ...", "B"),
    ("So the answer would be (D).", "D"),
    (r"Therefore $\boxed{C}$", "C"),
    (r"\boxed{(B)}", "B"),
    (r"\boxed{\text{D}}", "D"),
    (r"\boxed{A. 42 meters}", "A"),
    ("<answer>B</answer>", "B"),
    ("C", "C"),
    (" (B) ", "B"),
    ("D.", "D"),
    # the last stated choice wins
    ("The answer is (A). Hmm, re-checking: the answer is (C).", "C"),
    (r"First \boxed{A}, then the answer is B", "B"),
    (r"The answer is A? No: \boxed{D}", "D"),
])
def test_extract_choice_letter_true_cases(text, letter):
    assert extract_choice_letter(text, 4) == letter


@pytest.mark.parametrize("text", [
    "",
    "I think A is plausible but B is also possible.",   # no stated answer
    "The answer is Avogadro's number",                   # a word starting with a capital letter
    "Answer: 42",
    r"\boxed{42}",
    r"\boxed{C",                                         # unclosed box
    "the answer is c",                                   # lowercase letter
    "The answer is (F)",                                 # beyond the 4 choices
    "Option A and option B are both wrong",              # no 'is' / ':' after the word
])
def test_extract_choice_letter_false_cases(text):
    assert extract_choice_letter(text, 4) is None


def test_extract_choice_letter_range_and_errors():
    assert extract_choice_letter("The answer is (F)", 10) == "F"
    assert extract_choice_letter("The answer is I think", 4) is None  # "I" is not a letter of 4 choices
    assert extract_choice_letter("The answer is I think", 10) == "I"
    with pytest.raises(ValueError, match="num_choices"):
        extract_choice_letter("A", 0)
    with pytest.raises(TypeError):
        extract_choice_letter(None)


def test_normalize_documented_and_hub_schemas():
    doc = normalize_choice_row({"question": "q?", "choices": ["a", "b", "c"], "answer": "(c)", "id": 7})
    assert doc == {"id": 7, "question": "q?", "choices": ["a", "b", "c"], "answer": "C"}
    assert normalize_choice_row({"question": "q", "choices": ["a", "b"], "answer": 1})["answer"] == "B"
    mmlu = normalize_choice_row({"question": "q", "options": list("abcdefghij"), "answer": "J", "answer_index": 9})
    assert mmlu["choices"][-1] == "j" and mmlu["answer"] == "J"
    arc = normalize_choice_row({"question": "q", "choices": {"text": ["w", "x", "y", "z"],
                                                             "label": ["1", "2", "3", "4"]}, "answerKey": "3"})
    assert arc["choices"] == ["w", "x", "y", "z"] and arc["answer"] == "C"
    gpqa = {"Question": "Which is right?", "Correct Answer": "right", "Incorrect Answer 1": "w1",
            "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"}
    g1, g2 = normalize_choice_row(gpqa), normalize_choice_row(dict(gpqa))
    assert g1 == g2  # same order on every call (seeded by the question)
    assert sorted(g1["choices"]) == ["right", "w1", "w2", "w3"]
    assert g1["choices"]["ABCD".index(g1["answer"])] == "right"


@pytest.mark.parametrize("row, match", [
    ({"question": "q", "choices": ["a"], "answer": "A"}, "2 to 26 strings"),
    ({"question": "q", "choices": ["a", ""], "answer": "A"}, "choice 1 must be a non-empty string"),
    ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "not one of the letters A-B"),
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, r"index 2 is outside \[0, 1\]"),
    ({"question": "q", "choices": ["a", "b"], "answer": True}, "letter or a 0-based index"),
    ({"question": "q", "choices": ["a", "b"]}, "no 'answer' field"),
    ({"question": "", "choices": ["a", "b"], "answer": "A"}, "non-empty 'question'"),
    ({"question": "q", "answer": "A"}, "no 'choices'"),
])
def test_normalize_errors(row, match):
    with pytest.raises(ValueError, match=match):
        normalize_choice_row(row)


def test_choice_task_prompt_and_score():
    rows = [normalize_choice_row({"question": "2+2?", "choices": ["3", "4", "5"], "answer": "B"})]
    task = ChoiceTask("mini", rows)
    ex = task[0]
    assert ex.messages[-1]["content"] == "2+2?\n\n(A) 3\n(B) 4\n(C) 5"
    assert "The answer is (X)" in ex.messages[0]["content"]
    assert task.score("The answer is (B)", ex) == 1.0
    assert task.score("The answer is (A)", ex) == 0.0
    assert task.score("four", ex) == 0.0 and not task.is_formatted("four")
    assert task.score("The answer is (D)", ex) == 0.0  # no choice D on this question
    with pytest.raises(ValueError, match="names field 'topic'"):
        ChoiceTask("mini", rows, template="{topic}: {question}")


def test_choice_file_errors_name_the_line(tmp_path):
    f = tmp_path / "mc.jsonl"
    good = json.dumps({"question": "q", "choices": ["a", "b"], "answer": "A"})
    f.write_text(good + "\n\n" + json.dumps({"question": "q", "choices": ["a", "b"], "answer": "E"}) + "\n")
    with pytest.raises(SuiteInputError, match=r"mc.jsonl:3: benchmark 'mc': answer 'E' is not one of"):
        load_suite(None, [f"choice:mc={f}"])
    f.write_text(good + "\n[1, 2]\n")
    with pytest.raises(SuiteInputError, match=r"mc.jsonl:2: .*must be a JSON object"):
        load_suite(None, [f"choice:mc={f}"])
    f.write_text(good + "\n{oops\n")
    with pytest.raises(SuiteInputError, match=r"mc.jsonl:2: invalid JSON"):
        load_suite(None, [f"choice:mc={f}"])
