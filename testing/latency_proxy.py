"""A TCP proxy that emulates a distant object store on loopback, and injects faults.

The kernel here has no ``sch_netem`` (docs/design.md, measured facts), so benchmarks and tests put
this proxy between an S3 client and a local S3 server (moto, rclone, RGW):

    client ──> LatencyProxy(127.0.0.1:port) ──(+latency)──> upstream S3 server
           <──────(bandwidth cap, shared by all connections)──

Latency. Every client->server chunk is stamped when it arrives and forwarded
``latency`` seconds later by a per-connection forwarder that sleeps until each
chunk's due time (a queue ordered by time, not one sleep per chunk in
sequence). A request therefore pays ``latency`` once, however many chunks its
body spans, and throughput is unchanged: +latency per request round trip.

Bandwidth. Server->client bytes pass a token bucket shared by all connections
(``bandwidth`` bytes/s, ``None`` = unlimited), so N parallel downloads share
the link the way they would share a NIC.

Request boundaries (a heuristic: we do not parse HTTP). A client->server chunk
starts a request when it begins with an HTTP method token (``GET ``, ``PUT ``,
...) and arrives at a request boundary: it is the first chunk of the
connection, or the first one since the server sent a final (non-1xx) response.
Bodies after ``100 Continue`` are therefore not mistaken for requests. It
assumes no HTTP pipelining (boto3/urllib3 never pipeline) and that a request
line is not split across the first two TCP reads (true on loopback in
practice). Request counters, faults and stragglers act on these boundaries.

Faults, settable from any thread while the proxy runs:
  ``fail_next(n, kind)``  the next n requests get a fault of one kind.
      Answered by the proxy, the request never reaches the server:
      "503" (``503 Slow Down`` with an S3 ``SlowDown`` XML error and
      ``Retry-After: 1``), "500" (an S3 ``InternalError``), "reset" (abortive
      close: RST via SO_LINGER 0), "hang" (the request is swallowed and never
      answered until the client closes: for timeout tests). HTTP error answers
      carry ``Connection: close``.
      Acting on the server's answer (the request is forwarded): "reset-body"
      (RST after the head and half the body), "stall-body" (head and half the
      body, then nothing until the client closes), "truncate" (head and half
      the body, then a clean close: fewer bytes than Content-Length),
      "slow-first-byte" (the answer is held ``slow_first_byte`` seconds, 2 by
      default, then sent whole) and "wrong-range" (a ``Content-Range`` header
      moved one byte up; the body is left alone). "Half the body" is cut from
      the Content-Length of the answer's head, which must arrive in the
      answer's first read (true on loopback); a bodiless answer is cut in
      its head.
  ``random_faults(rate, kinds)``  each request (after those queued by
      ``fail_next``) gets a fault with probability ``rate``, of a kind drawn
      uniformly from ``kinds`` (seeded RNG): a randomized fault schedule.
  ``restart(downtime)``   a server restart: refuse (dropping live connections)
      for ``downtime`` seconds, then serve again; returns at once.
  ``refuse(True)``        stop listening (new connections get ECONNREFUSED) and,
      by default, drop live connections; ``refuse(True, mode="close")``
      accepts and closes at once instead; ``refuse(False)`` restores service
      on the same port.
  ``stragglers(fraction, delay)``  that fraction of requests waits ``delay``
      extra seconds (seeded RNG, so runs repeat).
  ``stats()``             requests seen, faults injected by kind, connections.

CLI:
  python -m testing.latency_proxy --upstream 127.0.0.1:5000 \
      --listen 127.0.0.1:0 --latency-ms 10 [--bandwidth-mbps N | --splice]
prints ``port=<port>`` and ``endpoint_url=...`` and runs until SIGINT/SIGTERM.

Splice (``splice=True``, ``--splice``): answers move from the server's socket to the client's in
the kernel, never through Python, as a network costs the client's machine no CPU (the packed
benchmark's default). Requests pass the forwarder as above; answer faults and the bandwidth cap,
which need the answers parsed, are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import os
import random
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Self

CHUNK = 256 * 1024
REQUEST_FAULTS = ("503", "500", "reset", "hang")
ANSWER_FAULTS = ("reset-body", "stall-body", "truncate", "slow-first-byte", "wrong-range")
FAULT_KINDS = REQUEST_FAULTS + ANSWER_FAULTS
HTTP_METHODS = (b"GET ", b"PUT ", b"POST ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ")
_EOF = None  # queue sentinel: the client closed its sending side

_ERRORS = {
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": ("500 Internal Server Error", "InternalError",
            "We encountered an internal error. Please try again."),
}


def error_response(kind: str) -> bytes:
    """A complete S3-style HTTP error answer for fault ``kind`` ("503" or "500")."""
    status, code, message = _ERRORS[kind]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>latency-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "x-amz-request-id: latency-proxy\r\n"
        + ("Retry-After: 1\r\n" if kind == "503" else "")
        + "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def body_cut(chunk: bytes) -> int | None:
    """Where a mid-body fault cuts an answer whose head is in ``chunk``: after the head and half
    the Content-Length (in the head if there is no body); None if the head is not all there."""
    end = chunk.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = chunk[:end].decode("latin-1").lower()
    length = 0
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip() == "content-length" and value.strip().isdigit():
            length = int(value.strip())
    return end + 4 + length // 2 if length else max(1, end // 2)


def shift_content_range(chunk: bytes) -> bytes:
    """The answer with its ``Content-Range: bytes A-B/T`` moved to ``A+1-B+1/T`` (same length)."""
    end = chunk.find(b"\r\n\r\n")
    head, rest = (chunk[:end], chunk[end:]) if end >= 0 else (chunk, b"")
    lines = head.split(b"\r\n")
    for i, line in enumerate(lines):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-range" and b"-" in value:
            unit, _, spec = value.strip().partition(b" ")
            span, _, total = spec.partition(b"/")
            first, _, last = span.partition(b"-")
            if first.isdigit() and last.isdigit():
                lines[i] = b"Content-Range: %s %d-%d/%s" % (unit, int(first) + 1, int(last) + 1, total)
    return b"\r\n".join(lines) + rest


def is_request_start(chunk: bytes) -> bool:
    return chunk.startswith(HTTP_METHODS)


def is_final_response(chunk: bytes) -> bool:
    """False for interim ``HTTP/1.x 1xx`` answers such as ``100 Continue``."""
    return not (chunk.startswith(b"HTTP/1.") and chunk[9:10] == b"1")


class Bandwidth:
    """A token bucket shared by all connections; lives on the proxy's event loop."""

    def __init__(self, bytes_per_s: float | None):
        self.rate = bytes_per_s
        self._next_free = 0.0

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        start = max(now, self._next_free)
        self._next_free = start + n / self.rate
        await asyncio.sleep(self._next_free - now)


