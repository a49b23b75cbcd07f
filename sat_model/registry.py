"""``Registry``: the table behind each extension point (encoders, data sources, metrics).

An entry is added once, under its name, by the decorator its module exports
(``register_encoder``, ``register_source``, ``register_metric``); params validation, the CLI's
choices and the key lists read the table, so adding one is one entry in one file.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, in the order they were added."""

    def __init__(self, kind: str, unknown: type[Exception] = KeyError) -> None:
        self.kind = kind  # "encoder", "data source", "metric": what error messages call it
        self._unknown = unknown  # raised for a name nobody registered
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = entry

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise self._unknown(f"unknown {self.kind} {name!r}; known: {sorted(self._entries)}")
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def copy(self) -> Registry[T]:
        """A registry with the same entries, to add to without changing this one (tests)."""
        other: Registry[T] = Registry(self.kind, self._unknown)
        other._entries = dict(self._entries)
        return other
