"""The built-in benchmarks: row normalisers and one registration per benchmark.

Suite ``math`` (kind ``math``: last ``\\boxed{}`` of the completion, math-verify equivalence in a
killable worker, as ``echotrain.tasks.JsonlMathTask``; system prompt
``MATH_SYSTEM_PROMPTS["boxed"]``):

==============  =====================================================  ==============================
name            local row fields (as in the public files)              gold answer
==============  =====================================================  ==============================
gsm8k           question, answer (solution ending ``#### 42``)          the number after ``####``
math500         problem, answer (solution, subject, level, unique_id)   ``answer``
aime24          problem (or question), answer                           ``answer`` (``"025"`` -> ``25``)
amc23           problem (or question), answer (a float such as 27.0)    ``answer`` (``27.0`` -> ``27``)
minerva_math    problem, solution (answer in its last ``\\boxed{}``)     ``answer`` if present, else that box
olympiadbench   question, final_answer (list), context, unit            the ``final_answer`` items, ``$``
                                                                        removed, joined by ``", "``
==============  =====================================================  ==============================

Suite ``mc`` (kind ``choice``; format in ``echotrain.evalsuite.choice``): ``gpqa`` (GPQA
Diamond), ``mmlu_pro``, ``arc_challenge``. No local copies ship with echotrain: give files in
the documented format (or the hub schema) with ``--data-dir`` or ``NAME=PATH``.

Hub defaults (used only when neither a path nor a data folder is given; need network) are
listed in each registration; their field names are read by the same normalisers.
"""

from __future__ import annotations

from typing import Any

from echotrain.evalsuite.choice import CHOICE_SYSTEM_PROMPT, CHOICE_TEMPLATE, ChoiceTask, normalize_choice_row
from echotrain.evalsuite.registry import Benchmark, HubSource, Kind, register_benchmark, register_kind
from echotrain.rewards.extract import extract_boxed
from echotrain.tasks.math_sets import MATH_SYSTEM_PROMPTS, JsonlMathTask, gsm8k_gold

__all__ = [
    "clean_gold",
    "normalize_gsm8k_row",
    "normalize_math_row",
    "normalize_olympiadbench_row",
]

MATH_TEMPLATE = "{question}"


def _first(row: dict[str, Any], keys: tuple[str, ...], what: str) -> Any:
    for k in keys:
        if row.get(k) not in (None, ""):
            return row[k]
    raise ValueError(f"no {what} field (looked for {', '.join(map(repr, keys))}); the row has {sorted(row)}")


def clean_gold(answer: Any) -> str:
    """A gold answer as text: integral floats lose ``.0`` (AMC23's ``27.0`` -> ``27``), integer
    strings lose leading zeros (AIME's ``025`` -> ``25``), other values are stripped strings.

    Raises:
        ValueError: an empty answer or a boolean.
    """
    if isinstance(answer, bool):
        raise ValueError(f"answer must be text or a number, got {answer!r}")
    if isinstance(answer, float) and answer.is_integer():
        text = str(int(answer))
    else:
        text = str(answer).strip()
    if text.isdigit():
        text = str(int(text))
    if not text:
        raise ValueError("empty 'answer'")
    return text


def _question(row: dict[str, Any]) -> str:
    q = _first(row, ("problem", "question", "Problem", "Question"), "question ('problem' or 'question')")
    if not isinstance(q, str) or not q.strip():
        raise ValueError("the question must be a non-empty string")
    return q.strip()


def normalize_gsm8k_row(row: dict[str, Any]) -> dict[str, Any]:
    """GSM8K row ``{"question", "answer": "... #### 42"}`` -> ``{"question", "answer": "42", "solution"}``."""
    solution = row["answer"]
    if not isinstance(solution, str):
        raise ValueError(f"'answer' must be the solution text ending in '#### <number>', got {solution!r}")
    return {"question": _question(row), "answer": gsm8k_gold(solution), "solution": solution}


def normalize_math_row(row: dict[str, Any]) -> dict[str, Any]:
    """A math row: question from ``problem``/``question``, gold from ``answer``/``final_answer``,
    else the last ``\\boxed{}`` of ``solution`` (Minerva Math). Other fields are kept."""
    if any(row.get(k) not in (None, "") for k in ("answer", "final_answer", "Answer")):
        gold = clean_gold(_first(row, ("answer", "final_answer", "Answer"), "answer"))
    else:
        solution = row.get("solution")
        boxed = extract_boxed(solution) if isinstance(solution, str) else None
        if boxed is None:
            raise ValueError(f"no 'answer' field and no \\boxed{{}} answer in 'solution'; the row has {sorted(row)}")
        gold = boxed
    keep = {k: v for k, v in row.items() if k not in ("problem", "question", "Problem", "Question", "answer",
                                                      "Answer")}
    return {**keep, "question": _question(row), "answer": gold}


