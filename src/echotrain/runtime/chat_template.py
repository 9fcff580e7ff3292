"""Reading a ``chat_template`` override (a Jinja template or a file holding one)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_chat_template"]


def read_chat_template(value: str) -> str:
    """A chat template from ``value``: the template itself (contains ``{{`` or ``{%``) or a file path.

    Raises:
        FileNotFoundError: ``value`` is neither a template nor an existing file.
        ValueError: the template is not valid Jinja.
    """
    text = value
    if "{{" not in value and "{%" not in value:
        p = Path(value).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"chat_template={value!r}: neither a Jinja template nor an existing file")
        text = p.read_text()
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: invalid Jinja at line {exc.lineno}: {exc.message}") from None
    return text
