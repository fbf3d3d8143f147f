"""Ports: the calls a lower room makes to the rooms above it, made visible in the wiring.

A block came from the store (a packed view checks its records), a file was read from its start (the
dataset watch warms the rest), a packed shard was entered (the shard warm), a staged file reached the
store (the namespace shows its new version), a journal record is about to go (the listing snapshot
makes its rows durable first). The room that makes such a call takes a ``Port`` in its constructor
and calls it; the rooms that answer take the same ``Port`` in theirs and connect to it; ``daemon.py``
creates every ``Port`` and hands it to both ends. So no room assigns another room's attributes, any
number of rooms may answer one call, and the trail of every call upward is in one place.
"""

from collections.abc import Callable
from typing import Any


class Port:
    __slots__ = ("name", "_listeners")

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: list[Callable[..., Any]] = []

    def connect(self, listener: Callable[..., Any]) -> None:
        self._listeners.append(listener)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def __call__(self, *args: Any) -> None:
        for listener in self._listeners:
            listener(*args)

    def __repr__(self) -> str:
        return f"Port({self.name!r}, {len(self._listeners)} listener(s))"