def normalize_olympiadbench_row(row: dict[str, Any]) -> dict[str, Any]:
    """OlympiadBench row -> ``{"question", "answer", ...}``: ``context`` (if any) precedes the
    question; the gold is the ``final_answer`` list with ``$`` removed, joined by ``", "``."""
    final = row["final_answer"]
    items = final if isinstance(final, list) else [final]
    parts = [str(x).replace("$", "").strip() for x in items if str(x).strip()]
    if not parts:
        raise ValueError("empty 'final_answer'")
    question = _question(row)
    context = row.get("context")
    if isinstance(context, str) and context.strip() and context.strip() != "None":
        question = context.strip() + "\n\n" + question
    keep = {k: v for k, v in row.items() if k not in ("question", "final_answer")}
    return {**keep, "question": question, "answer": clean_gold(", ".join(parts))}


def _build_math(name: str, rows: list[dict[str, Any]], system: str | None, template: str | None,
                verify_timeout_s: float | None) -> JsonlMathTask:
    tpl = template or MATH_TEMPLATE
    prompts = [{**r, "question": tpl.format(**r)} for r in rows]
    return JsonlMathTask(name, prompts, answer_format="boxed", system=system or MATH_SYSTEM_PROMPTS["boxed"],
                         verify_timeout_s=verify_timeout_s)


def _build_choice(name: str, rows: list[dict[str, Any]], system: str | None, template: str | None,
                  verify_timeout_s: float | None) -> ChoiceTask:
    return ChoiceTask(name, rows, system=system or CHOICE_SYSTEM_PROMPT, template=template or CHOICE_TEMPLATE)


register_kind("math", Kind(build=_build_math, normalize=normalize_math_row))
register_kind("choice", Kind(build=_build_choice, normalize=normalize_choice_row))

# --- suite "math" -------------------------------------------------------------------------------
for _b in (
    Benchmark("gsm8k", "math", normalize_gsm8k_row, hub=HubSource("openai/gsm8k", "main", "test"),
              description="GSM8K test, 1319 grade-school word problems (Cobbe et al. 2021)"),
    Benchmark("math500", "math", normalize_math_row, hub=HubSource("HuggingFaceH4/MATH-500", None, "test"),
              description="MATH-500, 500 competition problems (Lightman et al. 2023)"),
    Benchmark("aime24", "math", normalize_math_row, hub=HubSource("HuggingFaceH4/aime_2024", None, "train"),
              description="AIME 2024, 30 problems, integer answers 0-999"),
    Benchmark("amc23", "math", normalize_math_row, hub=HubSource("math-ai/amc23", None, "test"),
              description="AMC 2023, 40 problems"),
    Benchmark("minerva_math", "math", normalize_math_row, hub=HubSource("math-ai/minervamath", None, "test"),
              description="Minerva Math (OCWCourses), 272 science problems (Lewkowycz et al. 2022)"),
    Benchmark("olympiadbench", "math", normalize_olympiadbench_row,
              hub=HubSource("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
              description="OlympiadBench, 675 open-ended English math problems (He et al. 2024)"),
):
    register_benchmark("math", _b)

# --- suite "mc" ---------------------------------------------------------------------------------
for _b in (
    Benchmark("gpqa", "choice", normalize_choice_row, files=("gpqa/test.jsonl", "gpqa.jsonl", "gpqa_diamond.jsonl"),
              hub=HubSource("Idavidrein/gpqa", "gpqa_diamond", "train"),
              description="GPQA Diamond, 198 graduate-level science questions, 4 choices (gated on the hub)"),
    Benchmark("mmlu_pro", "choice", normalize_choice_row, hub=HubSource("TIGER-Lab/MMLU-Pro", None, "test"),
              description="MMLU-Pro, up to 10 choices (Wang et al. 2024)"),
    Benchmark("arc_challenge", "choice", normalize_choice_row,
              files=("arc_challenge/test.jsonl", "arc_challenge.jsonl", "arc_c/test.jsonl", "arc_c.jsonl"),
              hub=HubSource("allenai/ai2_arc", "ARC-Challenge", "test"),
              description="ARC-Challenge, grade-school science, 4-5 choices (Clark et al. 2018)"),
):
    register_benchmark("mc", _b)
