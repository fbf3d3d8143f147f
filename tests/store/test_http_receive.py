"""Large GET bodies are received in worker threads (``http._receive_blocking``), off the trio
thread that carries every FUSE request: the bytes, keep-alive, cancellation, timeouts and
early ends behave as the trio-side receive does. Real loopback sockets, a trio server."""

import functools
import os
import threading
import time

import pytest
import trio
from botocore.credentials import Credentials

from cachefs.store.s3 import http
from cachefs.store.s3.http import AsyncGetter

BODY = os.urandom(3 << 20)          # over http._THREAD_BODY_MIN: received in a thread


def recording(monkeypatch) -> dict:
    """Wrap the thread receive: which threads ran it, and how many are running now."""
    seen = {"threads": [], "running": 0, "ended": threading.Event()}
    real = http._receive_blocking

    def wrapped(*args):
        seen["threads"].append(threading.current_thread())
        seen["running"] += 1
        try:
            return real(*args)
        finally:
            seen["running"] -= 1
            seen["ended"].set()
    monkeypatch.setattr(http, "_receive_blocking", wrapped)
    return seen


def run_server(handler, client, read_timeout: float = 5.0):
    """Serve ``handler`` on loopback and run ``client(getter, state)`` against it."""
    state = {"connections": 0, "closed": trio.Event()}

    async def main():
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(handler, state), 0,
                                                              host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            getter = AsyncGetter(f"http://127.0.0.1:{port}", "us-east-1", Credentials("AK", "SK"),
                                 max_idle=4, connect_timeout=2, read_timeout=read_timeout)
            try:
                await client(getter, state)
            finally:
                getter.close()
                nursery.cancel_scope.cancel()

    trio.run(main)


async def read_request(stream) -> None:
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some(65536)


def head(length: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nETag: \"e\"\r\n\r\n".encode()


def test_a_large_body_arrives_intact_off_the_trio_thread_and_the_connection_is_reused(monkeypatch):
    seen = recording(monkeypatch)

    async def handler(state, stream):
        state["connections"] += 1
        while True:
            try:
                await read_request(stream)
            except trio.BrokenResourceError:
                return
            await stream.send_all(head(len(BODY)))
            for i in range(0, len(BODY), 200_000):          # in pieces, with pauses between some
                await stream.send_all(BODY[i:i + 200_000])
                if i % 1_000_000 == 0:
                    await trio.sleep(0.01)

    async def client(getter, state):
        with trio.fail_after(10):
            for _ in range(2):
                response, body = await getter.get("bucket", "key", {})
                assert body == BODY and response.status == 200
        assert state["connections"] == 1                     # kept alive, reused
    run_server(handler, client)
    assert len(seen["threads"]) == 2
    assert all(t is not threading.main_thread() for t in seen["threads"])


def test_a_cancelled_receive_stops_its_thread_before_the_connection_closes(monkeypatch):
    seen = recording(monkeypatch)

    async def handler(state, stream):
        await read_request(stream)
        await stream.send_all(head(len(BODY)) + BODY[:1 << 20])    # a third of the body, then nothing
        while await stream.receive_some(65536):
            pass
        state["closed"].set()

    async def client(getter, state):
        started = time.monotonic()
        with trio.move_on_after(0.3) as scope:
            await getter.get("bucket", "key", {})
        assert scope.cancelled_caught
        assert time.monotonic() - started < 1.5               # the thread saw the stop within its poll
        assert seen["running"] == 0 and seen["ended"].is_set()
        with trio.fail_after(5):
            await state["closed"].wait()                      # and then the connection was closed
        assert not getter._idle
    run_server(handler, client)


def test_a_body_that_stalls_times_out():
    async def handler(state, stream):
        await read_request(stream)
        await stream.send_all(head(len(BODY)) + BODY[:1 << 20])
        await trio.sleep(30)

    async def client(getter, state):
        with trio.fail_after(5), pytest.raises(TimeoutError, match="no data from .* for 0.3 s"):
            await getter.get("bucket", "key", {})
    run_server(handler, client, read_timeout=0.3)


def test_a_body_cut_short_by_the_server_is_an_error_not_short_bytes():
    async def handler(state, stream):
        await read_request(stream)
        await stream.send_all(head(len(BODY)) + BODY[:(1 << 20) + 12345])
        await stream.aclose()

    async def client(getter, state):
        with trio.fail_after(5), pytest.raises(ConnectionError, match="closed by the server"):
            await getter.get("bucket", "key", {})
    run_server(handler, client)
