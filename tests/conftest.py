"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The tests share 2 CPU cores; a single intra-op thread keeps them fast and deterministic.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# AdamW4bit compiles its update by default; tests that want the compiled path opt in explicitly.
os.environ.setdefault("ECHOTRAIN_OPTIM_COMPILE", "0")
# autocast=auto means bfloat16 on CPUs with native bf16; the suite pins it to float32 so that its
# exact comparisons hold on every machine (tests of bfloat16 set autocast=bfloat16 explicitly).
os.environ.setdefault("ECHOTRAIN_NATIVE_BF16", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline copies of the benchmark sets (``../shared/data``); skips if absent."""
    path = Path(os.environ.get("ECHOTRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"shared data folder not found at {path}")
    return path

# ECHOTRAIN_TEST_PLUGINS=<module or .py path>[,...] imports plugins before collection, so the tests
# that enumerate the registries (exactness, properties, low precision, CLI smoke) cover their losses,
# aggregations ... too: a plugin author runs this suite against their own registrations.
if os.environ.get("ECHOTRAIN_TEST_PLUGINS"):
    from echotrain.plugins import load_plugins

    load_plugins(os.environ["ECHOTRAIN_TEST_PLUGINS"])


def _testbed_cached() -> bool:
    from echotrain.models.testbed import testbed_dir

    return (testbed_dir() / "testbed.json").is_file()


@pytest.fixture(scope="session")
def real_testbed():
    """The cache folder of the CPU testbed policy (``model=testbed``). Building it takes ~6 min on
    a busy core, so a test that needs it is marked ``slow`` when the cache is missing (below):
    ``-m "not slow"`` leaves it out instead of building silently; ``echotrain testbed`` fills it."""
    from echotrain.models.testbed import testbed_dir

    return testbed_dir()


def pytest_collection_modifyitems(config, items):
    """Tests that use ``real_testbed`` are ``slow`` when its cache is missing (they would build it)."""
    users = [item for item in items if "real_testbed" in getattr(item, "fixturenames", ())]
    if users and not _testbed_cached():
        for item in users:
            item.add_marker(pytest.mark.slow)
