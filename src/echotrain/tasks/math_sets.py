"""GSM8K and MATH-500-style JSONL math sets, scored by math-verify equivalence.

* GSM8K (Cobbe et al., 2021, arXiv:2110.14168): rows ``{"question", "answer"}`` where the answer
  is a solution ending in ``#### <number>``; the gold answer is that number (commas removed).
* MATH-500 (Lightman et al., 2023, "Let's Verify Step by Step"; a 500-problem subset of MATH,
  Hendrycks et al., 2021): rows ``{"problem", "solution", "answer", ...}``.

Either is read from a local JSONL file (or a folder holding ``<split>.jsonl``) given as
``path=``, or from the Hugging Face hub through ``datasets`` when no path is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from echotrain.rewards.isolated import call_isolated
from echotrain.rewards.math import math_equal, normalize_answer
from echotrain.tasks.base import ANSWER_FORMATS, Example, extract_final_answer, register_task
from echotrain.tasks.indexed import IndexedTask

__all__ = ["MATH_SYSTEM_PROMPTS", "JsonlMathTask", "load_gsm8k", "load_jsonl", "load_jsonl_lines", "load_math500"]

MATH_SYSTEM_PROMPTS = {
    "boxed": "Solve the problem step by step. Put the final answer within \\boxed{}.",
    "tag": "Solve the problem step by step. Give the final answer inside <answer> </answer> tags.",
}


def load_jsonl_lines(path: str | Path, *, split: str = "test") -> tuple[Path, list[dict[str, Any]], list[int]]:
    """``(file, rows, line numbers)`` of a JSONL file (or ``<path>/<split>.jsonl`` for a folder);
    ``lines[i]`` is the 1-based line of ``rows[i]`` in the file (blank lines are skipped).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not valid JSON or not an object (message gives file and line
            number), or the file is empty.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / f"{split}.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"JSONL file not found: {p}")
    rows, lines = [], []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            lines.append(lineno)
    if not rows:
        raise ValueError(f"{p} holds no rows")
    return p, rows, lines


def load_jsonl(path: str | Path, *, split: str = "test", line_numbers: bool = False) -> list[Any]:
    """Rows of a JSONL file, or of ``<path>/<split>.jsonl`` when ``path`` is a folder.

    With ``line_numbers=True`` each item is ``(lineno, row)``, ``lineno`` 1-based in the file
    (blank lines are skipped but counted), so callers can name the line of a malformed row.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not valid JSON (message gives file and line number) or the file is empty.
    """
    _, rows, lines = load_jsonl_lines(path, split=split)
    return list(zip(lines, rows)) if line_numbers else rows


def _require(rows: list[dict[str, Any]], keys: tuple[str, ...], source: str, lines: list[int] | None = None) -> None:
    """Every row has ``keys``; the error gives the 1-based line number when ``lines`` is known,
    else the 1-based row number."""
    for i, row in enumerate(rows):
        missing = [k for k in keys if k not in row]
        if missing:
            where = f"{source}:{lines[i]}: line {lines[i]}" if lines is not None else f"{source}: row {i + 1}"
            raise ValueError(f"{where} lacks field(s) {missing}; it has {sorted(row)}")


