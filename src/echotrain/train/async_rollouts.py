"""Asynchronous rollouts (``async_rollouts=true``, ``max_staleness=k``): a worker process generates
and scores rollout batches continuously with the newest weights it has, while the learner trains.

The overlap of generation with training that prime-rl (``max_off_policy_steps``), AReaL
(``max_head_offpolicyness``), PipelineRL (``max_lag``) and verl's fully-async trainer run, here for
one machine. Versions count training steps as in :mod:`echotrain.train.lag` (the weights after t
steps have version t; step t trains with version t - 1).

Processes and data (docs/design/architecture.md draws them):

- **worker** (``spawn``ed, ``rollout_threads`` threads): its own copy of the policy, a
  :class:`~echotrain.train.collect.Collector` on its own prompt stream, and a loop: take the newest
  published weights (if the version moved), collect and score one step's batch, stamp it with
  ``rollout_version`` (the sampler's log-probs and entropy are recorded inside generation), put it
  on the bounded queue (``max_staleness`` batches). The learner takes one batch a step, in order,
  so the worker knows the step each batch will train: the n-th batch it queues (from 0) trains at
  step ``first_step + n``, by the learner's weights of version ``first_step + n - 1``. With
  ``async_stale=wait`` (the default), before generating it waits (polling the version every
  5 ms) until its weights are at most ``max_staleness`` versions older than those, so it never
  generates a batch that would be too old: nothing it generates is dropped (the wait is in
  ``async/worker_wait_frac``, the count in ``async/worker_generated``). With ``drop`` /
  ``regenerate`` it does not wait (verl's and tinker-cookbook's sampler that never pauses).
  A full queue blocks only the worker (a put with a 0.5 s timeout,
  retried until the learner stops it); with the wait it is full only for the moment between the
  learner's publish and its take.
- **learner** (the Trainer, ``learner_threads``): at step t takes the queue's oldest batch; a batch
  older than k (``(t - 1) - rollout_version > max_staleness``) is dropped (the next one is taken)
  or, with ``async_stale=regenerate``, replaced by a batch the learner generates itself with its
  current weights from a second prompt stream; both are counted. Under ``wait`` this is a guard
  of the bound that does not fire (a drop would only make the worker's later batches train a
  step earlier than it counted, i.e. fresher). After each step it publishes its
  weights: the trainable tensors are copied in place, under a lock, into one shared-memory buffer
  (``torch.Tensor.share_memory_``, no pickling), and a version counter is raised; the worker copies
  the buffer into its own model before its next batch, so it never samples from half-written
  weights. Memory: two more copies of the model on the machine (the buffer and the worker's).
- **batches** travel as ``torch.save`` bytes (a ~0.1 MB rollout batch on the default job), with
  the worker's prompt-stream position after the batch, its generation seconds, the seconds it
  waited before (for the weights, on the full queue) and its count of generated batches.

Dropping wastes generation and skips prompts, and can bias the trained batches towards problems
whose batches come back sooner (short ones), as tinker-cookbook found; regenerating costs the
learner a generation; waiting avoids both (docs/benchmarks.md measures the three). Not
deterministic (which weights sample a batch depends on timing): fixed lag (``staleness=k``) is
the reproducible special case for studies.

Faults: the learner waits for a batch in 1 s slices, checking the worker is alive; a worker that
died ends the run with :class:`RolloutWorkerError` naming it, its exit code and (if it raised)
its traceback, after the trainer checkpoints the last completed step; no batch within
``async_timeout_s`` seconds ends it the same way (a stalled worker). ``--resume`` starts a new
worker from the checkpoint's weights at the checkpoint's prompt-stream position: the batches that
were queued are generated again (by those weights), so a resumed run continues but is not the
run that would have been.
"""

from __future__ import annotations

import copy
import io
import queue as queue_lib
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from echotrain.metrics import Metric, declare_metric
from echotrain.train.step import StepData

#: ``async_stale`` values: what the learner does with a batch older than ``max_staleness``
STALE_POLICIES = ("wait", "drop", "regenerate")

