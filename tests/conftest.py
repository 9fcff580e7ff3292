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
