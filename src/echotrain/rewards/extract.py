"""Final-answer extraction from model completions (pure string functions).

Two formats are supported: an ``<answer>...</answer>`` tag (the reasoning-gym convention, used
by DeepSeek-R1-style prompts) and the LaTeX ``\\boxed{...}`` / ``\\fbox{...}`` of MATH-style
solutions (Hendrycks et al., 2021). Both take the LAST answer in the text and return ``None``
when there is none: a completion without an answer scores 0, never "the last number in the text".
"""

from __future__ import annotations

import re

__all__ = ["extract_answer_tag", "extract_boxed", "has_answer_tag", "has_boxed"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_answer_tag(text: str) -> str | None:
    """Return the stripped content of the last ``<answer>...</answer>`` in ``text``.

    Tags are matched case-insensitively and may span lines; an opening tag without its closing
    tag (e.g. a completion cut at the token limit) is not an answer.

    Args:
        text: the completion.

    Returns:
        The content of the last complete tag, whitespace-stripped, or ``None`` when there is no
        complete tag or the last one is empty.

    Raises:
        TypeError: if ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    matches = _ANSWER_TAG.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def _balanced_content(text: str, start: int) -> str | None:
    """Content between the ``{`` at ``text[start - 1]`` and its matching ``}`` (or ``None``).

    Escaped braces ``\\{`` and ``\\}`` (LaTeX set braces) do not count towards the depth.
    """
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # skip the escaped character (``\{``, ``\}``, ``\\``)
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    The braces are matched by depth, so ``\\boxed{\\frac{1}{3}}`` gives ``\\frac{1}{3}``; escaped
    braces (``\\{``, ``\\}``) inside the box are kept as text. Only the last box counts: when
    it is unclosed (a completion cut at the token limit) there is no answer, even if an earlier
    box was complete, because the model had moved on from it.

    Args:
        text: the completion.

    Returns:
        The stripped content of the last box, or ``None`` when there is no box, the last box is
        unclosed, or it is empty.

    Raises:
        TypeError: if ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    starts = [m.end() for m in _BOX_COMMAND.finditer(text)]
    if not starts:
        return None
    content = _balanced_content(text, starts[-1])
    if content is None:
        return None
    return content.strip() or None


def has_answer_tag(text: str) -> bool:
    """Whether ``text`` contains a complete, non-empty ``<answer>...</answer>`` tag."""
    return extract_answer_tag(text) is not None


def has_boxed(text: str) -> bool:
    """Whether the last ``\\boxed{}``/``\\fbox{}`` in ``text`` is closed and non-empty."""
    return extract_boxed(text) is not None
