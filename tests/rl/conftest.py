"""Fixtures of the echotrain.rl tests: random but structured RL batches."""

from __future__ import annotations

import pytest
import torch


def make_batch(
    seed: int = 0,
    B: int = 8,
    T: int = 7,
    group_size: int = 4,
    drift: float = 0.0,
    noise: float = 0.3,
    dtype: torch.dtype = torch.float64,
    empty_row: bool = True,
) -> dict[str, torch.Tensor]:
    """A batch with ragged lengths (one empty response), groups with mixed-sign advantages.

    ``log_prob = old_log_prob + drift + noise * N(0, 1)``; ``log_prob`` is a leaf with grad.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    log_prob = (old + drift + noise * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    group_index = torch.arange(B) // group_size
    rewards = torch.randint(0, 2, (B,), generator=g).to(dtype)
    rewards[0], rewards[2] = 1.0, 0.0  # group 0 has both signs
    from echotrain.rl import compute_advantages

    adv = compute_advantages(rewards, group_index).to(dtype)
    advantages = adv.unsqueeze(-1).expand(B, T).clone()
    return {
        "old_log_prob": old,
        "log_prob": log_prob,
        "advantages": advantages,
        "response_mask": mask,
        "group_index": group_index,
    }


@pytest.fixture
def batch_factory():
    """The :func:`make_batch` function."""
    return make_batch
