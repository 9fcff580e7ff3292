"""Fixtures of the runtime modules' tests (tests/runtime mirrors src/echotrain/runtime): the tiny
randomly initialised Llama, its char-level tokenizer, the digit task and the trainer builders are
the trainer tests' (tests/train/conftest.py), imported here so both folders share one copy."""

from tests.train.conftest import (  # noqa: F401 - pytest finds fixtures by name in a conftest
    build_trainer,
    digit_task,
    make_tiny_model,
    run_trainer,
    tiny_model,
    tiny_tokenizer,
)
