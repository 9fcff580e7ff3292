"""The registries of the objective pieces (policy losses, aggregation modes, advantage and KL
estimators) use echotrain's one :class:`~echotrain.registry.Registry`; re-exported here."""

from echotrain.registry import Names, Registry

__all__ = ["Names", "Registry"]
