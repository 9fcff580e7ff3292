"""Fixtures for the trainer tests (helpers in _train_fixtures.py)."""

from __future__ import annotations

import pytest
from _train_fixtures import DigitTask, make_model, make_tokenizer


@pytest.fixture
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return make_model(tiny_tokenizer)


@pytest.fixture
def digit_task():
    return DigitTask()
