"""Trio primitives that skip the scheduler pass when they need not wait.

Trio makes every blocking-capable call a checkpoint: ``async with limiter`` yields to the
scheduler even when a token is free, and the task resumes only on the next pass, after all the
other runnable work. On a daemon whose one thread carries FUSE requests, GETs and fills, a pass
lasts 0.2-1 ms under load, and a cold small file's path crossed seven of them (measured in
0.1-1 ms steps from the reader's ``open`` to its reply). These take the free token, or send the
bytes, at once, and wait (with trio's own calls) only when they must; ``in_thread`` hands a
block file's write or read to a worker thread with less work per call than ``trio.to_thread``.
"""

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class held:  # noqa: N801 (used as a context manager, like trio's own lower-case ones)
    """``async with held(limiter)``: ``async with limiter``, without a pass when a token is free
    (trio's ``acquire_nowait`` refuses while others wait for one, so the queue order holds)."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter

    async def __aenter__(self) -> None:
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            await self._limiter.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._limiter.release()


async def send_all(stream: trio.abc.Stream, data: bytes) -> None:
    """``stream.send_all(data)``; on a plain TCP stream whose send buffer takes all of ``data``
    (a request head: under a KiB), one ``write`` and no pass. The socket is non-blocking (trio's)."""
    if isinstance(stream, trio.SocketStream):
        try:
            sent = os.write(stream.socket.fileno(), data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        data = data[sent:]
    await stream.send_all(data)


async def in_thread(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter) -> T:
    """``trio.to_thread.run_sync(fn, *args, limiter=limiter)`` for the per-file leaf work (a
    block file's write or read), without what the hot path does not use: no scheduler pass when
    a token is free (``held``), and no naming of the worker thread for the job (trio names it
    after ``fn`` and back again, two ``pthread_setname_np`` calls through ctypes per call: 3% of
    the daemon's CPU in a cold small-file epoch by py-spy), no context copy, no ``from_thread``
    channel (``fn`` must not call back into trio). A no-op call costs ~60 us of CPU against
    ~90 us through ``to_thread`` (20,000 calls from 4 tasks). Like ``to_thread`` with its
    default, the caller cannot be cancelled while ``fn`` runs."""
    async with held(limiter):
        return await _in_worker(functools.partial(fn, *args), _no_abort)


def _no_abort(raise_cancel: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def _in_worker(call: Callable[[], T], abort: Callable[[object], trio.lowlevel.Abort]) -> T:
    """Run ``call`` in one of trio's cached threads and wait for it: its value, or its error.
    ``abort`` is trio's abort callback for a cancellation while it runs."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: Any) -> None:       # an outcome.Outcome of call
        with contextlib.suppress(trio.RunFinishedError):   # the run ended: nobody waits for it
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(call, deliver)
    return await trio.lowlevel.wait_task_rescheduled(abort)


async def in_thread_stoppable(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter) -> T:
    """``in_thread`` for a loop that polls a ``threading.Event``, passed to ``fn`` after ``args``:
    a cancellation of the caller sets it, the caller resumes once ``fn`` has returned (so nothing
    ``fn`` uses is released under it), and the cancellation is raised then."""
    stop = threading.Event()

    def abort(raise_cancel: object) -> trio.lowlevel.Abort:
        stop.set()                  # fn returns within its poll interval; its delivery wakes us
        return trio.lowlevel.Abort.FAILED

    async with held(limiter):
        value = await _in_worker(functools.partial(fn, *args, stop), abort)
    if stop.is_set():
        await trio.lowlevel.checkpoint()    # raises the cancellation that stopped fn
    return value
