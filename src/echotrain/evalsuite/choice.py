"""Multiple-choice benchmarks: the row format, letter extraction and the task that scores letters.

The documented local format is one JSON object per line::

    {"question": "Which gas ...?", "choices": ["N2", "O2", "CO2", "Ar"], "answer": "C"}

``answer`` is the letter of the correct choice (``"C"``; ``"(C)"`` is accepted) or its 0-based
index (``2``). Three hub schemas are read as well, so a file exported from the hub works
unchanged:

- MMLU-Pro (TIGER-Lab/MMLU-Pro): ``{"question", "options": [...], "answer": "C", "answer_index": 2}``;
- ARC (allenai/ai2_arc): ``{"question", "choices": {"text": [...], "label": ["A", ...]}, "answerKey": "C"}``
  (numeric labels ``"1".."4"`` are mapped by position);
- GPQA (Idavidrein/gpqa): ``{"Question", "Correct Answer", "Incorrect Answer 1", ..., "Incorrect Answer 3"}``;
  the four choices are shuffled with a seed derived from the question text (SHA-256), so the
  order is the same on every run and machine and the correct one is not always ``A``.

Other fields are kept as metadata. Letters run ``A, B, ...`` (at most 26 choices).
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from typing import Any

from echotrain.rewards.extract import extract_answer_tag, extract_boxed
from echotrain.tasks.base import Example
from echotrain.tasks.indexed import IndexedTask

__all__ = [
    "CHOICE_SYSTEM_PROMPT",
    "CHOICE_TEMPLATE",
    "ChoiceTask",
    "extract_choice_letter",
    "normalize_choice_row",
    "render_choices",
]

LETTERS = string.ascii_uppercase

CHOICE_SYSTEM_PROMPT = (
    "Answer the multiple-choice question. Think step by step, then finish with "
    '"The answer is (X)" where X is the letter of the correct choice.'
)
CHOICE_TEMPLATE = "{question}\n\n{options}"

# A letter on its own: optional "(", the capital letter, optional ")", and no letter or digit
# right after it ("The answer is Avogadro" is not "A").
_LETTER_AT = r"[*_$\s]*\(?\s*([A-Z])\s*\)?(?![A-Za-z0-9])"
# "answer is (C)", "Answer: C", "the correct option is B", "final answer = D", "choice: (A)".
_PHRASE = re.compile(r"(?i:\b(?:answer|option|choice)\s*(?:is|would\s+be|should\s+be|=|:)\s*[:\-]?)" + _LETTER_AT)
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mathit)\s*\{([^{}]*)\}")
_BOX_LETTER = re.compile(r"^\(?\s*([A-Z])\s*\)?(?:[.:)]\s*.*)?$", re.DOTALL)
_ALONE = re.compile(r"^\s*\(?([A-Z])\)?[.)]?\s*$")


def _letter_of(content: str, letters: str) -> str | None:
    """The letter that a box or tag holds: ``C``, ``(C)``, ``\\text{C}``, ``C. 42``; else None."""
    inner = _WRAPPER.sub(r"\1", content).strip().strip("$").strip()
    m = _BOX_LETTER.match(inner)
    return m.group(1) if m and m.group(1) in letters else None


def extract_choice_letter(text: str, num_choices: int = 26) -> str | None:
    """The chosen letter of a multiple-choice completion, or ``None``.

    Candidates, of which the LAST in the text wins: the content of a ``\\boxed{}``/``\\fbox{}``
    or an ``<answer></answer>`` tag that is a letter (``\\boxed{C}``, ``\\boxed{(C)}``,
    ``\\boxed{\\text{C}}``); a phrase ``answer|option|choice`` + ``is|:|=|would be|should be`` +
    a letter (``The answer is (C)``, ``Answer: C``, ``**Answer:** C``, ``The correct option is
    B.``), case-insensitive for the phrase, capital letters only. A completion that is nothing
    but a letter (``C``, ``(C)``, ``C.``) also counts. There is no "any capital letter in the
    text" fallback: a completion without a stated choice scores 0.

    Args:
        text: the completion.
        num_choices: number of choices; only the first ``num_choices`` letters are accepted
            (so ``The answer is I think ...`` is not ``I`` on a 4-choice question).

    Returns:
        One capital letter, or ``None``.

    Raises:
        TypeError: ``text`` is not a ``str``.
        ValueError: ``num_choices`` outside [1, 26].
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not 1 <= num_choices <= len(LETTERS):
        raise ValueError(f"num_choices must be in [1, {len(LETTERS)}], got {num_choices}")
    letters = LETTERS[:num_choices]
    m = _ALONE.match(text)
    if m:
        return m.group(1) if m.group(1) in letters else None
    candidates: list[tuple[int, str]] = []
    for pos, content in _boxes_and_tags(text):
        letter = _letter_of(content, letters)
        if letter is not None:
            candidates.append((pos, letter))
    for m in _PHRASE.finditer(text):
        if m.group(1) in letters:
            candidates.append((m.start(1), m.group(1)))
    return max(candidates)[1] if candidates else None


