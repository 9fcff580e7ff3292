"""``task=jsonl``: any prompt/answer JSONL file, with configurable field names.

    echotrain train task=jsonl task_options.path=data.jsonl \
        task_options.prompt_field=question task_options.answer_field=answer

Each line is a JSON object; the prompt is ``prompt_field`` (default: the first of ``prompt``,
``question``, ``problem`` present in the first row) and the gold answer ``answer_field``
(default ``answer``). Answers are compared with math-verify like GSM8K/MATH
(:class:`echotrain.tasks.math_sets.JsonlMathTask`); a custom ``reward=module:fn`` can score
anything else. Other options (``answer_format``, ``system``, ``limit``, ``verify_timeout_s``)
are those of ``JsonlMathTask``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echotrain.tasks.base import register_task
from echotrain.tasks.math_sets import JsonlMathTask, load_jsonl_lines

PROMPT_FIELDS = ("prompt", "question", "problem")


@register_task("jsonl")
def _jsonl(*, path: str | Path | None = None, prompt_field: str | None = None, answer_field: str = "answer",
           split: str = "train", **options: Any) -> JsonlMathTask:
    """Build the generic JSONL task (see the module docstring).

    Raises:
        ValueError: no ``path``; a row without the prompt or answer field (1-based line number).
        FileNotFoundError: ``path`` does not exist.
    """
    if not path:
        raise ValueError("task=jsonl needs task_options.path=FILE.jsonl (one JSON object per line)")
    file, rows, lines = load_jsonl_lines(path, split=split)
    if prompt_field is None:
        prompt_field = next((f for f in PROMPT_FIELDS if f in rows[0]), None)
        if prompt_field is None:
            raise ValueError(f"{file}:{lines[0]}: none of the prompt fields {list(PROMPT_FIELDS)} is present (it has "
                             f"{sorted(rows[0])}); set task_options.prompt_field=NAME")
    for row, line in zip(rows, lines):
        missing = [k for k in (prompt_field, answer_field) if k not in row]
        if missing:
            raise ValueError(f"{file}:{line}: line {line} lacks field(s) {missing}; it has {sorted(row)} (set "
                             "task_options.prompt_field / task_options.answer_field)")
    data = [{**{k: v for k, v in r.items() if k not in (prompt_field, answer_field)},
             "question": str(r[prompt_field]), "answer": str(r[answer_field])} for r in rows]
    return JsonlMathTask("jsonl", data, **options)