class FaultPlan:
    """Faults and counters shared between the caller's thread and the proxy's loop."""

    def __init__(self, seed: int = 0, answers: bool = True):
        self._kinds = FAULT_KINDS if answers else tuple(k for k in FAULT_KINDS if k not in ANSWER_FAULTS)
        self._lock = threading.Lock()
        self._queue: collections.deque[str] = collections.deque()
        self._straggle = (0.0, 0.0)
        self._random: tuple[float, tuple[str, ...]] = (0.0, ())
        self.slow_first_byte = 2.0
        self._rng = random.Random(seed)
        self.requests = 0
        self.faults = collections.Counter()
        self.stragglers = 0

    def fail_next(self, n: int, kind: str) -> None:
        if kind not in self._kinds:
            raise ValueError(f"fault kind must be one of {self._kinds}, not {kind!r}")
        with self._lock:
            self._queue.extend([kind] * n)

    def set_random(self, rate: float, kinds: tuple[str, ...]) -> None:
        for kind in kinds:
            if kind not in self._kinds:
                raise ValueError(f"fault kind must be one of {self._kinds}, not {kind!r}")
        with self._lock:
            self._random = (rate, tuple(kinds))

    def set_stragglers(self, fraction: float, delay: float) -> None:
        with self._lock:
            self._straggle = (fraction, delay)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._straggle = (0.0, 0.0)
            self._random = (0.0, ())

    def on_request(self) -> tuple[str | None, float]:
        """Count one request; return (fault kind or None, extra delay in seconds)."""
        with self._lock:
            self.requests += 1
            if self._queue:
                kind = self._queue.popleft()
                self.faults[kind] += 1
                return kind, 0.0
            rate, kinds = self._random
            if rate and kinds and self._rng.random() < rate:
                kind = self._rng.choice(kinds)
                self.faults[kind] += 1
                return kind, 0.0
            fraction, delay = self._straggle
            if fraction and self._rng.random() < fraction:
                self.stragglers += 1
                return None, delay
            return None, 0.0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests,
                "faults": dict(self.faults),
                "faults_total": sum(self.faults.values()),
                "stragglers": self.stragglers,
                "pending_faults": len(self._queue),
            }


def abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Connection:
    """One client connection and its upstream connection, in three tasks.

    ``_read_client`` stamps chunks into ``_queue``; ``_forward`` releases each at
    its due time (and injects faults at request starts); ``_pump_upstream``
    copies answers back under the shared bandwidth cap.
    """

    def __init__(self, proxy: _ProxyLoop, reader, writer):
        self.proxy = proxy
        self.c_reader, self.c_writer = reader, writer
        self.u_reader = self.u_writer = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._at_boundary = True
        self._mode = "forward"   # forward | hang | answered | reset
        self._answer_fault: str | None = None    # one of ANSWER_FAULTS, for the next answer
        self._cut: int | None = None             # bytes of the current answer left before its fault
        self._cut_kind = ""

    async def run(self) -> None:
        try:
            self.u_reader, self.u_writer = await asyncio.open_connection(*self.proxy.upstream)
        except OSError:
            abort_with_rst(self.c_writer)
            return
        pump = self._splice_upstream() if self.proxy.splice else self._pump_upstream()
        tasks = [asyncio.ensure_future(c) for c in (self._read_client(), self._forward(), pump)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def _wake_splice(self) -> None:
        """End the splice thread (if any) before the upstream transport goes: it reads a dup of
        the socket, which would keep the connection open; shut down, it sees the end at once."""
        if self.proxy.splice and self.u_writer is not None:
            with contextlib.suppress(OSError):
                self.u_writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._wake_splice()
        for writer in (self.u_writer, self.c_writer):
            if writer is not None and not writer.is_closing():
                writer.close()

    def drop(self) -> None:
        """Called by refuse(): end this connection abruptly."""
        self._mode = "reset"
        self._wake_splice()
        abort_with_rst(self.c_writer)
        if self.u_writer is not None:
            self.u_writer.transport.abort()

    async def _read_client(self) -> None:
        latency = self.proxy.latency
        try:
            while chunk := await self.c_reader.read(CHUNK):
                self._queue.put_nowait((time.monotonic() + latency, chunk))
        except OSError:
            pass
        self._queue.put_nowait((time.monotonic() + latency, _EOF))

    async def _forward(self) -> None:
        while True:
            due, chunk = await self._queue.get()
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if chunk is _EOF:
                return self._client_done()
            if self._mode != "forward":
                continue   # hung, answered or reset: swallow the rest
            if self._at_boundary and is_request_start(chunk):
                self._at_boundary = self.proxy.splice     # splice: answers are never seen (see there)
                if not await self._start_request():
                    continue
            await self._send_upstream(chunk)

    async def _start_request(self) -> bool:
        """Apply the fault plan to a new request; True if it should be forwarded."""
        kind, extra = self.proxy.faults.on_request()
        if extra:
            await asyncio.sleep(extra)
        if kind is None:
            return True
        if kind in ANSWER_FAULTS:
            self._answer_fault = kind
            return True
        self._wake_splice()
        self.u_writer.transport.abort()
        if kind == "reset":
            self._mode = "reset"
            abort_with_rst(self.c_writer)
        elif kind == "hang":
            self._mode = "hang"
        else:
            self._mode = "answered"
            self.c_writer.write(error_response(kind))
            with contextlib.suppress(OSError):
                await self.c_writer.drain()
            self.c_writer.transport.write_eof()
        return False

    async def _send_upstream(self, chunk: bytes) -> None:
        try:
            self.u_writer.write(chunk)
            await self.u_writer.drain()
        except OSError:
            abort_with_rst(self.c_writer)
            self._mode = "reset"

    def _client_done(self) -> None:
        if self._mode == "forward" and self.u_writer.can_write_eof():
            with contextlib.suppress(OSError):
                self.u_writer.write_eof()
        else:
            self.c_writer.close()

    async def _pump_upstream(self) -> None:
        try:
            while chunk := await self.u_reader.read(CHUNK):
                if self._mode != "forward":
                    break
                if is_final_response(chunk) and self._at_boundary is False:
                    self._at_boundary = True
                    chunk = await self._start_answer(chunk)
                await self.proxy.bandwidth.take(len(chunk))
                if self._cut is not None and len(chunk) >= self._cut:
                    self.c_writer.write(chunk[:self._cut])
                    await self._cut_answer()
                    break
                if self._cut is not None:
                    self._cut -= len(chunk)
                self.c_writer.write(chunk)
                await self.c_writer.drain()
        except OSError:
            pass
        if self._mode == "forward":
            self.c_writer.close()   # upstream finished: so do we

    async def _splice_upstream(self) -> None:
        """The answers, moved in the kernel (``splice``: upstream socket -> pipe -> client socket)
        by a thread of their own, never copied through Python: what a network costs the machine
        (nothing) rather than a copying proxy's ~0.9 ms of CPU per MiB (``--splice``). Answers
        are not parsed, so no answer faults and no bandwidth cap; request faults, latency and
        stragglers act as in the copying pump, and every chunk starting with a method is counted
        as a request."""
        self.u_writer.transport.pause_reading()     # the thread reads upstream from now on
        ufd = os.dup(self.u_writer.get_extra_info("socket").fileno())
        cfd = os.dup(self.c_writer.get_extra_info("socket").fileno())
        loop, done = asyncio.get_running_loop(), asyncio.Event()

        def run() -> None:          # a thread per connection (a pool would starve the ones past its size)
            try:
                splice_answers(ufd, cfd, self.proxy.stopping)
            finally:
                os.close(ufd)
                os.close(cfd)
                with contextlib.suppress(RuntimeError):         # the loop closed: shutting down
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=run, name="proxy-splice", daemon=True).start()
        await done.wait()
        if self._mode == "forward":
            self.c_writer.close()   # upstream finished: so do we

    async def _start_answer(self, chunk: bytes) -> bytes:
        """The first chunk of an answer: arm the answer fault the request drew, if any."""
        kind, self._answer_fault = self._answer_fault, None
        if kind == "slow-first-byte":
            await asyncio.sleep(self.proxy.faults.slow_first_byte)
        elif kind == "wrong-range":
            chunk = shift_content_range(chunk)
        elif kind is not None:
            self._cut = body_cut(chunk)
            self._cut_kind = kind
        return chunk

    async def _cut_answer(self) -> None:
        """Half the answer went out: reset, stall or close cleanly (truncate)."""
        kind, self._cut = self._cut_kind, None
        self.u_writer.transport.abort()
        with contextlib.suppress(OSError):
            await self.c_writer.drain()
        if kind == "reset-body":
            self._mode = "reset"
            abort_with_rst(self.c_writer)
        elif kind == "stall-body":
            self._mode = "hang"
        else:
            self._mode = "answered"
            self.c_writer.close()