def _boxes_and_tags(text: str) -> list[tuple[int, str]]:
    """(position, content) of every closed ``\\boxed{}``/``\\fbox{}`` and ``<answer>`` tag.

    Each box (tag) is read by the project's extractor on the text from its start to the start
    of the next box (tag), where it is the last one, so brace matching stays theirs."""
    out: list[tuple[int, str]] = []
    for pattern, extract in ((r"\\(?:boxed|fbox)\s*\{", extract_boxed), (r"(?i)<answer>", extract_answer_tag)):
        starts = [m.start() for m in re.finditer(pattern, text)] + [len(text)]
        for begin, end in zip(starts, starts[1:]):
            content = extract(text[begin:end])
            if content is not None:
                out.append((begin, content))
    return out


def render_choices(choices: list[str]) -> str:
    """``(A) first\\n(B) second ...``: the options block of the prompt."""
    return "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(choices))


def _gold_letter(answer: Any, n: int) -> str:
    if isinstance(answer, bool):
        raise ValueError(f"answer must be a letter or a 0-based index, got {answer!r}")
    if isinstance(answer, int):
        if not 0 <= answer < n:
            raise ValueError(f"answer index {answer} is outside [0, {n - 1}] for {n} choices")
        return LETTERS[answer]
    if isinstance(answer, str):
        letter = answer.strip().strip("()").strip()
        if len(letter) == 1 and letter.upper() in LETTERS[:n]:
            return letter.upper()
        raise ValueError(f"answer {answer!r} is not one of the letters {LETTERS[0]}-{LETTERS[n - 1]} of the "
                         f"{n} choices (or a 0-based index)")
    raise ValueError(f"answer must be a letter or a 0-based index, got {type(answer).__name__} {answer!r}")


def _check_choices(choices: Any) -> list[str]:
    if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
        raise ValueError(f"choices must be a list of 2 to {len(LETTERS)} strings, got {choices!r:.120}")
    out = []
    for i, c in enumerate(choices):
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            c = str(c)
        if not isinstance(c, str) or not c.strip():
            raise ValueError(f"choice {i} must be a non-empty string, got {c!r}")
        out.append(c.strip())
    return out