def gsm8k_gold(solution: str) -> str:
    """The final number of a GSM8K solution (after ``####``), thousands separators removed.

    Raises:
        ValueError: no ``####`` marker.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '####' marker: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(path: str | Path | None = None, *, split: str = "test") -> list[dict[str, str]]:
    """GSM8K rows ``{"question", "answer", "solution"}`` (``answer`` = the final number).

    Args:
        path: a local JSONL file or a folder with ``<split>.jsonl``; ``None`` loads
            ``openai/gsm8k`` (config ``main``) from the hub via ``datasets``.
        split: ``"train"`` or ``"test"``.
    """
    if path is None:
        from datasets import load_dataset

        raw = [dict(r) for r in load_dataset("openai/gsm8k", "main", split=split)]
        source, lines = f"openai/gsm8k[{split}]", None
    else:
        file, raw, lines = load_jsonl_lines(path, split=split)
        source = str(file)
    _require(raw, ("question", "answer"), source, lines)
    out = []
    for i, r in enumerate(raw):
        try:
            out.append({"question": r["question"], "answer": gsm8k_gold(r["answer"]), "solution": r["answer"]})
        except ValueError as exc:
            where = f"{source}:{lines[i]}" if lines is not None else f"{source} row {i + 1}"
            raise ValueError(f"{where}: {exc}") from None
    return out


def load_math500(path: str | Path | None = None, *, split: str = "test") -> list[dict[str, Any]]:
    """MATH-500 rows ``{"question", "answer", "solution", "subject", "level", "unique_id"}``.

    Args:
        path: a local JSONL file or a folder with ``<split>.jsonl``; ``None`` loads
            ``HuggingFaceH4/MATH-500`` from the hub via ``datasets``.
        split: the split (MATH-500 has only ``"test"``).
    """
    if path is None:
        from datasets import load_dataset

        raw = [dict(r) for r in load_dataset("HuggingFaceH4/MATH-500", split=split)]
        source, lines = f"HuggingFaceH4/MATH-500[{split}]", None
    else:
        file, raw, lines = load_jsonl_lines(path, split=split)
        source = str(file)
    _require(raw, ("problem", "answer"), source, lines)
    keep = ("solution", "subject", "level", "unique_id")
    return [{"question": r["problem"], "answer": str(r["answer"]), **{k: r[k] for k in keep if k in r}} for r in raw]


class JsonlMathTask(IndexedTask):
    """A fixed list of math problems scored by math-verify.

    Args:
        name: task name (``"gsm8k"``, ``"math500"``, ...).
        rows: dicts with at least ``"question"`` and ``"answer"`` (gold, LaTeX or plain text);
            other fields go to ``Example.metadata``.
        answer_format: ``"boxed"`` (last ``\\boxed{}``/``\\fbox{}``, default) or ``"tag"``.
        system: system instruction (default: ``MATH_SYSTEM_PROMPTS[answer_format]``).
        one_shot: optional ``(user, assistant)`` example exchange.
        limit: keep only the first ``limit`` rows.
        verify_timeout_s: time limit of one math-verify comparison, run in a separate worker
            process that is killed on overrun (``echotrain.rewards.call_isolated``): sympy can
            block inside C code, which no in-process timeout stops. ``None`` compares in-process
            without a limit (then rely on ``RewardFunction``'s timeout).

    Raises:
        ValueError: empty ``rows``, a row without ``question``/``answer``, bad ``answer_format``,
            ``limit`` or ``verify_timeout_s``.
    """

    def __init__(
        self,
        name: str,
        rows: list[dict[str, Any]],
        *,
        answer_format: str = "boxed",
        system: str | None = None,
        one_shot: tuple[str, str] | None = None,
        limit: int | None = None,
        verify_timeout_s: float | None = 3.0,
    ):
        if verify_timeout_s is not None and not (isinstance(verify_timeout_s, (int, float)) and verify_timeout_s > 0):
            raise ValueError(f"verify_timeout_s must be a positive number of seconds or None, got {verify_timeout_s!r}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        if limit is not None:
            if not isinstance(limit, int) or limit < 1:
                raise ValueError(f"limit must be a positive int or None, got {limit!r}")
            rows = rows[:limit]
        if not rows:
            raise ValueError(f"task {name!r} has no rows")
        _require(rows, ("question", "answer"), name)
        self.name = name
        self.rows = rows
        self.answer_format = answer_format
        self.system = MATH_SYSTEM_PROMPTS[answer_format] if system is None else system
        self.one_shot = one_shot
        self.verify_timeout_s = verify_timeout_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Example:
        row = self.rows[index]
        return self.chat_example(index, row["question"], str(row["answer"]),
                                 {k: v for k, v in row.items() if k not in ("question", "answer")})

    def extract(self, completion: str) -> str | None:
        """The final answer in the task's format, or ``None``."""
        return extract_final_answer(completion, self.answer_format)

    def score(self, completion: str, example: Example) -> float:
        """1.0 when the extracted answer is math-verify-equal to the gold answer, else 0.0.

        No answer in the task's format gives 0.0. Identical answers (after
        ``normalize_answer``) are decided here; the rest goes to math-verify in the killable
        worker process (see ``verify_timeout_s``).

        Raises:
            RewardTimeout: math-verify took longer than ``verify_timeout_s``.
        """
        pred = self.extract(completion)
        if pred is None:
            return 0.0
        if normalize_answer(pred) == normalize_answer(example.answer):
            return 1.0
        if self.verify_timeout_s is None:
            return 1.0 if math_equal(pred, example.answer) else 0.0
        return 1.0 if call_isolated(math_equal, pred, example.answer, timeout_s=self.verify_timeout_s) else 0.0

    def __repr__(self) -> str:
        return f"JsonlMathTask({self.name!r}, n={len(self)}, answer_format={self.answer_format!r})"


@register_task("gsm8k")
def _gsm8k(*, path: str | Path | None = None, split: str = "test", **options: Any) -> JsonlMathTask:
    return JsonlMathTask("gsm8k", load_gsm8k(path, split=split), **options)


@register_task("math500")
def _math500(*, path: str | Path | None = None, split: str = "test", **options: Any) -> JsonlMathTask:
    return JsonlMathTask("math500", load_math500(path, split=split), **options)


_gsm8k.hub_dataset = "openai/gsm8k"  # type: ignore[attr-defined]  (read by echotrain.runtime.preflight)
_math500.hub_dataset = "HuggingFaceH4/MATH-500"  # type: ignore[attr-defined]