SPLICE_PIPE = 1 << 20


def splice_answers(ufd: int, cfd: int, stopping: threading.Event) -> None:
    """Move bytes from socket ``ufd`` to socket ``cfd`` through a pipe until ``ufd`` ends, either
    fails, or ``stopping`` is set (polled every 0.2 s). Both sockets are non-blocking."""
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, SPLICE_PIPE)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    readable, writable = select.poll(), select.poll()
    readable.register(ufd, select.POLLIN | select.POLLRDHUP)
    writable.register(cfd, select.POLLOUT)
    try:
        while not stopping.is_set():
            try:
                held = os.splice(ufd, w, SPLICE_PIPE, flags=flags)
            except BlockingIOError:
                readable.poll(200)
                continue
            if held == 0:
                return                                  # the server closed
            while held and not stopping.is_set():
                try:
                    held -= os.splice(r, cfd, held, flags=flags)
                except BlockingIOError:
                    writable.poll(200)
    except OSError:
        return                                          # a reset on either side
    finally:
        os.close(r)
        os.close(w)


class _ProxyLoop:
    """Everything that lives on the proxy's own event loop."""

    def __init__(self, upstream, latency, bandwidth, faults, splice=False):
        self.upstream = upstream
        self.latency = latency
        self.bandwidth = Bandwidth(bandwidth)
        self.faults = faults
        self.splice = splice
        self.stopping = threading.Event()      # ends the splice threads
        self.connections: set[Connection] = set()
        self.refuse_mode: str | None = None   # None | "close" | "stop"
        self.accepted = 0
        self.server: asyncio.base_events.Server | None = None

    async def listen(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(
            self._accept, host, port, reuse_address=True, backlog=512)
        return self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader, writer) -> None:
        self.accepted += 1
        if self.refuse_mode is not None:
            abort_with_rst(writer)
            return
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(self, reader, writer)
        self.connections.add(conn)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass   # shutdown; asyncio's accept callback would log a cancelled task
        finally:
            self.connections.discard(conn)

    async def set_refuse(self, mode: str | None, host: str, port: int, drop: bool) -> None:
        self.refuse_mode = mode
        if mode is not None and drop:
            for conn in list(self.connections):
                conn.drop()
        if mode == "stop" and self.server is not None:
            self.server.close()
            self.server = None
        if mode is None and self.server is None:
            await self.listen(host, port)

    async def shutdown(self) -> None:
        self.stopping.set()
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.drop()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class LatencyProxy:
    """A latency/bandwidth/fault-injecting TCP proxy running in a background thread.

    >>> with LatencyProxy("127.0.0.1", 5000, latency=0.010) as proxy:
    ...     s3 = boto3.client("s3", endpoint_url=proxy.endpoint_url)
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, latency: float = 0.010,
                 bandwidth: float | None = None, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, seed: int = 0, splice: bool = False):
        if splice and bandwidth:
            raise ValueError("splice moves answers in the kernel: no bandwidth cap with it")
        self.listen_host = listen_host
        self.faults = FaultPlan(seed, answers=not splice)
        self.restarts = 0
        self._inner = _ProxyLoop((upstream_host, upstream_port), latency, bandwidth, self.faults, splice)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="latency-proxy", daemon=True)
        self._thread.start()
        self.port = self._call(self._inner.listen(listen_host, listen_port))

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def fail_next(self, n: int, kind: str) -> None:
        """Inject fault ``kind`` (one of FAULT_KINDS, see the module docstring) into the next n requests."""
        self.faults.fail_next(n, kind)

    def random_faults(self, rate: float, kinds: tuple[str, ...] = FAULT_KINDS) -> None:
        """Give each request a fault with probability ``rate``, of a kind drawn from ``kinds``."""
        self.faults.set_random(rate, kinds)

    def set_slow_first_byte(self, delay: float) -> None:
        """How long a "slow-first-byte" fault holds the answer (seconds)."""
        self.faults.slow_first_byte = delay

    def restart(self, downtime: float) -> None:
        """A server restart: refuse now (live connections dropped), serve again after ``downtime`` s."""
        self.refuse(True)
        self.restarts += 1

        def restore() -> None:
            asyncio.ensure_future(self._inner.set_refuse(None, self.listen_host, self.port, False))

        self._loop.call_soon_threadsafe(self._loop.call_later, downtime, restore)

    def stragglers(self, fraction: float, delay: float) -> None:
        """Delay that fraction of requests by ``delay`` extra seconds (0 turns it off)."""
        self.faults.set_stragglers(fraction, delay)

    def clear_faults(self) -> None:
        self.faults.clear()

    def refuse(self, on: bool = True, *, mode: str = "stop", drop_existing: bool = True) -> None:
        """Make the store unreachable: ``mode`` "stop" (ECONNREFUSED) or "close" (accept, RST)."""
        if mode not in ("stop", "close"):
            raise ValueError("mode must be 'stop' or 'close'")
        self._call(self._inner.set_refuse(mode if on else None, self.listen_host,
                                          self.port, drop_existing))

    def set_latency(self, latency: float) -> None:
        """Change the one-way delay for chunks that arrive from now on."""
        self._inner.latency = latency

    def stats(self) -> dict:
        stats = self.faults.snapshot()
        stats["connections_accepted"] = self._inner.accepted
        stats["connections_open"] = len(self._inner.connections)
        stats["restarts"] = self.restarts
        return stats

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self._call(self._inner.shutdown(), timeout=5.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 = any)")
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--bandwidth-mbps", type=float, default=None,
                        help="server->client cap in megabytes (10^6 B) per second")
    parser.add_argument("--splice", action="store_true",
                        help="move answers in the kernel (splice), not through Python: no bandwidth cap")
    args = parser.parse_args(argv)
    if args.splice and args.bandwidth_mbps:
        parser.error("--splice and --bandwidth-mbps exclude each other")
    up_host, up_port = parse_hostport(args.upstream)
    host, port = parse_hostport(args.listen)
    bandwidth = args.bandwidth_mbps * 1e6 if args.bandwidth_mbps else None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with LatencyProxy(up_host, up_port, latency=args.latency_ms / 1000, bandwidth=bandwidth,
                      listen_host=host, listen_port=port, splice=args.splice) as proxy:
        print(f"port={proxy.port}\nendpoint_url={proxy.endpoint_url}", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
