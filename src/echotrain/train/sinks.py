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
        def __init__(self, run_dir, config, project): ...
        def log(self, record, step): ...
        def close(self): ...
"""

from __future__ import annotations

import importlib.util
import abc
import os
from pathlib import Path
from typing import Any, Callable

from echotrain.registry import Registry

#: name -> sink class; fill it with :func:`register_sink`
SINKS: Registry[type["Sink"]] = Registry("tracker sink", "report_to")


class Sink(abc.ABC):
    """One tracker. Subclasses receive ``(run_dir, config, project)`` and implement :meth:`log`
    and :meth:`close`. ``extra``/``module`` (set by :func:`register_sink`): the pip extra to
    install and the module that must be importable."""

    name: str = ""
    extra: str = ""
    module: str = ""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        self.run_dir = Path(run_dir)

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
                project: str = "echotrain") -> list[Sink]:
    """Instantiate the sinks ``names`` (see :func:`parse_report_to`) for a run directory.

    Raises:
        ImportError: see :func:`check_available`.
    """
    check_available(names)
    return [SINKS[n](Path(run_dir), dict(config or {}), project) for n in names]


@register_sink("tensorboard", extra="tensorboard", module="tensorboard")
class TensorBoardSink(Sink):
    """Scalars to ``<run>/tensorboard`` with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        super().__init__(run_dir, config, project)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, record: dict[str, Any], step: int) -> None:
        for k, v in numeric(record).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register_sink("wandb", extra="wandb", module="wandb")
class WandbSink(Sink):
    """Weights & Biases run in ``<run>/wandb``; offline (no network, no login) unless the
    environment sets ``WANDB_MODE``; upload later with ``wandb sync``."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        super().__init__(run_dir, config, project)
        import wandb

        self.run = wandb.init(project=project, dir=str(self.run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(numeric(record), step=step)

    def close(self) -> None:
        self.run.finish()


@register_sink("trackio", extra="trackio", module="trackio")
class TrackioSink(Sink):
    """trackio (local-first, wandb-like API): a run in the local trackio database of project
    ``project``, named after the run directory."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        super().__init__(run_dir, config, project)
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=self.run_dir.name, config=config)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.trackio.log(numeric(record), step=step)

    def close(self) -> None:
        self.trackio.finish()