#: The metrics this module adds (only with ``async_rollouts=true``; the ``staleness/*`` metrics of
#: :mod:`echotrain.train.lag` are written too), declared in the metric schema.
ASYNC_METRICS: dict[str, Metric] = {m.name: m for m in (
    declare_metric("async/queue_depth", reduce="step", unit="rollout batches", when="async_rollouts=true",
                   help="batches waiting in the worker-to-learner queue after the learner took its batch"),
    declare_metric("async/dropped", reduce="step", unit="rollout batches", when="async_rollouts=true",
                   panel="Async rollouts", label="dropped (too stale)",
                   help="batches older than max_staleness the learner dropped this step"),
    declare_metric("async/regenerated", reduce="step", unit="rollout batches", when="async_rollouts=true",
                   panel="Async rollouts", label="regenerated by the learner",
                   help="batches older than max_staleness the learner replaced by one it generated itself this step"),
    declare_metric("async/worker_generated", reduce="step", unit="rollout batches", when="async_rollouts=true",
                   help="batches the worker had generated when it queued this step's, counted from its start "
                        "(the run's or the --resume's first step); one more each step when none is wasted"),
    declare_metric("async/learner_wait_frac", reduce="step", unit="fraction of the step's wall time",
                   when="async_rollouts=true",
                   help="share of the step's wall time the learner waited for a batch from the worker"),
    declare_metric("async/worker_wait_frac", reduce="step", unit="fraction of the worker's wall time",
                   when="async_rollouts=true",
                   help="share of the worker's time between its last two batches that it waited for the learner's "
                        "weights (so that the batch is at most max_staleness old) or on the full queue "
                        "(the batch the learner took this step)"),
)}


class RolloutWorkerError(RuntimeError):
    """The rollout worker process died, raised, or sent no batch within ``async_timeout_s``."""


class AsyncUnsupported(RuntimeError):
    """``async_rollouts=true`` where it is not built (torchrun, a device other than the CPU)."""


@dataclass
class WorkerSpec:
    """What the worker process builds its side from (pickled once, at its start).

    Attributes:
        cfg: the run's :class:`~echotrain.train.config.TrainConfig`.
        buffer: the shared-memory copy of the policy (``share_memory()``d module) the learner
            publishes into; the worker deep-copies it into its own model.
        tokenizer, task, reward_fn: as the trainer's (picklable).
        pad_id: padding id for concatenating rounds.
        autocast_dtype: the run's generation autocast dtype (None: none).
        prompt_draws: the worker's prompt stream starts at this position (the checkpoint's on resume).
        threads: ``torch.set_num_threads`` in the worker.
        seed: the worker's torch seed (its sampling draws).
        max_staleness: the worker samples the batch of step s only with weights of version
            >= s - 1 - max_staleness (it waits for them).
        first_step: the step its first batch trains (the learner's version at the start + 1).
        wait: whether it waits for fresh enough weights (``async_stale=wait``); False: it
            generates with the newest weights it has and the learner drops / regenerates.
    """

    cfg: Any
    buffer: Any
    tokenizer: Any
    task: Any
    reward_fn: Any
    pad_id: int
    autocast_dtype: torch.dtype | None
    prompt_draws: int
    threads: int
    seed: int
    max_staleness: int = 1
    first_step: int = 1
    wait: bool = True


def trainable_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter the optimizer changes (``requires_grad``), in order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s.detach())


def _encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _put(q: Any, item: Any, stop: Any) -> tuple[float, bool]:
    """Put ``item`` on the bounded queue, retrying every 0.5 s until there is room or ``stop`` is
    set. Returns the seconds waited and whether it was put."""
    t0 = time.perf_counter()
    while not stop.is_set():
        try:
            q.put(item, timeout=0.5)
            return time.perf_counter() - t0, True
        except queue_lib.Full:
            continue
    return time.perf_counter() - t0, False


def _qsize(q: Any, unknown: int = 0) -> int:
    """``q.qsize()``, or ``unknown`` on a platform whose queues cannot report their size (macOS)."""
    try:
        return int(q.qsize())
    except NotImplementedError:
        return unknown


def worker_main(spec: WorkerSpec, version: Any, lock: Any, q: Any, stop: Any) -> None:
    """The rollout worker process: generate, score and queue batches until ``stop`` is set.

    Any exception is sent to the learner as ``("error", traceback)`` before the process exits
    with status 1."""
    try:
        torch.set_num_threads(max(1, int(spec.threads)))
        torch.manual_seed(spec.seed)
        from echotrain.train.collect import Collector, PromptStream
        from echotrain.train.dist import DistContext

        with lock:
            model = copy.deepcopy(spec.buffer)
            mine = [p for _, p in trainable_tensors(model)]
            shared = [p for _, p in trainable_tensors(spec.buffer)]
            have = int(version.value)
        model.eval()
        prompts = PromptStream(spec.task, spec.cfg.seed)
        prompts.draws = int(spec.prompt_draws)
        collector = Collector(spec.cfg, model, spec.tokenizer, spec.reward_fn, prompts, DistContext(),
                              spec.pad_id, autocast_dtype=spec.autocast_dtype)
        target = int(spec.first_step)  # the step the next batch trains (the learner takes one a step)
        waited, generated = 0.0, 0
        while not stop.is_set():
            t0 = time.perf_counter()
            while True:  # wait until the weights are fresh enough for step `target` (version target - 1)
                if int(version.value) != have:
                    with lock:
                        _copy_into(mine, shared)
                        have = int(version.value)
                if not spec.wait or (target - 1) - have <= spec.max_staleness or stop.is_set():
                    break
                time.sleep(0.005)  # (not stop.wait: a worker killed while waiting on the event would
                # leave it a sleeper that the learner's stop.set() waits for forever)
            if stop.is_set():
                break
            waited += time.perf_counter() - t0
            t0 = time.perf_counter()
            data = collector.collect()
            data.rollout_version = torch.full((len(data),), have, dtype=torch.long)
            busy = time.perf_counter() - t0
            generated += 1
            w, _ = _put(q, ("batch", _encode(data), prompts.draws, busy, waited, generated), stop)
            waited, target = w, target + 1  # (the put's wait is reported with the next batch)
    except BaseException:  # noqa: BLE001 - everything goes to the learner, which names it
        try:
            q.put(("error", traceback.format_exc()), timeout=5)
        finally:
            raise SystemExit(1)


