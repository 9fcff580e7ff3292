"""Fixtures of the echotrain.rl tests: random but structured RL batches, and data-parallel ranks
simulated as threads of one process (the exactness tests under ``world`` ranks)."""

from __future__ import annotations

import threading
from typing import Callable

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


class ThreadAllReduce:
    """Emulates ``all_reduce`` (``op`` "sum" or "max") across ``world`` ranks that run as threads."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.buf: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            self.buf[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.buf)
            out = stacked.sum(0) if op == "sum" else stacked.max(0).values
            self.barrier.wait()
            return t.copy_(out)

        return reduce


def run_on_ranks(world: int, work: Callable[[int, ThreadAllReduce], None]) -> None:
    """Run ``work(rank, reducer)`` for every rank on its own thread, sharing one reducer; the first
    exception of any rank is raised here (the others are released from the barrier)."""
    reducer = ThreadAllReduce(world)
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            work(rank, reducer)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
            reducer.barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.fixture
def run_ranks():
    """The :func:`run_on_ranks` function."""
    return run_on_ranks


def _echo_token_ratios(log_prob, old_log_prob, response_mask, cfg):
    """ECHO's rho~ = kappa rho over one whole step by the loss's own path (its private
    ``_rescale``): ``(rho~ (B, T), R, kappa, clipped)``."""
    from echotrain.rl.echo import _rescale
    from echotrain.rl.surrogate import clamped_log_ratio

    mask = response_mask.bool()
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, cfg.log_ratio_clamp, mask)
    return _rescale(log_ratio, mask, cfg, log_ratio.sum(dtype=torch.float64))


@pytest.fixture(scope="session")
def echo_token_ratios():
    """The :func:`_echo_token_ratios` function (session scope: usable by hypothesis tests)."""
    return _echo_token_ratios
