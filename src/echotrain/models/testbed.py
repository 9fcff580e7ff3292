"""The CPU testbed policies: small byte-level transformers warm-started on arithmetic, for
many-seed RL studies at about a second a step or less (docs/testbed.md).

Two named configs (:data:`TESTBED_CONFIGS`, the one list of testbed ``model=`` names):
``testbed`` (427k parameters, bare two-digit arithmetic at ~30% greedy accuracy, task ``testbed``)
and ``testbed-length`` (:data:`TESTBED_LENGTH_CONFIG`: the same network warm-started on sums of
2-8 terms worked step by step, with imperfect traces, task ``testbed-length``), and ``testbed-calc``
(:data:`TESTBED_CALC_CONFIG`: the testbed continued on four-digit sums, half of its targets worked
calls of the calculator tool, task ``testbed-calc``). Their weights
ship with the package (:mod:`echotrain.models.testbed_weights`, SHA-256 checked) and are loaded
in preference to a build, so every machine starts from the same policy; the build below makes
them again (``echotrain testbed --model NAME --force``) and any other config.

``model=testbed`` in ``echotrain train`` (through :func:`echotrain.models.load_policy`) loads it;
the matching task is ``task=testbed`` (:mod:`echotrain.tasks.testbed`, prompt ``"81-88="``,
answer ``"-7"`` then ``"\\n"`` = EOS). The first use builds it:

1. data: problems of the config's task's train split (never a held-out problem), as
   ``prompt + target + "\\n"`` bytes; the target is the gold answer, or the task's
   ``warmup_target`` (a worked trace for ``testbed-length``);
2. model: :class:`~echotrain.models.LoopedTransformer` as a plain GPT (``n_loops=1``,
   ``residual_scaling="none"``), byte vocabulary, d_model 128, 4 heads, 2 layers;
3. supervised next-token training on the target tokens only (AdamW, lr 2e-3, betas (0.9, 0.95),
   100 linear warm-up steps, gradient clip 1.0, batch 128; batches of similar length with
   ``bucket_by_length``), one thread, until the greedy accuracy on ``eval_problems`` held-out
   problems reaches ``target_accuracy`` (checked every ``eval_every`` steps), or ``max_steps``;
4. cache: ``$ECHOTRAIN_CACHE/testbed/<key>/`` (default ``~/.cache/echotrain/testbed/<key>``)
   holding ``model.pt`` (state dict) and ``testbed.json`` (config, warm-up report), written to a
   temporary folder and renamed into place (atomic), under a file lock so parallel jobs build it
   once. ``<key>`` hashes every :class:`TestbedConfig` field (fields added after the first
   format only when off their default, so older keys stay valid), the cache format and the
   torch and reasoning-gym versions, i.e. everything that changes the weights.

The warm-up is deterministic given the config (its own RNGs, one thread; the global RNG state is
restored). Measured facts behind the defaults: docs/testbed.md.

``echotrain testbed [--model testbed-length]`` shows the shipped policy (or builds a config
that is not shipped; ``python -m echotrain.models.testbed`` is the same command); ``--force``
rebuilds into the cache and prints the rebuilt weights' SHA-256 beside the shipped one;
``key=value`` overrides a config field, e.g. ``seed=1``; ``--export DIR`` writes the weights as
package data (``--export src/echotrain/models/weights`` made the shipped files).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from echotrain.atomic import replace_dir
from echotrain.models.byte_tokenizer import ByteTokenizer
from echotrain.models.looped import LoopedConfig, LoopedTransformer
from echotrain.optim.schedules import warmup_decay

__all__ = ["TESTBED_CONFIGS", "TESTBED_LENGTH_CONFIG", "TESTBED_MODEL", "TestbedConfig", "build_testbed", "load_testbed", "testbed_dir", "testbed_key"]

#: The model name that :func:`echotrain.models.load_policy` maps to the testbed.
TESTBED_MODEL = "testbed"
#: Bump when the build procedure changes in a way the config does not capture.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class TestbedConfig:
    """Everything that determines the testbed's weights (all of it enters the cache key).

    Raises ``ValueError`` (``__post_init__``) naming a field with an invalid value.
    """

    __test__ = False  # not a pytest class

    seed: int = 0
    """Seed of the initialisation and of the order of the training batches."""
    data_seed: int = 0
    """reasoning-gym generator seed of the training problems and of the held-out split."""
    train_examples: int = 200_000
    """Training problems generated (train split; repeats possible). The probe used 200k."""
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    lr: float = 2e-3
    """AdamW peak learning rate (after ``warmup_steps`` linear warm-up, constant)."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100
    max_grad_norm: float = 1.0
    batch_size: int = 128
    target_accuracy: float = 0.3
    """Stop once greedy accuracy on the held-out problems reaches this (20-50% leaves room for RL)."""
    eval_every: int = 100
    """Optimizer steps between greedy evaluations."""
    eval_problems: int = 256
    """Held-out problems of the stopping check (the first of the test split)."""
    max_steps: int = 6000
    """Hard cap on optimizer steps (the report says whether the target was reached)."""
    # Fields added after cache format 1 enter the cache key only when they differ from their
    # default (see ``testbed_key``), so the caches of earlier configs stay valid.
    task: str = "testbed"
    """Registered task of the warm-up data and of the stopping check (``"testbed"`` or
    ``"testbed-length"``, ``"testbed-calc"``); its ``warmup_target(example, rng)``, when present,
    gives the supervised target (else the gold answer): a string, or ``(text, trained)`` segments
    whose untrained bytes (an environment's reply) are inputs only."""
    task_options: tuple[tuple[str, Any], ...] = ()
    """Extra options of the task, as ``(name, value)`` pairs (hashable; e.g. ``(("max_terms", 8),)``)."""
    eval_max_new_tokens: int = 6
    """Token budget of the greedy stopping check (enough for the longest clean response)."""
    bucket_by_length: bool = False
    """Draw each batch from examples of similar length (shuffled pools of 16 batches sorted by
    length), so variable-length data wastes little compute on padding."""
    init_from: "TestbedConfig | None" = None
    """Continue from the warmed-up weights of this config (same network; loaded shipped / cached,
    built first if absent) with a fresh optimizer, instead of a random initialisation: a warm-up
    in stages, each stage a cacheable config."""

    def __post_init__(self) -> None:
        for name in ("train_examples", "d_model", "n_heads", "n_layers", "mlp_ratio", "batch_size", "eval_every",
                     "eval_problems", "max_steps", "eval_max_new_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("weight_decay and max_grad_norm must be >= 0")
        if self.task not in _TASKS:
            raise ValueError(f"task={self.task!r} is not a testbed task; valid: {list(_TASKS)}")
        if not isinstance(self.task_options, tuple) or not all(
                isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.task_options):
            raise ValueError(f"task_options must be a tuple of (name, value) pairs, got {self.task_options!r}")
        LoopedConfig(**self._looped_kwargs())  # checks d_model / n_heads
        if self.init_from is not None and (not isinstance(self.init_from, TestbedConfig)
                                           or self.init_from.looped_config() != self.looped_config()):
            raise ValueError("init_from must be a TestbedConfig of the same network (d_model, n_heads, n_layers, "
                             "mlp_ratio)")

    def _looped_kwargs(self) -> dict[str, Any]:
        tok = ByteTokenizer()
        return dict(vocab_size=ByteTokenizer.vocab_size, d_model=self.d_model, n_heads=self.n_heads,
                    n_layers=self.n_layers, n_loops=1, residual_scaling="none", mlp_ratio=self.mlp_ratio,
                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def looped_config(self) -> LoopedConfig:
        """The :class:`LoopedConfig` of the testbed model (a plain GPT: one loop, no residual scaling)."""
        return LoopedConfig(**self._looped_kwargs())


#: Config fields added after cache format 1: in the key only when not at their default.
_ADDED_FIELDS = ("task", "task_options", "eval_max_new_tokens", "bucket_by_length", "init_from")
#: The tasks a testbed can be warm-started on.
_TASKS = ("testbed", "testbed-length", "testbed-calc")


#: The length testbed (``model=testbed-length``): the testbed's byte GPT (d_model 128, 2 layers)
#: warm-started on worked sums of 2-8 terms with imperfect traces (:mod:`echotrain.tasks.testbed_length`).
#: Sized for a ~20-minute one-thread warm-up on a loaded 2-core machine and an RL step of about a
#: second (docs/testbed.md).
_LENGTH_STAGE_1 = TestbedConfig(
    task="testbed-length", train_examples=60_000, batch_size=32, target_accuracy=0.35, eval_every=250,
    eval_problems=128, max_steps=2500, eval_max_new_tokens=96, bucket_by_length=True)
TESTBED_LENGTH_CONFIG = dataclasses.replace(_LENGTH_STAGE_1, init_from=_LENGTH_STAGE_1, seed=1, max_steps=1500)
#: The calculator testbed (``model=testbed-calc``): the shipped testbed continued on four-digit
#: sums and differences (task ``testbed-calc``, train split), half of the targets worked tool uses of
#: the calculator environment (:func:`echotrain.tasks.testbed_calc.tool_trace`), half the bare answer;
#: no accuracy target (the single-turn check cannot score a tool call): ``max_steps`` steps.
TESTBED_CALC_CONFIG = TestbedConfig(
    task="testbed-calc", init_from=TestbedConfig(), train_examples=60_000,
    batch_size=32, target_accuracy=1.0, eval_every=500, eval_problems=128, max_steps=1500, eval_max_new_tokens=8)
#: ``model=`` name -> the config of that testbed: the one list of testbed policies.
TESTBED_CONFIGS: dict[str, TestbedConfig] = {TESTBED_MODEL: TestbedConfig(), "testbed-length": TESTBED_LENGTH_CONFIG,
                                             "testbed-calc": TESTBED_CALC_CONFIG}
#: ``model=`` name -> the generation settings its RL runs use (those of its ``configs/testbed*.yaml``, a test
#: checks that they agree): what ``echotrain eval --model NAME`` evaluates with when neither a flag nor a run
#: gives them. ``max_new_tokens``: the longest response the policy writes (testbed-length's chains reach 72
#: bytes, a tool call of testbed-calc 84); ``env`` / ``max_turns``: testbed-calc answers through the calculator.
TESTBED_EVAL_SETTINGS: dict[str, dict[str, Any]] = {
    TESTBED_MODEL: {"max_new_tokens": 8},
    "testbed-length": {"max_new_tokens": 72},
    "testbed-calc": {"max_new_tokens": 96, "env": "calculator", "max_turns": 2},
}


def _config_fields(config: TestbedConfig) -> dict[str, Any]:
    """The config as a JSON-ready dict, fields of ``_ADDED_FIELDS`` left out at their default."""
    default = TestbedConfig()
    out = dataclasses.asdict(config)
    for name in _ADDED_FIELDS:
        if getattr(config, name) == getattr(default, name):
            del out[name]
    return json.loads(json.dumps(out))  # tuples -> lists, as read back from JSON


def testbed_key(config: TestbedConfig) -> str:
    """16 hex digits hashing the config, the cache format and the torch / reasoning-gym versions."""
    from importlib.metadata import version

    blob = json.dumps({"format": CACHE_FORMAT, "config": _config_fields(config), "torch": torch.__version__,
                       "reasoning_gym": version("reasoning-gym")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def testbed_dir(config: TestbedConfig | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of ``config``: ``<cache_dir or $ECHOTRAIN_CACHE or ~/.cache/echotrain>/testbed/<key>``."""
    from echotrain.cache import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "testbed" / testbed_key(config or TestbedConfig())


# ------------------------------------------------------------------------------- data


def _encode_examples(examples: list[tuple[str, str | list[tuple[str, bool]]]],
                     tok: ByteTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` ids (N, T) and labels (N, T): the answer and EOS
    bytes at their own positions (the model shifts), -100 on prompt and padding. An answer may be
    ``(text, trained)`` segments (a worked tool use: the environment's reply is not trained):
    the bytes of untrained segments are inputs with label -100."""
    rows = []
    for p, a in examples:
        segments = [(a, True)] if isinstance(a, str) else list(a)
        ids_a, lab_a = [], []
        for text, trained in segments:
            enc = tok.encode(text)
            ids_a += enc
            lab_a += enc if trained else [-100] * len(enc)
        rows.append((tok.encode(p), ids_a + [tok.eos_token_id], lab_a + [tok.eos_token_id]))
    width = max(len(p) + len(a) for p, a, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a, lab) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p): len(p) + len(a)] = torch.tensor(lab)
    return ids, labels


@torch.no_grad()
def greedy_accuracy(model: LoopedTransformer, tok: ByteTokenizer, task: Any, examples: list[Any],
                    max_new_tokens: int = 6, batch_size: int = 256) -> float:
    """Share of ``examples`` whose greedy completion ``task.score``s 1 (left-padded batches, KV cache)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        enc = tok([e.messages for e in chunk])
        out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for e, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(row, skip_special_tokens=True)
            correct += int(task.score(text, e) >= 1.0)
    model.train(was_training)
    return correct / max(len(examples), 1)


def _length_buckets(lengths: torch.Tensor, batch_size: int, gen: torch.Generator,
                    pool_batches: int = 16) -> Iterator[torch.Tensor]:
    """Endless batches of example indices (``batch_size`` each) of similar length: each epoch is a
    random permutation cut into pools of ``pool_batches`` batches; a pool is sorted by ``lengths``
    (N,), cut into batches, and its batches come in random order (all draws from ``gen``)."""
    n = lengths.shape[0]
    pool = batch_size * pool_batches
    while True:
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, pool):
            chunk = perm[start: start + pool]
            chunk = chunk[torch.argsort(lengths[chunk], stable=True)]
            cuts = [chunk[i: i + batch_size] for i in range(0, chunk.shape[0] - batch_size + 1, batch_size)]
            for j in torch.randperm(len(cuts), generator=gen).tolist():
                yield cuts[j]


@contextlib.contextmanager
def _one_thread_and_own_rng(seed: int) -> Iterator[None]:
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def build_testbed(config: TestbedConfig | None = None, *, log: Any = None,
                  cache_dir: str | os.PathLike | None = None) -> tuple[LoopedTransformer, dict[str, Any]]:
    """Warm-start a testbed policy (no cache involved): the model and its warm-up report.

    Deterministic given ``config``: one thread, its own RNGs (the caller's RNG state and thread
    count are restored).

    Args:
        config: the :class:`TestbedConfig` (default: the documented testbed).
        log: ``log(str)`` called with progress lines (None: silent).
        cache_dir: cache root of ``config.init_from``'s weights (default ``$ECHOTRAIN_CACHE``).

    Returns:
        ``(model in eval mode, report)``; report keys: ``steps``, ``accuracy`` (held-out greedy,
        last check), ``reached_target``, ``history`` ([step, accuracy] pairs), ``seconds``,
        ``num_params``, ``config``.
    """
    from echotrain.tasks import get_task

    cfg = config or TestbedConfig()
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    options = dict(cfg.task_options)
    train = get_task(cfg.task, split="train", size=cfg.train_examples, seed=cfg.data_seed, **options)
    test = get_task(cfg.task, split="test", size=cfg.eval_problems, seed=cfg.data_seed, **options)
    heldout = list(test)
    target = getattr(train, "warmup_target", None)
    target_rng = random.Random(cfg.seed)
    ids, labels = _encode_examples([(e.messages, target(e, target_rng) if target else e.answer) for e in train], tok)
    lengths = (ids != tok.pad_token_id).sum(1)
    history: list[list[float]] = []
    with _one_thread_and_own_rng(cfg.seed):
        model = LoopedTransformer(cfg.looped_config())
        if cfg.init_from is not None:
            parent, _ = load_testbed(cfg.init_from, cache_dir=cache_dir, log=log)
            model.load_state_dict(parent.state_dict())
            torch.set_num_threads(1)  # a nested build restores the caller's count
        model.train()
        opt = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_decay(s, cfg.warmup_steps, cfg.max_steps, "constant"))
        gen = torch.Generator().manual_seed(cfg.seed)
        batches = _length_buckets(lengths, cfg.batch_size, gen) if cfg.bucket_by_length else None
        acc, step = 0.0, 0
        while step < cfg.max_steps:
            if batches is None:
                idx = torch.randint(0, ids.shape[0], (cfg.batch_size,), generator=gen)
            else:
                idx = next(batches)
            batch_ids, batch_labels = ids[idx], labels[idx]
            keep = int((batch_ids != tok.pad_token_id).sum(0).nonzero().max()) + 1  # trim all-pad columns
            loss = model(batch_ids[:, :keep], labels=batch_labels[:, :keep]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                acc = greedy_accuracy(model, tok, test, heldout, max_new_tokens=cfg.eval_max_new_tokens)
                history.append([step, acc])
                if log is not None:
                    log(f"testbed warm-up: step {step}, loss {loss.item():.3f}, held-out greedy accuracy {acc:.3f} "
                        f"({time.perf_counter() - t0:.0f} s)")
                if acc >= cfg.target_accuracy:
                    break
    model.eval()
    report = {"steps": step, "accuracy": acc, "reached_target": acc >= cfg.target_accuracy, "history": history,
              "seconds": round(time.perf_counter() - t0, 2), "num_params": model.num_params(),
              "config": dataclasses.asdict(cfg), "format": CACHE_FORMAT, "torch": torch.__version__}
    if cfg.init_from is not None:  # steps of all stages, first to last
        report["stage_steps"] = [*_stage_steps(cfg.init_from, cache_dir), step]
    return model, report


def _stage_steps(config: TestbedConfig, cache_dir: str | os.PathLike | None) -> list[int]:
    """Optimizer steps of each warm-up stage of ``config`` (from its shipped / cached report)."""
    report = load_testbed(config, cache_dir=cache_dir)[0].testbed_report
    return list(report.get("stage_steps", [report["steps"]]))


# ------------------------------------------------------------------------------- cache


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (fcntl; a no-op where fcntl is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_testbed(config: TestbedConfig | None = None, *, cache_dir: str | os.PathLike | None = None,
                   force: bool = False, log: Any = None) -> Path:
    """The cache folder of ``config``, building it first if absent (or ``force``).

    Atomic: the model is written to a temporary folder next to the final one and swapped into
    place (:func:`echotrain.atomic.replace_dir`: an old folder of ``force`` is exchanged, not
    deleted first, so a reader or a kill never finds no folder); a file lock makes concurrent callers wait for one build instead of repeating it.
    """
    cfg = config or TestbedConfig()
    final = testbed_dir(cfg, cache_dir)
    if (final / "testbed.json").is_file() and not force:
        return final
    with _file_lock(final.parent / f"{final.name}.lock"):
        if (final / "testbed.json").is_file() and not force:
            return final  # built by another process while we waited
        if log is not None:
            log(f"building the testbed policy into {final} (one thread; {cfg.max_steps} steps at most, "
                "3-25 minutes, docs/testbed.md)")
        model, report = build_testbed(cfg, log=log, cache_dir=cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like the models cache
        try:
            torch.save(model.state_dict(), tmp / "model.pt")
            report["key"] = final.name
            (tmp / "testbed.json").write_text(json.dumps(report, indent=1))
            replace_dir(tmp, final)  # an old folder is swapped out, never first deleted
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if log is not None:
            log(f"testbed ready: {report['steps']} steps, held-out greedy accuracy {report['accuracy']:.3f}, "
                f"{report['seconds']:.0f} s")
    return final


def load_testbed(config: TestbedConfig | None = None, *, cache_dir: str | os.PathLike | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 log: Any = None, prefer_shipped: bool = True) -> tuple[LoopedTransformer, ByteTokenizer]:
    """The testbed policy and its byte tokenizer: the shipped weights, else cached / built on first use.

    Args:
        config: :class:`TestbedConfig` (default: the documented testbed, ``model=testbed``).
        cache_dir: cache root (default ``$ECHOTRAIN_CACHE`` or ``~/.cache/echotrain``).
        device, dtype: where and in which dtype to put the model.
        log: progress callback for a build (default: print to stderr).
        prefer_shipped: load the weights shipped with the package when they were built with
            exactly ``config`` (:mod:`echotrain.models.testbed_weights`, SHA-256 checked), so every
            machine starts from the same policy; False: always the cache / a build on this machine.

    Returns:
        ``(model, tokenizer)``: the model in ``eval()`` mode with trainable parameters and a
        ``testbed_report`` attribute (the warm-up report, with ``source`` = ``"shipped"`` or
        ``"cache"``); the tokenizer pads on the left.

    Raises:
        echotrain.models.testbed_weights.WeightsError: shipped weights whose SHA-256 differs.
    """
    from echotrain.models import testbed_weights

    cfg = config or TestbedConfig()
    model = LoopedTransformer(cfg.looped_config())
    shipped = testbed_weights.shipped_entry(cfg) if prefer_shipped else None
    if shipped is not None:
        name, entry = shipped
        testbed_weights.load_into(model, testbed_weights.verify(name))
        model.testbed_report = {**entry["report"], "config": entry["config"], "source": "shipped", "name": name,
                                "sha256": entry["sha256"]}
    else:
        folder = ensure_testbed(cfg, cache_dir=cache_dir, log=log if log is not None else _stderr)
        model.load_state_dict(torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
        model.testbed_report = {**json.loads((folder / "testbed.json").read_text()), "source": "cache"}
    return model.to(device=device, dtype=dtype).eval(), ByteTokenizer()


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- command line


def _parse_overrides(tokens: list[str], base: TestbedConfig) -> TestbedConfig:
    fields = {f.name for f in dataclasses.fields(TestbedConfig)} - {"task_options"}
    values: dict[str, Any] = {}
    for tok in tokens:
        key, sep, value = tok.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"expected key=value with a key of {sorted(fields)}, got {tok!r}")
        default = getattr(base, key)
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                values[key] = value.lower() in ("true", "1")
            elif isinstance(default, tuple):
                values[key] = tuple(float(v) for v in value.split(","))
            else:
                values[key] = type(default)(value)
        except ValueError:
            raise SystemExit(f"{key}={value!r} is not a valid {type(default).__name__}") from None
    try:
        return dataclasses.replace(base, **values)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def register(parser: argparse.ArgumentParser) -> None:
    """``echotrain testbed``: show the shipped testbed policy, or build (or show) a cached one."""
    parser.add_argument("--model", default=TESTBED_MODEL, choices=sorted(TESTBED_CONFIGS),
                        help="which testbed (its config is the base of the overrides; default: testbed)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild into the cache even if cached or shipped (prints the rebuilt weights' SHA-256)")
    parser.add_argument("--cache-dir", default=None, help="cache root (default $ECHOTRAIN_CACHE or ~/.cache/echotrain)")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="also write the cached weights as DIR/<model>.safetensors and their DIR/manifest.json "
                             "entry (SHA-256); the shipped ones: --export src/echotrain/models/weights")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"TestbedConfig fields: {', '.join(f.name for f in dataclasses.fields(TestbedConfig))}")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from echotrain.models import testbed_weights

    cfg = _parse_overrides(args.overrides, TESTBED_CONFIGS[args.model])
    if args.export and cfg != TESTBED_CONFIGS[args.model]:
        raise SystemExit(f"--export writes the weights of model={args.model}: give no key=value overrides")
    shipped = testbed_weights.shipped_entry(cfg)
    keys = ("steps", "accuracy", "reached_target", "seconds", "num_params")
    if shipped is not None and not args.force and not args.export:
        name, entry = shipped
        path = testbed_weights.verify(name)
        print(json.dumps({"path": str(path), "source": "shipped", "sha256": entry["sha256"],
                          **{k: entry["report"][k] for k in keys}}, indent=1))
        return 0
    folder = ensure_testbed(cfg, cache_dir=args.cache_dir, force=args.force, log=_stderr)
    report = json.loads((folder / "testbed.json").read_text())
    out: dict[str, Any] = {"path": str(folder), "source": "cache", **{k: report[k] for k in keys}}
    if args.force or args.export:
        model, _ = load_testbed(cfg, cache_dir=args.cache_dir, prefer_shipped=False)
        out["sha256"] = testbed_weights.weights_sha256(model)
        if shipped is not None:
            out["shipped_sha256"] = shipped[1]["sha256"]
            out["matches_shipped"] = out["sha256"] == shipped[1]["sha256"]
        if args.export:
            entry = testbed_weights.export(args.model, model, cfg, report, args.export)
            out["exported"] = str(Path(args.export) / entry["file"])
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="python -m echotrain.models.testbed", description=__doc__.split("\n\n")[0])
    register(p)
    sys.exit(_main(p.parse_args()))