def _gpqa_choices(row: dict[str, Any]) -> tuple[list[str], str]:
    wrong = [row[k] for k in ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3") if k in row]
    if len(wrong) != 3:
        raise ValueError("a GPQA row needs 'Incorrect Answer 1', 'Incorrect Answer 2' and 'Incorrect Answer 3'")
    choices = _check_choices([row["Correct Answer"], *wrong])
    seed = int.from_bytes(hashlib.sha256(str(row["Question"]).encode()).digest()[:8], "big")
    order = list(range(4))
    random.Random(seed).shuffle(order)
    return [choices[i] for i in order], LETTERS[order.index(0)]


def normalize_choice_row(row: dict[str, Any]) -> dict[str, Any]:
    """One raw multiple-choice row -> ``{"question", "choices": [str, ...], "answer": letter, ...}``.

    Accepts the documented format and the MMLU-Pro, ARC and GPQA hub schemas (module docstring);
    every other field is kept.

    Raises:
        ValueError: not an object, no question, bad choices (not 2-26 non-empty strings), or an
            answer that is not a letter/index of the choices. The message names the field.
    """
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    if "Question" in row and "Correct Answer" in row:  # GPQA
        choices, answer = _gpqa_choices(row)
        question = row["Question"]
        extra = {k: v for k, v in row.items()
                 if k not in ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                              "Incorrect Answer 3")}
    else:
        question = row.get("question")
        raw = row.get("choices", row.get("options"))
        if raw is None:
            raise ValueError(f"no 'choices' (or 'options') field; the row has {sorted(row)}")
        if isinstance(raw, dict):  # ARC: {"text": [...], "label": [...]}
            if "text" not in raw or "label" not in raw:
                raise ValueError("'choices' as an object needs 'text' and 'label' lists (ARC schema)")
            choices = _check_choices(list(raw["text"]))
            labels = [str(x) for x in raw["label"]]
            key = str(row.get("answerKey", row.get("answer", "")))
            if len(labels) != len(choices) or key not in labels:
                raise ValueError(f"answerKey {key!r} is not one of the labels {labels}")
            answer = LETTERS[labels.index(key)]
        else:
            choices = _check_choices(raw)
            if "answer" in row:
                answer = _gold_letter(row["answer"], len(choices))
            elif "answer_index" in row:
                answer = _gold_letter(row["answer_index"], len(choices))
            elif "answerKey" in row:
                answer = _gold_letter(row["answerKey"], len(choices))
            else:
                raise ValueError(f"no 'answer' field (a letter or a 0-based index); the row has {sorted(row)}")
        extra = {k: v for k, v in row.items() if k not in ("question", "choices", "options", "answer")}
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no non-empty 'question' field")
    return {**extra, "question": question.strip(), "choices": choices, "answer": answer}


class ChoiceTask(IndexedTask):
    """Multiple-choice questions scored by the chosen letter (a task for ``RewardFunction``).

    Args:
        name: the benchmark name.
        rows: normalized rows (``normalize_choice_row``): ``question``, ``choices``, ``answer`` letter.
        system: system prompt (default ``CHOICE_SYSTEM_PROMPT``).
        template: user message, ``str.format`` over the row plus ``options`` (the rendered
            choices, ``render_choices``); default ``CHOICE_TEMPLATE``.

    Raises:
        ValueError: empty ``rows`` or a template field the rows lack.
    """

    answer_format = "letter"

    def __init__(self, name: str, rows: list[dict[str, Any]], *, system: str | None = None,
                 template: str = CHOICE_TEMPLATE):
        if not rows:
            raise ValueError(f"task {name!r} has no rows")
        self.name = name
        self.rows = rows
        self.system = CHOICE_SYSTEM_PROMPT if system is None else system
        self.template = template
        self.num_letters = max(len(r["choices"]) for r in rows)
        try:
            self._user(rows[0])
        except KeyError as exc:
            raise ValueError(f"template {template!r} names field {exc.args[0]!r}, which the rows lack") from exc

    def _user(self, row: dict[str, Any]) -> str:
        return self.template.format(**{**row, "options": render_choices(row["choices"])})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Example:
        row = self.rows[index]
        return self.chat_example(index, self._user(row), row["answer"],
                                 {k: v for k, v in row.items() if k not in ("question", "answer")})

    def extract(self, completion: str) -> str | None:
        """The chosen letter (``extract_choice_letter`` over this task's letters) or ``None``."""
        return extract_choice_letter(completion, self.num_letters)

    def score(self, completion: str, example: Example) -> float:
        """1.0 when the stated letter is the gold letter, else 0.0 (no stated letter: 0.0)."""
        letter = extract_choice_letter(completion, len(example.metadata["choices"]))
        return 1.0 if letter is not None and letter == example.answer else 0.0

    def __repr__(self) -> str:
        return f"ChoiceTask({self.name!r}, n={len(self)})"
