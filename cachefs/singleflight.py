"""Concurrent callers asking for the same key share one call (docs/design.md, invariant 6)."""

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio


class _Call:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class SingleFlight:
    def __init__(self, on_join: Callable[[], object] | None = None) -> None:
        self._calls: dict[Hashable, _Call] = {}
        self.joins = 0
        self._on_join = on_join

    def in_flight(self, key: Hashable) -> bool:
        return key in self._calls

    async def do(self, key: Hashable, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn`` once for all concurrent callers of ``key``; each gets its result or error.

        If the leader is cancelled, a waiting follower becomes the next leader
        instead of inheriting the cancellation.
        """
        while True:
            call = self._calls.get(key)
            if call is None:
                return await self._lead(key, fn)
            self.joins += 1
            if self._on_join is not None:
                self._on_join()
            await call.done.wait()
            if call.error is None:
                return call.value
            if isinstance(call.error, Exception):
                raise call.error

    def start_soon(self, nursery: trio.Nursery, key: Hashable, fn: Callable[[], Awaitable[Any]]) -> bool:
        """Start ``fn`` for ``key`` as a task of ``nursery``, unless a call for ``key`` is in flight
        (False). The call is in flight from this moment, before the task first runs: a ``do``
        for ``key`` made meanwhile joins it instead of starting a second call. Its error goes to
        those joiners only (``fn`` reports its own)."""
        if key in self._calls:
            return False
        call = self._calls[key] = _Call()
        nursery.start_soon(self._run, key, call, fn)
        return True

    async def _run(self, key: Hashable, call: _Call, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await self._settle(key, call, fn)
        except Exception:
            pass            # the joiners get it; ``fn`` reported it (a cancellation propagates)

    async def _lead(self, key: Hashable, fn: Callable[[], Awaitable[Any]]) -> Any:
        call = self._calls[key] = _Call()
        return await self._settle(key, call, fn)

    async def _settle(self, key: Hashable, call: _Call, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn`` as ``key``'s call: its value or error goes to the joiners, and the call ends."""
        try:
            call.value = await fn()
            return call.value
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            del self._calls[key]
            call.done.set()
