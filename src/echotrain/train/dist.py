"""Data parallelism for ``echotrain train``: the one place that answers "am I rank 0, how do I shard".

Launched by ``torchrun --nproc_per_node N`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), the trainer calls :func:`init_distributed` once and then asks
the returned :class:`DistContext` everything rank-dependent:

- ``is_main``: rank 0 alone writes metrics, samples, plots, checkpoints and the final model.
- ``shard(n)``: this rank's contiguous share of ``n`` items (whole prompt groups).
- ``gather(obj)``: every rank's object, in rank order (rollouts, per-row log-probs, metric sums).
- ``all_reduce_grads(params)``: sum of the ranks' gradients, in place.
- ``broadcast(obj)`` / ``broadcast_params(module)``: rank 0's value on every rank.

Without torchrun (no ``WORLD_SIZE`` > 1 in the environment and no initialised process group)
the context is the single-process one: rank 0 of 1, every collective an identity, so the
single-process trainer runs exactly the code it ran before.

Gradient reduction is an explicit ``all_reduce(SUM)`` of one flat buffer per optimizer step,
not ``DistributedDataParallel``: each rank's loss is already its exact share of the step loss
(``compute_step_stats(..., dp_size=1)``: step-global normalisers), so the *sum* is the global
gradient; a rank may hold no rows of a mini-batch (uneven whole groups) and still joins the
reduction with zero gradients; SAM calls the forward/backward closure twice per step; and
gradient clipping must see the reduced gradient. DDP's backward hooks would need ``no_sync``
around the micro-batches and a second pass for SAM, for the same bytes on the wire.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

#: valid values of the ``dist_backend`` config key
BACKENDS = ("auto", "gloo", "nccl")

#: this process's communication so far (benchmarks read it): bytes this rank contributed to
#: gradient all-reduces / object gathers / broadcasts, and wall seconds spent in collectives
TRAFFIC = {"all_reduce_bytes": 0, "gather_bytes": 0, "broadcast_bytes": 0, "seconds": 0.0}


class WorldSizeMismatch(RuntimeError):
    """A checkpoint written by a run of another number of processes (resume refused)."""


def env_world_size() -> int:
    """``WORLD_SIZE`` from the launcher's environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets ``TORCHELASTIC_RUN_ID`` and ``RANK``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def local_world_size() -> int:
    """Processes on this machine (``LOCAL_WORLD_SIZE`` from torchrun, else 1); used to split
    the CPU cores between them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the data-parallel group.

    Attributes:
        rank: 0 .. world_size - 1.
        world_size: number of processes (1 without a process group).
        local_rank: index on this machine (selects ``cuda:<local_rank>``).
        backend: ``"gloo"``, ``"nccl"`` (NCCL for CUDA tensors, gloo for CPU ones) or None
            (single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on rank 0: the process that writes every output file."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when there is more than one process."""
        return self.world_size > 1

    def shard(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (``torch.tensor_split`` sizes: the first
        ``n % world_size`` ranks get one more). May be empty when ``n < world_size``."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    # ---- collectives (identities on one process) ---------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable; tensors should be on CPU), in rank order."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        import pickle
        import time

        t0 = time.perf_counter()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        TRAFFIC["gather_bytes"] += len(pickle.dumps(obj))
        TRAFFIC["seconds"] += time.perf_counter() - t0
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        import pickle
        import time

        t0 = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        TRAFFIC["broadcast_bytes"] += len(pickle.dumps(box[0]))
        TRAFFIC["seconds"] += time.perf_counter() - t0
        return box[0]

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's ``module`` (in place), so that
        randomly initialised weights (e.g. LoRA adapters) start equal on all ranks."""
        if not self.enabled:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over all ranks, in place, in one flat buffer.

        A parameter without a gradient on this rank (no rows in this mini-batch) contributes
        zeros and receives the sum. Bytes sent per call ~ 2 x (world-1)/world x the gradient
        size (ring all-reduce)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        import time

        t0 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        TRAFFIC["all_reduce_bytes"] += flat.numel() * flat.element_size()
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        TRAFFIC["seconds"] += time.perf_counter() - t0

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` on CUDA, ``gloo`` otherwise; an explicit name is returned as is.

    Raises:
        ValueError: unknown backend, or ``nccl`` on a non-CUDA device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"dist_backend={backend!r} is not valid; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"dist_backend='nccl' needs a CUDA device, got device={device}; use gloo on CPU")
    return backend


def init_distributed(backend: str = "auto", device: torch.device | None = None) -> DistContext:
    """The process's :class:`DistContext`, initialising the default process group when launched
    by torchrun (or reusing one the caller initialised). One process under torchrun
    (``--nproc_per_node 1``) initialises its group too, so the backend (NCCL's communicator on
    the GPU) is set up and recorded as in a larger run: the trainer's own collectives stay off
    (``enabled`` is False) and the step statistics' all-reduce (:mod:`echotrain.rl.stepwise`,
    which follows an initialised group) runs over the one rank, the same numbers as without
    torchrun.

    Args:
        backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
        device: the training device (``cuda`` becomes ``cuda:<LOCAL_RANK>`` in the trainer).

    Raises:
        ValueError: see :func:`resolve_backend`.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                           local_rank=int(os.environ.get("LOCAL_RANK", "0")), backend=dist.get_backend())
    if env_world_size() <= 1 and not launched_by_torchrun():
        return DistContext()
    device = device or torch.device("cpu")
    name = resolve_backend(backend, device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "nccl":
        # CPU tensors (step statistics of stepwise, which live on the CPU) go through gloo,
        # CUDA tensors (gradients) through NCCL
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(name)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, backend=name)


def rank_seed(seed: int, rank: int) -> int:
    """Seed of rank ``rank``'s RNG stream: ``seed`` on rank 0 (so one process is the plain run),
    a distinct derived seed on the others."""
    return seed if rank == 0 else (seed * 1_000_003 + 104_729 * rank) % (2**63 - 1)
