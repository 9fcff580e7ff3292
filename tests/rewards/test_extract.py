"""Answer extraction: boxed (brace-balanced, last box, fbox) and <answer> tags."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echotrain.rewards import extract_answer_tag, extract_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $x = \boxed{\frac{1}{3}}$.", r"\frac{1}{3}"),  # nested braces kept whole
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),  # two levels of nesting
        (r"first \boxed{2}, on reflection \boxed{3}", "3"),  # last box wins
        (r"\fbox{5}", "5"),
        (r"\boxed{2} then \fbox{7}", "7"),  # \fbox counts as a box too
        (r"\boxed {  42 }", "42"),  # space before the brace, content stripped
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped set braces do not change the depth
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        ("the answer is 12", None),  # no answer -> None, no 'last number' fallback
        ("", None),
        (r"\boxed{}", None),  # empty box
        (r"\boxed{3} but then \boxed{\frac{1}{", None),  # last box unclosed (truncated)
        (r"\boxed{\boxed{4}}", "4"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>6</answer>", "6"),
        ("8 - 2 = 6\n<answer> 6 </answer>", "6"),
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),  # last tag wins
        ("<ANSWER>\n-3\n</Answer>", "-3"),  # case-insensitive, multi-line
        ("<answer>7", None),  # unclosed (truncated) tag is no answer
        ("<answer></answer>", None),
        ("the answer is 6", None),
        ("", None),
    ],
)
def test_extract_answer_tag(text, expected):
    assert extract_answer_tag(text) == expected


@pytest.mark.parametrize("fn", [extract_boxed, extract_answer_tag])
def test_non_string_input_is_rejected(fn):
    with pytest.raises(TypeError, match="text must be a str"):
        fn(None)


# Balanced LaTeX-ish content: atoms, and groups {..} of it.
_atoms = st.text(alphabet="0123456789abcxy+-*/^_ .,()=\\", min_size=0, max_size=6).filter(
    lambda s: not s.endswith("\\")  # a trailing backslash would escape the closing brace
)
_balanced = st.recursive(_atoms, lambda inner: st.lists(inner, max_size=3).map(lambda xs: "{" + "".join(xs) + "}"))
_content = st.lists(_balanced, min_size=1, max_size=4).map("".join)


@settings(max_examples=60, deadline=None)
@given(
    content=_content,
    prefix=st.text(alphabet="abc 12{}", max_size=10),
    suffix=st.text(alphabet="abc 12.", max_size=10),
)
def test_boxed_roundtrip_for_balanced_content(content, prefix, suffix):
    """Whatever balanced content we box, after any prefix with an earlier box, comes back."""
    text = prefix + r"\boxed{decoy} " + r"\boxed{" + content + "}" + suffix
    expected = content.strip() or None
    assert extract_boxed(text) == expected
