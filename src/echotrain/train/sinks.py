"""Experiment-tracker sinks for ``report_to=``: a registry, so a new backend is one class.

``metrics.jsonl`` is always written (:class:`echotrain.train.metrics.MetricsLogger`); each name in
``report_to`` (comma-separated) adds a sink that receives every step record::

    report_to=tensorboard            <run>/tensorboard/  (event files; tensorboard --logdir <run>)
    report_to=wandb                  <run>/wandb/        (offline unless WANDB_MODE says otherwise;
                                                          `wandb sync <run>/wandb/offline-run-*`)
    report_to=trackio                trackio's local database (project = wandb_project)
    report_to=tensorboard,wandb      both

A sink whose library is missing raises an ImportError naming the pip extra to install, when
the config is validated (before any model is loaded). To add a backend::

    @register_sink("mytracker", extra="mytracker", module="mytracker")
    class MyTrackerSink(Sink):
        def __init__(self, run_dir, config, project, *, start_step=0): ...
        def log(self, record, step): ...
        def close(self): ...

On ``--resume`` a sink is built with ``start_step`` = the checkpoint's step: the steps after it
are run (and logged) again, so a sink must drop what it holds past it or continue the same run:
TensorBoard purges events from step ``start_step + 1`` on (``SummaryWriter(purge_step=...)``);
W&B continues the same run id, kept in ``<run>/wandb/run_id`` (``wandb.init(id=...,
resume="allow")``; offline, each process writes its own ``offline-run-*`` folder under that id,
and ``wandb sync`` of them fills one run).
"""

from __future__ import annotations

import abc
import importlib.util
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from echotrain.registry import Registry

#: name -> sink class; fill it with :func:`register_sink`
SINKS: Registry[type["Sink"]] = Registry("tracker sink", "report_to")


class Sink(abc.ABC):
    """One tracker. Subclasses receive ``(run_dir, config, project, *, start_step)`` and implement
    :meth:`log` and :meth:`close`. ``start_step``: 0 for a new run, the checkpoint's step on
    ``--resume`` (steps after it are logged again). ``extra``/``module`` (set by
    :func:`register_sink`): the pip extra to install and the module that must be importable."""

    name: str = ""
    extra: str = ""
    module: str = ""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, *, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.start_step = int(start_step)

    @abc.abstractmethod
    def log(self, record: dict[str, Any], step: int) -> None:
        """Record the numeric entries of ``record`` (a metrics.jsonl line) at ``step``."""

    def close(self) -> None:
        """Flush and release the backend."""


def register_sink(name: str, *, extra: str, module: str) -> Callable[[type[Sink]], type[Sink]]:
    """Class decorator adding a :class:`Sink` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    register = SINKS.register(name, extra=extra, module=module)

    def deco(cls: type[Sink]) -> type[Sink]:
        cls.name, cls.extra, cls.module = name, extra, module
        return register(cls)

    return deco


def parse_report_to(value: str | None) -> list[str]:
    """``"tensorboard, wandb"`` -> ``["tensorboard", "wandb"]``; ``""``/``"none"`` -> ``[]``.

    Raises:
        ValueError: an unknown name (lists the valid ones).
    """
    if value is None:
        return []
    names = [v.strip().lower() for v in str(value).split(",") if v.strip()]
    names = [n for n in names if n != "none"]
    for n in names:
        if n not in SINKS:
            raise ValueError(f"report_to: unknown backend {n!r}; valid: {', '.join(SINKS)} (comma-separated) or none")
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> None:
    """Raise if the library of a sink in ``names`` is not installed.

    Raises:
        ImportError: naming the sink, the missing module and ``pip install 'echotrain[<extra>]'``.
    """
    for n in names:
        cls = SINKS[n]
        if importlib.util.find_spec(cls.module) is None:
            raise ImportError(f"report_to={n} needs the {cls.module} package: pip install 'echotrain[{cls.extra}]'")


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The finite-or-not numeric entries of a record except ``step`` (bools excluded)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def build_sinks(names: list[str], run_dir: str | os.PathLike, config: dict[str, Any] | None = None,
                project: str = "echotrain", start_step: int = 0) -> list[Sink]:
    """Instantiate the sinks ``names`` (see :func:`parse_report_to`) for a run directory;
    ``start_step``: the step a ``--resume`` continues from (0: a new run).

    Raises:
        ImportError: see :func:`check_available`.
    """
    check_available(names)
    return [SINKS[n](Path(run_dir), dict(config or {}), project, start_step=start_step) for n in names]


@register_sink("tensorboard", extra="tensorboard", module="tensorboard")
class TensorBoardSink(Sink):
    """Scalars to ``<run>/tensorboard`` with ``torch.utils.tensorboard.SummaryWriter``; on resume
    ``purge_step=start_step + 1``, so readers drop the old events of the steps logged again."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, *, start_step: int = 0):
        super().__init__(run_dir, config, project, start_step=start_step)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"),
                                    purge_step=self.start_step + 1 if self.start_step > 0 else None)

    def log(self, record: dict[str, Any], step: int) -> None:
        for k, v in numeric(record).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register_sink("wandb", extra="wandb", module="wandb")
class WandbSink(Sink):
    """Weights & Biases run in ``<run>/wandb``; offline (no network, no login) unless the
    environment sets ``WANDB_MODE``; upload later with ``wandb sync``. The run id is kept in
    ``<run>/wandb/run_id`` (:data:`RUN_ID_FILE`), so a ``--resume`` continues the same W&B run
    (``resume="allow"``) instead of opening a new one."""

    #: the file, relative to the run directory, that keeps the W&B run id
    RUN_ID_FILE = Path("wandb") / "run_id"

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, *, start_step: int = 0):
        super().__init__(run_dir, config, project, start_step=start_step)
        import wandb

        id_file = self.run_dir / self.RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # 8 lowercase hex characters, a valid W&B run id
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, dir=str(self.run_dir), config=config, id=run_id, resume="allow",
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(numeric(record), step=step)

    def close(self) -> None:
        self.run.finish()


@register_sink("trackio", extra="trackio", module="trackio")
class TrackioSink(Sink):
    """trackio (local-first, wandb-like API): a run in the local trackio database of project
    ``project``, named after the run directory."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, *, start_step: int = 0):
        super().__init__(run_dir, config, project, start_step=start_step)
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=self.run_dir.name, config=config)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.trackio.log(numeric(record), step=step)

    def close(self) -> None:
        self.trackio.finish()
