"""Client CPU per GET on trio: our HTTP/1.1 framing (cachefs.store.s3.http) vs h11's.

    .venv/bin/python benchmarks/bench_http_client.py [--backend rclone] [--gets 4000] [--concurrency 32]

A local S3 server (default ``rclone serve s3``: fast, Go, its own process, so its CPU is not
counted) holds 64 objects of 110 KiB. Each round runs the same GETs, ``--concurrency`` trio
tasks on keep-alive connections, once per client, alternating clients between rounds; the figure
is this process's CPU time (user + system) per GET. Both clients sign with the same
``sigv4.Signer`` and share connections the same way: only the HTTP/1.1 framing differs.

``--framing-only`` needs no server: it replays one 110 KiB response (the head rclone sends)
from memory through both parsers and reports CPU per response (the lowest of the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import h11
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachefs.store.s3.http import AsyncGetter  # noqa: E402
from cachefs.store.s3.sigv4 import Signer, object_path  # noqa: E402
from testing.s3 import local_credentials_env, s3_client  # noqa: E402
from testing.s3_servers import start_server  # noqa: E402

BUCKET = "bench-http"
OBJECTS = 64


class H11Getter:
    """The same GET as AsyncGetter (signed, keep-alive pool), framed by h11."""

    def __init__(self, endpoint_url: str, credentials) -> None:
        parts = urlsplit(endpoint_url)
        self._hostname, self._port, self._host = parts.hostname, parts.port, parts.netloc
        self._signer = Signer(credentials, "us-east-1")
        self._idle: list[tuple[trio.SocketStream, h11.Connection]] = []

    async def get(self, bucket: str, key: str) -> bytes:
        target = object_path(bucket, key)
        headers = self._signer.headers("GET", self._host, target, {})
        if self._idle:
            stream, conn = self._idle.pop()
        else:
            stream, conn = await trio.open_tcp_stream(self._hostname, self._port), h11.Connection(h11.CLIENT)
        request = conn.send(h11.Request(method="GET", target=target, headers=list(headers.items())))
        await stream.send_all(request + conn.send(h11.EndOfMessage()))
        parts, status = [], 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(256 << 10))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise ConnectionError(f"unexpected {event!r}")
        if status != 200:
            raise ConnectionError(f"GET {target}: {status}")
        conn.start_next_cycle()
        self._idle.append((stream, conn))
        return b"".join(parts)

    def close(self) -> None:
        self._idle.clear()


class OursGetter:
    def __init__(self, endpoint_url: str, credentials) -> None:
        self._getter = AsyncGetter(endpoint_url, "us-east-1", credentials, max_idle=256, connect_timeout=5,
                                   read_timeout=30)

    async def get(self, bucket: str, key: str) -> bytes:
        return (await self._getter.get(bucket, key, {}))[1]

    def close(self) -> None:
        self._getter.close()


class _Replay:
    """A stream that hands out one recorded response in 64 KiB pieces."""

    def __init__(self, data: bytes) -> None:
        self._pieces = [data[i:i + (64 << 10)] for i in range(0, len(data), 64 << 10)]

    async def receive_some(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        return self._pieces.pop(0) if self._pieces else b""


def framing_only(size: int, count: int = 3000, rounds: int = 6) -> dict[str, float]:
    """Microseconds of CPU per response for each parser (the lowest over ``rounds``)."""
    from cachefs.store.s3.http import _Connection
    body = bytes(size)
    head = (f"HTTP/1.1 206 Partial Content\r\nAccept-Ranges: bytes\r\nContent-Length: {size}\r\n"
            f"Content-Range: bytes 0-{size - 1}/{size}\r\nContent-Type: application/octet-stream\r\n"
            'Etag: "c35cc7d8d91728a0cb052831bc4ef372"\r\nLast-Modified: Mon, 23 Nov 2026 09:00:00 GMT\r\n'
            "Server: rclone/v1.75.2\r\nX-Amz-Request-Id: 1879F9E5A8C1B2D3\r\n"
            "Date: Mon, 23 Nov 2026 09:00:00 GMT\r\n\r\n").encode()
    getter = AsyncGetter("http://127.0.0.1:9", "us-east-1", None, max_idle=1, connect_timeout=1, read_timeout=5)

    async def ours() -> None:
        for _ in range(count):
            await getter.read_response(_Connection(_Replay(head + body)))

    async def theirs() -> None:
        for _ in range(count):
            conn, stream, parts = h11.Connection(h11.CLIENT), _Replay(head + body), []
            conn.send(h11.Request(method="GET", target="/b/k", headers=[("Host", "h")]))
            conn.send(h11.EndOfMessage())
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(256 << 10))
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
            b"".join(parts)
    best = {"ours": float("inf"), "h11": float("inf")}
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("h11", theirs)):
            cpu = time.process_time()
            trio.run(fn)
            best[name] = min(best[name], (time.process_time() - cpu) / count * 1e6)
    return best


def run_round(getter, gets: int, concurrency: int, size: int) -> tuple[float, float]:
    """(client CPU ms per GET, GETs per second) of ``gets`` GETs."""
    async def main() -> None:
        send, receive = trio.open_memory_channel(gets)
        for i in range(gets):
            send.send_nowait(f"obj-{i % OBJECTS:03d}")
        send.close()

        async def worker() -> None:
            async for key in receive:
                if len(await getter.get(BUCKET, key)) != size:
                    raise RuntimeError("short body")
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    cpu, wall = time.process_time(), time.perf_counter()
    trio.run(main)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    getter.close()
    return cpu / gets * 1000, gets / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="rclone", choices=["rclone", "seaweedfs", "moto"])
    parser.add_argument("--gets", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--size", type=int, default=110 << 10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--framing-only", action="store_true", help="parsers only, from memory; no server")
    args = parser.parse_args()
    if args.framing_only:
        for name, micros in framing_only(args.size).items():
            print(f"{name:4s}: {micros:.0f} us CPU per {args.size}-byte response (framing only)")
        return
    import os

    import botocore.session
    for name, value in local_credentials_env().items():
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory() as workdir, start_server(args.backend, Path(workdir)) as server:
        client = s3_client(server.endpoint_url)
        client.create_bucket(Bucket=BUCKET)
        body = bytes(range(256)) * (args.size // 256) + b"x" * (args.size % 256)
        for i in range(OBJECTS):
            client.put_object(Bucket=BUCKET, Key=f"obj-{i:03d}", Body=body)
        credentials = botocore.session.get_session().get_credentials()
        results: dict[str, list[tuple[float, float]]] = {"ours": [], "h11": []}
        clients = {"ours": OursGetter, "h11": H11Getter}
        run_round(OursGetter(server.endpoint_url, credentials), 500, args.concurrency, args.size)   # warm-up
        for n in range(args.rounds):
            for name in (("ours", "h11") if n % 2 == 0 else ("h11", "ours")):
                cpu, rate = run_round(clients[name](server.endpoint_url, credentials), args.gets,
                                      args.concurrency, args.size)
                results[name].append((cpu, rate))
                print(f"round {n + 1} {name:4s}: {cpu:.3f} ms CPU per GET, {rate:,.0f} GETs/s", flush=True)
        for name, rows in results.items():
            cpus = [c for c, _ in rows]
            print(f"{name:4s}: median {statistics.median(cpus):.3f} ms CPU per GET "
                  f"(range {min(cpus):.3f}-{max(cpus):.3f}), {statistics.median(r for _, r in rows):,.0f} GETs/s")


if __name__ == "__main__":
    main()
