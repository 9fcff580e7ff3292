"""The one registry mechanism of echotrain: names -> pieces of one kind, with what each declared.

Every kind of pluggable piece is a :class:`Registry`: policy losses, aggregation modes,
advantage and KL estimators (:mod:`echotrain.rl`), tasks (:mod:`echotrain.tasks`), optimizers
(:mod:`echotrain.optim`), tracker sinks (:mod:`echotrain.train.sinks`), benchmark kinds and
suites (:mod:`echotrain.evalsuite`) and metric declarations (:mod:`echotrain.metrics`). Each has
a public ``register_*`` decorator or call; lookups go through :meth:`Registry.lookup` (a clear
error listing the valid names) or the read-only :class:`~typing.Mapping` interface, never a
private dict. User modules add pieces through :mod:`echotrain.plugins`. This module is
layer-neutral: it imports nothing from echotrain.

A :class:`Registry` maps names to objects in registration order and keeps, per name, what the
registration declared (e.g. a policy loss's step statistics). :meth:`Registry.names` is a *live*
read-only sequence of the names: a name registered later (a plugin, a test's toy loss) shows up
in every view made earlier, so checks written as ``value in AGG_MODES`` need no edit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar, overload

T = TypeVar("T")


class Names(Sequence[str]):
    """Live, read-only sequence of a :class:`Registry`'s names, in registration order.

    Behaves like the tuple it replaces (``in``, iteration, indexing, ``len``, ``==`` with a tuple
    or list, ``+``); ``where`` keeps only the names whose declared info satisfies it.
    """

    def __init__(self, registry: "Registry[Any]", where: Callable[[Mapping[str, Any]], bool] | None = None):
        self._registry = registry
        self._where = where

    def _names(self) -> tuple[str, ...]:
        reg = self._registry
        return tuple(n for n in reg if self._where is None or self._where(reg.info(n)))

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Names, tuple, list)):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable: its contents follow the registry

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return self._names() + tuple(other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return tuple(other) + self._names()

    def __repr__(self) -> str:
        return repr(self._names())


class Registry(Mapping[str, T], Generic[T]):
    """Names -> objects of one kind (``kind`` names it in error messages), in registration order.

    Args:
        kind: what is registered, e.g. ``"policy loss"``.
        argument: the argument whose values are these names, e.g. ``"loss_agg_mode"`` (named in
            :meth:`lookup`'s and :meth:`info`'s errors).
    """

    def __init__(self, kind: str, argument: str):
        self.kind = kind
        self.argument = argument
        self._items: dict[str, T] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **info: Any) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` with the declared ``info``.

        Raises:
            TypeError: ``name`` is not a non-empty str.
            ValueError: ``name`` is already registered.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} name must be a non-empty str, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            self._info[name] = dict(info)
            return obj

        return deco

    def unregister(self, name: str) -> T:
        """Remove ``name`` (for tests and plugins that register temporarily); returns its object.

        Raises:
            KeyError: ``name`` is not registered.
        """
        self._info.pop(name)
        return self._items.pop(name)

    def check(self, name: object) -> str:
        """Return ``name`` if it is registered.

        Raises:
            ValueError: ``"<argument>=<name> is unknown; valid: [...]"`` (sorted names).
        """
        if name not in self._items:
            raise ValueError(f"{self.argument}={name!r} is unknown; valid: {sorted(self._items)}")
        return name  # type: ignore[return-value]

    def lookup(self, name: str) -> T:
        """The object registered as ``name``.

        Raises:
            ValueError: unknown ``name`` (lists the valid ones; see :meth:`check`).
        """
        return self._items[self.check(name)]

    @contextlib.contextmanager
    def restoring(self) -> Iterator["Registry[T]"]:
        """Context manager: every registration made inside it is undone on exit (for tests)."""
        items, info = dict(self._items), dict(self._info)
        try:
            yield self
        finally:
            self._items.clear()
            self._items.update(items)
            self._info.clear()
            self._info.update(info)

    def info(self, name: str) -> dict[str, Any]:
        """What the registration of ``name`` declared (a copy; ``{}`` when nothing).

        Raises:
            ValueError: unknown ``name`` (lists the valid ones).
        """
        return dict(self._info[self.check(name)])

    def names(self, where: Callable[[Mapping[str, Any]], bool] | None = None) -> Names:
        """A live :class:`Names` view (optionally of the names whose info satisfies ``where``)."""
        return Names(self, where)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"
