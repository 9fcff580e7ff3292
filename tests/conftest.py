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
# The trainer's utilisation figures divide by the machine's measured peaks; the suite gives fixed
# ones (GEMM FLOP/s, copy bytes/s) so that no test measures or writes the roofline cache.
os.environ.setdefault("ECHOTRAIN_ROOFLINE_PEAKS", "1e15,1e13")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline copies of the benchmark sets (``../shared/data``); skips if absent."""
    path = Path(os.environ.get("ECHOTRAIN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"shared data folder not found at {path}")
    return path


@pytest.fixture(scope="session")
def testbed_cache(tmp_path_factory) -> Path:
    """An ``ECHOTRAIN_CACHE`` root where ``model=testbed`` loads at once: the user's cache when it
    holds the built testbed (``echotrain testbed``), else a stand-in with the testbed's architecture
    and random weights under the same key (building the real one takes 3-8 minutes), the
    converted SmolLM2 folder linked in. Sets ``ECHOTRAIN_CACHE`` for the session (subprocesses
    inherit it); returns the root."""
    import json

    from echotrain.cache import default_cache_dir
    from echotrain.models.looped import LoopedTransformer
    from echotrain.models.testbed import TestbedConfig, testbed_dir

    real = default_cache_dir()
    if (testbed_dir(TestbedConfig(), real) / "testbed.json").is_file():
        root = real
    else:
        root = tmp_path_factory.mktemp("echotrain-cache")
        if (real / "models").is_dir():
            (root / "models").symlink_to(real / "models", target_is_directory=True)
        folder = testbed_dir(TestbedConfig(), root)
        folder.mkdir(parents=True)
        torch.manual_seed(0)
        model = LoopedTransformer(TestbedConfig().looped_config())
        torch.save(model.state_dict(), folder / "model.pt")
        (folder / "testbed.json").write_text(json.dumps({"steps": 0, "accuracy": 0.0, "reached_target": False,
                                                         "history": [], "seconds": 0.0, "num_params": model.num_params(),
                                                         "key": folder.name, "stand_in": True}))
    old = os.environ.get("ECHOTRAIN_CACHE")
    os.environ["ECHOTRAIN_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("ECHOTRAIN_CACHE", None)
    else:
        os.environ["ECHOTRAIN_CACHE"] = old


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