class AsyncRollouts:
    """The learner's side of asynchronous rollouts; the trainer's ``rollouts`` (same interface as
    :class:`~echotrain.train.lag.LaggedRollouts`: :meth:`rollouts_for`, :meth:`step_metrics`,
    :meth:`state_dict`, :meth:`load_state_dict`; plus :meth:`after_step` and :meth:`close`).

    Args:
        spec: the worker's :class:`WorkerSpec` without ``buffer`` / ``prompt_draws`` (filled at start).
        model: the learner's policy (its trainable tensors are published after every step).
        prompts: the learner's :class:`~echotrain.train.collect.PromptStream`: its position follows the
            worker's batches the learner took (so a checkpoint resumes the stream after them).
        regenerate: ``() -> StepData``, the learner's own collect (``async_stale=regenerate``),
            drawing from ``regen_prompts`` (a second stream, so the worker's is not disturbed;
            its position is in :meth:`state_dict`).
        max_staleness: k >= 1, the oldest batch trained on is sampled by version ``t - 1 - k``.
        stale: ``wait`` (the worker waits; a too-old batch, which it does not send, would be
            dropped), ``drop`` or ``regenerate``.
        timeout_s: seconds the learner waits for one batch before :class:`RolloutWorkerError`.

    Raises:
        ValueError: ``max_staleness < 1``, unknown ``stale`` or ``timeout_s <= 0``.
    """

    def __init__(self, spec: WorkerSpec, model: Any, prompts: Any, regenerate: Callable[[], StepData],
                 max_staleness: int, stale: str = "wait", timeout_s: float = 600.0, regen_prompts: Any = None):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        if stale not in STALE_POLICIES:
            raise ValueError(f"async_stale={stale!r} is not valid; valid: {', '.join(STALE_POLICIES)}")
        if not timeout_s > 0:
            raise ValueError(f"async_timeout_s must be > 0, got {timeout_s}")
        self.spec, self.model, self.prompts, self.regenerate = spec, model, prompts, regenerate
        self.regen_prompts = regen_prompts
        self.max_staleness, self.stale, self.timeout_s = int(max_staleness), stale, float(timeout_s)
        self.proc: Any = None
        self.version_now = 0  # version of the learner's weights (set by after_step / at start)
        self._step_info: dict[str, float] = {}

    # ------------------------------------------------------------------ the worker
    def start(self, version: int) -> None:
        """Spawn the worker with the learner's weights (version ``version``) and prompt position."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        buffer = copy.deepcopy(self.model).cpu()
        buffer.share_memory()
        self._shared = [p for _, p in trainable_tensors(buffer)]
        self._mine = [p for _, p in trainable_tensors(self.model)]
        # no lock of its own (written under self.lock, an aligned int64 read whole): the worker polls
        # it every 5 ms, and a worker killed holding a Value's lock would block the next publish
        self.version = ctx.Value("q", int(version), lock=False)
        self.lock, self.stop, self.queue = ctx.Lock(), ctx.Event(), ctx.Queue(maxsize=self.max_staleness)
        self.spec.buffer, self.spec.prompt_draws = buffer, int(self.prompts.draws)
        self.spec.first_step, self.spec.wait = int(version) + 1, self.stale == "wait"
        self.proc = ctx.Process(target=worker_main, args=(self.spec, self.version, self.lock, self.queue, self.stop),
                                name="echotrain-rollout-worker", daemon=True)
        self.proc.start()
        self.spec.buffer = None  # the worker has it; the learner keeps only its tensors
        self.version_now = int(version)

    def publish(self, version: int) -> None:
        """Copy the learner's trainable tensors into the shared buffer and raise the version."""
        with self.lock:
            _copy_into(self._shared, self._mine)
            self.version.value = int(version)
        self.version_now = int(version)

    def _died(self, why: str) -> RolloutWorkerError:
        code = self.proc.exitcode if self.proc is not None else None
        pid = self.proc.pid if self.proc is not None else None
        return RolloutWorkerError(f"the rollout worker process (echotrain-rollout-worker, pid {pid}) {why}"
                                  + (f" (exit code {code})" if code is not None else "")
                                  + "; the run directory has the checkpoint of the last completed step: "
                                    "`echotrain train --resume RUN_DIR` continues (the queued batches are "
                                    "generated again by the checkpoint's weights)")

    def _take(self) -> tuple[Any, float]:
        """The next queue item and the seconds waited; raises :class:`RolloutWorkerError`."""
        t0 = time.perf_counter()
        while True:
            try:
                item = self.queue.get(timeout=min(1.0, self.timeout_s))
                break
            except queue_lib.Empty:
                pass
            waited = time.perf_counter() - t0
            if not self.proc.is_alive():
                try:  # its last words, if it raised
                    item = self.queue.get(timeout=1.0)
                    break
                except queue_lib.Empty:
                    raise self._died("died") from None
            if waited > self.timeout_s:
                raise self._died(f"sent no rollout batch for {waited:.0f} s (async_timeout_s={self.timeout_s:g})")
        if item[0] == "error":
            raise self._died("raised an exception:\n" + item[1].rstrip())
        return item, time.perf_counter() - t0

    # ------------------------------------------------------------------ the trainer's interface
    def rollouts_for(self, step: int) -> StepData:
        """The batch step ``step`` trains on (``rollout_version`` set, at most ``max_staleness`` old).

        Raises:
            RolloutWorkerError: the worker died, raised, or stalled past ``async_timeout_s``.
        """
        t0 = time.perf_counter()  # (the first step's wait includes the worker's start)
        if self.proc is None:
            self.start(step - 1)
        dropped = regenerated = 0
        waited = time.perf_counter() - t0
        while True:
            item, w = self._take()
            waited += w
            _, payload, draws_after, busy, worker_waited, worker_generated = item
            data = _decode(payload)
            self.prompts.draws = int(draws_after)  # the stream continues after the batches taken
            if int((step - 1) - int(data.rollout_version.min())) <= self.max_staleness:
                break
            if self.stale != "regenerate":
                dropped += 1
                if time.perf_counter() - t0 > self.timeout_s:  # never a loop that drops forever
                    raise self._died(f"sent only batches older than max_staleness={self.max_staleness} for "
                                     f"{time.perf_counter() - t0:.0f} s (async_timeout_s={self.timeout_s:g})")
                continue
            regenerated += 1
            data = self.regenerate()
            data.rollout_version = torch.full((len(data),), step - 1, dtype=torch.long)
            break
        total = max(time.perf_counter() - t0, 1e-9)
        self._step_info = {"async/queue_depth": float(_qsize(self.queue, unknown=-1)), "async/dropped": float(dropped),
                           "async/regenerated": float(regenerated), "async/worker_generated": float(worker_generated),
                           "_waited": waited,
                           "async/worker_wait_frac": worker_waited / max(worker_waited + busy, 1e-9)}
        self._t_take = total
        return data

    def after_step(self, step: int) -> None:
        """Publish the weights after step ``step`` (version ``step``) to the worker."""
        if self.proc is not None:
            self.publish(step)

    def step_metrics(self, step: int, data: StepData, step_seconds: float | None = None) -> dict[str, float]:
        """``staleness/min|mean|max|token_mean`` and :data:`ASYNC_METRICS` of step ``step``."""
        from echotrain.train.lag import staleness_summary

        out = staleness_summary(step, data)
        info = dict(self._step_info)
        waited = info.pop("_waited", 0.0)
        out.update(info)
        out["async/learner_wait_frac"] = waited / max(step_seconds or self._t_take, 1e-9)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint stores: the mode and ``max_staleness`` (the queue is not stored:
        ``--resume`` generates it again); the regeneration stream's position."""
        return {"mode": "async", "max_staleness": self.max_staleness,
                "regen_draws": int(self.regen_prompts.draws) if self.regen_prompts is not None else 0}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Accept a checkpoint of an async run (or of a synchronous one: the worker starts fresh)."""
        if state and state.get("mode") == "async" and self.regen_prompts is not None:
            self.regen_prompts.draws = int(state.get("regen_draws", 0))

    def close(self) -> None:
        """Stop the worker (drain the queue so its put returns, join 10 s, then terminate)."""
        if self.proc is None:
            return
        if self.proc.is_alive():  # (a killed worker may hold the event's lock: set() would wait forever)
            self.stop.set()
        deadline = time.time() + 10
        while self.proc.is_alive() and time.time() < deadline:
            try:
                self.queue.get(timeout=0.2)
            except queue_lib.Empty:
                pass
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.proc = None
