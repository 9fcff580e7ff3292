"""Optimizers by name, as data, so the trainer and the CLI can say ``optimizer=adamw4bit``.

Each entry of :data:`OPTIMIZERS` is an :class:`OptimizerSpec`: the class (``"module:ClassName"``,
imported lazily so that optional dependencies are only needed when used), the keyword settings
it takes beyond ``lr`` and ``weight_decay``, and whether it wraps a base optimizer (SAM and
late-phase SAM apply another registered optimizer's update with their own gradient). Code that
builds optimizers from settings (the trainer) reads these fields and never tests names; a new
optimizer is one :func:`register_optimizer` call::

    register_optimizer("lion", "my_pkg.lion:Lion", takes=("betas",))

after which ``optimizer=lion`` (and ``sam_base=lion``) are valid trainer settings.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from echotrain.registry import Registry


@dataclass(frozen=True)
class OptimizerSpec:
    """One registered optimizer.

    Attributes:
        name: the registry name (``"adamw"``).
        target: ``"module:ClassName"`` of a ``torch.optim.Optimizer`` subclass.
        takes: keyword settings the class takes from a settings mapping besides ``lr`` and
            ``weight_decay`` (see :func:`build_from_settings`), e.g. ``("betas", "eps")``.
        wraps_base: the class takes ``base_optimizer=`` (the name of another registered optimizer
            that does not wrap one) and passes the base's own settings through to it.
    """

    name: str
    target: str
    takes: tuple[str, ...] = ()
    wraps_base: bool = False

    def load(self) -> type[torch.optim.Optimizer]:
        """Import and return the optimizer class."""
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


#: registry name -> :class:`OptimizerSpec`; fill it with :func:`register_optimizer`.
OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", "optimizer")


def register_optimizer(name: str, target: str, *, takes: Iterable[str] = (), wraps_base: bool = False) -> OptimizerSpec:
    """Register the optimizer class ``target`` (``"module:ClassName"``) under ``name``.

    Args:
        name: the registry name (``optimizer=name`` in the trainer config).
        target: where the class lives, imported on first use.
        takes: keyword settings the class takes besides ``lr`` and ``weight_decay``.
        wraps_base: whether it is built around a base optimizer (see :class:`OptimizerSpec`).

    Returns:
        the new :class:`OptimizerSpec`.

    Raises:
        ValueError: ``name`` is already registered, or ``target`` is not ``"module:ClassName"``.
    """
    if name in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is already registered ({OPTIMIZERS[name].target})")
    module, sep, cls = target.partition(":")
    if not (module and sep and cls):
        raise ValueError(f"target={target!r} must be 'module:ClassName'")
    return OPTIMIZERS.register(name)(OptimizerSpec(name, target, tuple(takes), wraps_base))


#: the settings of the Adam family and of SAM, for registrations
ADAM_SETTINGS = ("betas", "eps")
SAM_SETTINGS = ("rho", "model")
register_optimizer("adamw", "torch.optim:AdamW", takes=ADAM_SETTINGS + ("fused",))  # fused: the adam_fused setting
register_optimizer("sgd", "torch.optim:SGD")
# adamw4bit, sam and late_sam register in their own modules (imported by echotrain.optim)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The :class:`OptimizerSpec` registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names).
    """
    return OPTIMIZERS.lookup(name)


def base_optimizer_names() -> list[str]:
    """The registered names that can serve as ``base_optimizer`` of a wrapping optimizer (sorted)."""
    return sorted(name for name, spec in OPTIMIZERS.items() if not spec.wraps_base)


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """Return the optimizer class registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names).
    """
    return optimizer_spec(name).load()


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Instantiate the optimizer registered under ``name`` on ``params`` with ``kwargs``.

    Raises:
        ValueError: unknown ``name``.
    """
    return optimizer_class(name)(params, **kwargs)


def build_from_settings(name: str, params: Iterable[Any], settings: Mapping[str, Any], base: str | None = None) -> torch.optim.Optimizer:
    """Build optimizer ``name`` taking from ``settings`` only the keys its spec declares.

    ``lr`` and ``weight_decay`` always go to the optimizer that applies the update (the base when
    ``name`` wraps one), with the base's ``takes``; a wrapping optimizer also gets its own
    ``takes`` and ``base_optimizer=base``. Keys nobody takes are ignored, so one settings mapping
    (the trainer's) serves every optimizer. The keyword arguments go to the class named ``name``;
    a wrapping class passes on to the base those it does not take itself, so a key both take goes
    to the wrapper: ``eps`` sets SAM's own epsilon (the trainer's ``adam_eps``; the base AdamW
    keeps its default 1e-8), as the trainer has always done.

    Args:
        name: registered optimizer.
        params: parameters or param groups.
        settings: keyword values by setting name (``lr``, ``weight_decay``, ``betas``, ``rho`` ...).
        base: registered name of the base optimizer; used only when ``name`` wraps one.

    Raises:
        ValueError: unknown ``name`` or ``base``; ``name`` wraps a base optimizer and ``base`` is
            None or itself a wrapping optimizer; a key the spec takes is missing from ``settings``.
    """
    spec = optimizer_spec(name)
    inner = spec
    if spec.wraps_base:
        inner = optimizer_spec(base) if base is not None else None
        if inner is None or inner.wraps_base:
            raise ValueError(f"optimizer={name!r} needs a base optimizer from {base_optimizer_names()}, got {base!r}")
    keys = ("lr", "weight_decay") + inner.takes + (spec.takes if spec.wraps_base else ())
    missing = [k for k in keys if k not in settings]
    if missing:
        raise ValueError(f"settings lack {missing}, needed by optimizer={name!r}")
    kwargs = {k: settings[k] for k in keys}
    if spec.wraps_base:
        kwargs["base_optimizer"] = inner.name
    return spec.load()(params, **kwargs)


def set_adamw_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Make every ``torch.optim.AdamW`` in ``optimizer`` (itself, or the ``base_optimizer`` SAM
    wraps) fused or not, as the ``adam_fused`` setting says. Needed after ``load_state_dict``:
    torch takes each param group's ``fused`` flag from the checkpoint, so a run resumed from a
    checkpoint written with the other setting would silently keep the old one. A fused AdamW keeps
    ``step`` as a float32 tensor on the parameter's device (torch's layout for fused state); it is
    moved there when switching on.

    Args:
        optimizer: the trainer's optimizer.
        fused: the ``adam_fused`` setting.
    """
    for opt in (optimizer, getattr(optimizer, "base_optimizer", None)):
        if not isinstance(opt, torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            group["fused"] = True if fused else None
            if fused:
                group["foreach"] = None  # torch refuses fused together with foreach
                for p in group["params"]:
                    st = opt.state.get(p, {})
                    if "step" in st:
                        st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
