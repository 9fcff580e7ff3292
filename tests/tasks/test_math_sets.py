"""GSM8K and MATH-500 loaders and tasks on the real files in ../shared/data."""

from __future__ import annotations

import json

import pytest

from echotrain.tasks import get_task, load_gsm8k, load_math500
from echotrain.tasks.math_sets import gsm8k_gold, load_jsonl


def test_gsm8k_loader(shared_data):
    test = load_gsm8k(shared_data / "gsm8k", split="test")
    train = load_gsm8k(shared_data / "gsm8k" / "train.jsonl")
    assert len(test) == 1319 and len(train) == 7473
    assert test[0]["question"].startswith("Janet")
    assert test[0]["answer"] == "18"
    assert train[0]["answer"] == "72"
    assert all("," not in r["answer"] for r in test)  # '#### 2,125' -> '2125'
    assert "2125" in {r["answer"] for r in test}


def test_math500_loader(shared_data):
    rows = load_math500(shared_data / "math500")
    assert len(rows) == 500
    assert rows[0]["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert rows[0]["question"].startswith("Convert the point $(0,3)$")
    assert {"solution", "subject", "level", "unique_id"} <= set(rows[0])


def test_math500_reference_solutions_score_one(shared_data):
    """Every reference solution's last box is math-verify-equal to the gold answer."""
    task = get_task("math500", path=shared_data / "math500")
    assert task.answer_format == "boxed" and "\\boxed{}" in task[0].messages[0]["content"]
    scores = [task.score(ex.metadata["solution"], ex) for ex in task]
    assert sum(scores) == 500
    ex = task[0]
    assert task.score(r"\boxed{(3, \pi/2)}", ex) == 1.0  # equivalent, differently written
    assert task.score(r"\boxed{(3, \pi)}", ex) == 0.0
    assert task.score(r"(3, \pi/2)", ex) == 0.0  # no box, no answer


def test_gsm8k_task_scores(shared_data):
    task = get_task("gsm8k", path=shared_data / "gsm8k", limit=20)
    assert len(task) == 20
    ex = task[0]
    assert [m["role"] for m in ex.messages] == ["system", "user"]
    assert task.score(r"She makes 9 * 2 = 18 dollars. \boxed{18}", ex) == 1.0
    assert task.score(r"\boxed{\$18.00}", ex) == 1.0
    assert task.score(r"\boxed{17} 18", ex) == 0.0
    big = next(e for e in get_task("gsm8k", path=shared_data / "gsm8k") if e.answer == "2125")
    assert get_task("gsm8k", path=shared_data / "gsm8k", limit=1).score(r"\boxed{2,125}", big) == 1.0
    tagged = get_task("gsm8k", path=shared_data / "gsm8k", limit=1, answer_format="tag")
    assert tagged.score("<answer>18</answer>", ex) == 1.0 and tagged.score(r"\boxed{18}", ex) == 0.0


def test_loader_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="JSONL file not found"):
        load_jsonl(tmp_path / "missing.jsonl")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"wrong.jsonl:1: line 1 lacks field\(s\) \['answer'\]"):
        load_math500(wrong)
    with pytest.raises(ValueError, match="no '####' marker"):
        gsm8k_gold("forty two")
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    assert len(get_task("math500", path=ok)) == 1
    with pytest.raises(ValueError, match="answer_format must be one of"):
        get_task("math500", path=ok, answer_format="xml")
    with pytest.raises(ValueError, match="limit must be a positive int"):
        get_task("math500", path=ok, limit=0)
