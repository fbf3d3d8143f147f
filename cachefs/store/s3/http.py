"""Object GETs on the trio thread: a small HTTP/1.1 keep-alive client, no worker threads.

Why not the thread path (``requests``): a GET in a worker thread costs the daemon ~0.9 ms of
CPU on a small node, most of it GIL hand-offs and futex wake-ups between the 32+ threads a
warmup keeps busy, not HTTP. The same GET as a trio task costs ~0.25 ms (measured side by side
with 32 concurrent GETs of 110 KiB objects through a 10 ms proxy: 0.80-0.97 vs 0.23-0.30 ms of
client CPU per GET, 1.7x the GETs per second). httpcore on trio was measured too: 2.3 ms per
GET. So this module speaks the small part of HTTP/1.1 a GET needs, and nothing else:

- one request, ``Content-Length``, chunked or close-delimited bodies, keep-alive reuse;
- the request is signed (``sigv4``, checked against botocore's signer) with the session's
  credentials object, refreshed as botocore refreshes it;
- a connection that was idle and fails before the first response byte is retried once on a
  new connection (the server closed it while idle); every other failure is the caller's to
  retry: ConnectionError and TimeoutError (transient), ``answer.S3Error`` for an error status,
  an ``answer.Reply`` otherwise, as ``requests`` answers, so the store's checks, retries and
  metrics apply as they are;
- a connection is reused only after its whole response was read; one interrupted in any way
  (error, timeout, cancellation) is closed; so is one whose body ``window`` cut short (a server
  that sends a whole big object for a range: see ``answer.window``).

Responses are read with h11's grammar (status line, field syntax, obsolete folding joined,
repeated or listed Content-Length only when equal, Transfer-Encoding only ``chunked``, chunk
headers and trailers, bare-LF line ends, no body on 204/304): ``tests/store/test_http_framing.py``
fuzzes both parsers with Hypothesis and requires the same status and body, or both refusing.

Why not h11 itself: ``benchmarks/bench_http_client.py`` (110 KiB objects from ``rclone serve s3``
on loopback, 32 concurrent trio tasks, same signer and pool) measured h11 at 0.54-0.68 ms of client
CPU per GET against 0.38-0.52 ms for this module on a loaded 2-CPU box; the framing alone, replayed
from memory: h11 308-328 us, this module 180 us (153 us before the checks h11 makes were added).
h11 costs ~0.15 ms more per GET, over our ~0.1 ms budget, so this module stays and
h11 is the reference in the tests.

Connections belong to one trio run; a getter used from another run starts a new pool.
"""

import os
import re
import select
import ssl
import threading
import time
from typing import NamedTuple
from urllib.parse import urlsplit

import trio

from cachefs.sched import in_thread_stoppable, send_all
from cachefs.store.s3 import fresh
from cachefs.store.s3.answer import Reply, Window, error_of
from cachefs.store.s3.sigv4 import Signer, object_path

# The response grammar, as h11 0.16 reads it (tests/store/test_http_framing.py checks that we agree).
_BLANK_LINE = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/(1\.[01]) ([0-9]{3})")      # then nothing, or " " and a reason
# A field line is token ":" OWS value OWS, the value any bytes but NUL and whitespace other than
# space and tab; so a header section may hold no NUL, VT, FF, nor CR other than before LF.
_TOKENS = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]*")
_FOLD = re.compile(rb"[ \t]+")
_CHUNK_HEADER = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_DIGITS = re.compile(r"[0-9]{1,20}")
_MAX_HEAD = 64 << 10         # status line and headers
_RECV = 256 << 10            # largest single receive
_RECV_BODY = 1 << 20         # largest single receive into a body's own buffer
_BODY_MIN = 16 << 10         # a longer body is received straight into its own buffer
_THREAD_BODY_MIN = 1 << 20   # a longer one in a worker thread, off the trio thread (_receive_blocking)
_RECEIVE_THREADS = 16        # bodies received in worker threads at once (more wait for a thread)
_POLL_S = 0.05               # how soon a receiving thread sees its caller cancelled
_DEFAULT_PORT = {"http": 80, "https": 443}
# A connection idle longer is closed, not reused. Load balancers drop idle connections without
# a word (AWS ALB after 60 s); a GET sent on one would wait out the whole read timeout.
_IDLE_MAX_S = 20.0


def _parse_head(section: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, lower-cased header fields and keep-alive of a response head (its lines, each with
    its line end); ValueError if malformed."""
    if not section:
        raise ValueError("no response line received")
    first = section.find(b"\n")
    line = section[:first - 1] if section[first - 1:first] == b"\r" else section[:first]
    match = _STATUS_LINE.match(line)
    if match is None or b"\r" in line or not (len(line) == 12 or line[12:13] == b" "
                                              and not _has_control(line + b"\n")):
        raise ValueError(f"not an HTTP/1.x response: {line[:80]!r}")
    status = int(match[2])
    if status < 100:
        raise ValueError(f"bad status {status}")
    fields = _parse_fields(section[first + 1:])
    connection = fields.get("connection", "").lower()
    keep_alive = "close" not in connection and (match[1] == b"1.1" or "keep-alive" in connection)
    return status, fields, keep_alive


def _parse_fields(section: bytes) -> dict[str, str]:
    """Header (or trailer) lines as {lower-cased name: value}: folded lines joined, repeated fields
    joined with ", "; one Content-Length value and Transfer-Encoding only "chunked", as h11 demands.
    String methods, not a regex per line: h11's field regex costs ~4x this on a typical S3 answer."""
    if _has_control(section):
        raise ValueError(f"control character in the header: {section[:200]!r}")
    if section[:1] in (b" ", b"\t") or b"\n " in section or b"\n\t" in section:
        section = _unfolded(section)
    fields: dict[str, str] = {}
    names = []
    for line in section.decode("latin-1").replace("\r\n", "\n").split("\n")[:-1]:
        name, colon, value = line.partition(":")
        if not colon or not name:
            raise ValueError(f"bad header line {line[:80]!r}")
        names.append(name)
        name, value = name.lower(), value.strip(" \t")
        if name == "content-length":
            value = _one_length(value, fields.get(name))
        elif name == "transfer-encoding":
            if name in fields or value.lower() != "chunked":
                raise ValueError(f"unsupported Transfer-Encoding {value[:40]!r}")
        elif name in fields:
            value = f"{fields[name]}, {value}"
        fields[name] = value
    if not _TOKENS.fullmatch("".join(names)):      # one regex for every name: each must be a token
        raise ValueError(f"bad header name among {names!r:.200}")
    return fields


def _has_control(text: bytes) -> bool:
    """Whether ``text`` holds NUL, VT, FF or a CR not before LF (memchr scans, not a regex: 20x faster)."""
    return b"\x00" in text or b"\x0b" in text or b"\x0c" in text or text.count(b"\r") != text.count(b"\r\n")


def _unfolded(section: bytes) -> bytes:
    """Obsolete line folding undone (a line starting with blanks continues the one before)."""
    out: list[bytes] = []
    for line in section.split(b"\n")[:-1]:
        line = line[:-1] if line.endswith(b"\r") else line
        fold = _FOLD.match(line)
        if fold is None:
            out.append(line)
        elif not out:
            raise ValueError("continuation line at the start of the header")
        else:
            out[-1] += b" " + line[fold.end():]
    return b"".join(line + b"\n" for line in out)


def _one_length(value: str, seen: str | None) -> str:
    if _DIGITS.fullmatch(value):
        length = value
    else:
        values = {part.strip(" \t\x0b\x0c\r\n") for part in value.split(",")}
        if len(values) != 1 or not _DIGITS.fullmatch(next(iter(values))):
            raise ValueError(f"bad Content-Length {value[:40]!r}")
        length = values.pop()
    if seen is not None and seen != length:
        raise ValueError("conflicting Content-Length headers")
    return length


def _length(fields: dict[str, str]) -> int | None:
    length = fields.get("content-length")
    return None if length is None or "transfer-encoding" in fields else int(length)


class _Connection:
    """One keep-alive stream and the bytes received past the last response."""

    __slots__ = ("buffer", "idle_since", "received", "stream", "used")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.used = False          # has answered a request before: may have gone stale while idle
        self.received = 0          # bytes received for the current request
        self.idle_since = 0.0      # time.monotonic() when it went back to the pool

    def close(self) -> None:
        """Close at once (safe under cancellation: no await)."""
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            stream.socket.close()


class _Early(NamedTuple):
    """A GET sent by ``send_early``: its connection, and when it was sent."""

    conn: _Connection
    sent: float


def _early_name(target: str, headers: dict[str, str]) -> tuple:
    """What an early GET is found by: its target and headers (an If-Match or Range differs)."""
    return (target, *headers.items())


class _Stale(Exception):
    """A reused connection ended before the first response byte."""


class AsyncGetter:
    """Path-style signed GETs on one endpoint, as trio tasks sharing keep-alive connections."""

    def __init__(self, endpoint_url: str, region: str, credentials, *, max_idle: int, connect_timeout: float,
                 read_timeout: float) -> None:
        parts = urlsplit(endpoint_url.rstrip("/"))
        if parts.scheme not in _DEFAULT_PORT or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint_url!r}")
        self._https = parts.scheme == "https"
        self._hostname = parts.hostname
        self._port = parts.port or _DEFAULT_PORT[parts.scheme]
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self._host = host if parts.port in (None, _DEFAULT_PORT[parts.scheme]) else f"{host}:{parts.port}"
        self._base = f"{parts.scheme}://{self._host}"
        self._root = parts.path
        self._signer = Signer(credentials, region)
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._receivers = trio.CapacityLimiter(_RECEIVE_THREADS)
        self._ssl = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE")) if self._https else None
        self._idle: list[_Connection] = []
        self._early: dict[tuple, _Early] = {}   # GETs sent early (send_early), by target and headers, oldest first
        self._run: object | None = None       # the trio run the idle connections belong to

    def target(self, bucket: str, key: str) -> str:
        return self._root + object_path(bucket, key)

    async def get(self, bucket: str, key: str, headers: dict[str, str],
                  window: Window | None = None) -> tuple[Reply, bytes]:
        """(reply, body) of one GET; S3Error for an HTTP error status. ``window``
        (see ``answer.window``) may ask to read only part of a 2xx body: the connection is then closed."""
        target = self.target(bucket, key)
        self._this_run()
        early = self._early.pop(_early_name(target, headers), None) if self._early else None
        if early is not None:
            try:
                return await self._exchange(early.conn, None, target, window)
            except _Stale:
                pass
        request = self._signed(target, headers)
        conn = self._take()
        if conn is not None:
            try:
                return await self._exchange(conn, request, target, window)
            except _Stale:
                pass
        conn = await self._connect(target)
        try:
            return await self._exchange(conn, request, target, window)
        except _Stale:
            raise ConnectionError(f"GET {self._base}{target}: connection closed before a response") from None

    def send_early(self, bucket: str, key: str, headers: dict[str, str]) -> bool:
        """Send this GET now, with no await, on an idle keep-alive connection; the ``get`` with
        the same arguments that follows (from any task) reads its answer instead of sending it.

        For a GET whose task has been started but runs only on a later scheduler pass: a small
        cold file's readahead at lookup (``Tiers.readahead_file``) waited 0.6 ms (mean, 8
        readers) between its lookup and its request leaving, out of a file's 16 ms. False, and
        nothing sent, when no idle connection is at hand, over TLS (an ``SSLStream`` sends only
        with awaits), or when the socket does not take the whole request at once. A sent GET
        nobody asks for is dropped with its connection: when the same GET is sent early again,
        past ``max_idle`` of them waiting, and at ``close``."""
        if self._https:
            return False
        self._this_run()
        conn = self._take()           # a plain SocketStream (no TLS)
        if conn is None:
            return False
        target = self.target(bucket, key)
        request = self._signed(target, headers)
        try:
            sent = os.write(conn.stream.socket.fileno(), request)
        except OSError:
            sent = 0
        if sent != len(request):
            conn.close()
            return False
        conn.received = 0
        name = _early_name(target, headers)
        old = self._early.pop(name, None)
        if old is not None:
            old.conn.close()
        self._early[name] = _Early(conn, time.monotonic())
        while len(self._early) > self._max_idle:
            self._early.pop(next(iter(self._early))).conn.close()
        return True

    def sent_at(self, bucket: str, key: str, headers: dict[str, str]) -> float | None:
        """``time.monotonic()`` when this GET was sent early and not yet answered, else None."""
        early = self._early.get(_early_name(self.target(bucket, key), headers)) if self._early else None
        return early.sent if early is not None else None

    def close(self) -> None:
        """Drop the idle connections and unasked early GETs (callable outside trio: their sockets
        close as they are freed)."""
        self._idle.clear()
        self._early.clear()

    # --- requests ---

    def _signed(self, target: str, headers: dict[str, str]) -> bytes:
        signed = self._signer.headers("GET", self._host, target, headers)
        lines = [f"GET {target} HTTP/1.1", *(f"{name}: {value}" for name, value in signed.items()), "", ""]
        return "\r\n".join(lines).encode("latin-1")

    async def _exchange(self, conn: _Connection, request: bytes | None, target: str,
                        window: Window | None) -> tuple[Reply, bytes]:
        """Send ``request`` on ``conn`` and read the answer; the connection is pooled again only
        after a complete response that allows keep-alive, and closed otherwise."""
        conn.received = 0
        reusable = False
        try:
            if request is not None:         # None: sent already (send_early)
                await send_all(conn.stream, request)
            status, fields, body, reusable, cut = await self.read_response(conn, window)
        except TimeoutError:
            raise
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if conn.used and conn.received == 0:
                raise _Stale() from None
            raise ConnectionError(f"GET {self._base}{target}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise ConnectionError(f"GET {self._base}{target}: {exc}") from None
        finally:
            if reusable:
                self._give_back(conn)
            else:
                conn.close()
        if status >= 300:
            raise error_of("GetObject", status, body, fields)
        return Reply(status, fields.get("etag"), fields.get("content-range"), _length(fields), cut=cut), body

    async def read_response(self, conn: _Connection, window: Window | None = None
                            ) -> tuple[int, dict[str, str], bytes, bool, bool]:
        """(status, fields, body, connection reusable, body cut by ``window``) of the next final
        response on ``conn``; ValueError for a malformed one, ConnectionError for an early end."""
        while True:
            status, fields, keep_alive = _parse_head(await self._read_section(conn))
            if status >= 200:
                break
        if status in (204, 304):
            return status, fields, b"", keep_alive, False
        if "transfer-encoding" in fields:
            return status, fields, await self._read_chunked(conn), keep_alive, False
        length = _length(fields)
        if length is None:
            while await self._receive(conn, _RECV, eof_ok=True):     # delimited by the connection's end
                pass
            body = bytes(conn.buffer)
            conn.buffer.clear()
            return status, fields, body, False, False
        cut = window(status, length) if window is not None and status < 300 else None
        if cut is not None:
            await self._skip(conn, cut[0])
            return status, fields, await self._read_exact(conn, cut[1]), False, True
        return status, fields, await self._read_exact(conn, length), keep_alive, False

    async def _read_section(self, conn: _Connection) -> bytes:
        """The lines up to the next blank line, each with its line end (CRLF or bare LF, as h11
        reads them); b"" when the section is empty."""
        while True:
            if conn.buffer[:1] == b"\n" or conn.buffer[:2] == b"\r\n":
                del conn.buffer[:1 if conn.buffer[:1] == b"\n" else 2]
                return b""
            end = _BLANK_LINE.search(conn.buffer)
            if end is not None:
                break
            if len(conn.buffer) > _MAX_HEAD:
                raise ValueError(f"response header over {_MAX_HEAD} bytes")
            await self._receive(conn, _RECV, eof_ok=False)
        section = bytes(conn.buffer[:end.start() + 1])
        del conn.buffer[:end.end()]
        return section

    async def _read_exact(self, conn: _Connection, length: int) -> bytes:
        if length - len(conn.buffer) > _BODY_MIN:
            return await self._read_body(conn, length)
        while len(conn.buffer) < length:
            await self._receive(conn, min(_RECV, length - len(conn.buffer)), eof_ok=False)
        if len(conn.buffer) == length:
            body = bytes(conn.buffer)
            conn.buffer.clear()
            return body
        body = bytes(conn.buffer[:length])
        del conn.buffer[:length]
        return body

    async def _read_body(self, conn: _Connection, length: int) -> bytes:
        """``length`` bytes (more than what is buffered) received straight into the bytes object
        returned (``fresh``: each byte written once, by the kernel): no buffer that grows and is
        copied as it grows (measured: most of the trio thread's time in a cold epoch of 4 MiB
        blocks went there), one cancel scope whose deadline moves on with each receive, and
        ``recv_into`` on a plain socket. Over 1 MiB left on a plain socket, a worker thread
        receives it (``_receive_blocking``; a cancellation stops it within 50 ms and waits for
        it): the trio thread, which serves every FUSE request, no longer spends a packed cold
        epoch's ~1 GB of shard blocks in receives. Alternating in one run (10,000 x 110 KiB,
        8 readers, SeaweedFS behind the 10 ms splice proxy, 4 rounds each): 2,787-2,940 files/s
        against 2,730-2,778, 1.62-1.68 CPUs busy against 1.55-1.59."""
        body, view = fresh.new(length)
        have = len(conn.buffer)
        view[:have] = conn.buffer
        conn.buffer.clear()
        sock = conn.stream.socket if isinstance(conn.stream, trio.SocketStream) else None
        if sock is not None and length - have >= _THREAD_BODY_MIN:
            got, timed_out = await in_thread_stoppable(_receive_blocking, sock.fileno(), view, have, length,
                                                       self._read_timeout, limiter=self._receivers)
            conn.received += got - have
            view.release()
            if timed_out:
                raise self._stalled()
            if got < length:
                raise _closed()
            return fresh.finish(body)
        with trio.CancelScope() as scope:
            while have < length:
                scope.deadline = trio.current_time() + self._read_timeout
                if sock is not None:
                    got = await sock.recv_into(view[have:], min(_RECV_BODY, length - have))
                else:
                    data = await conn.stream.receive_some(min(_RECV_BODY, length - have))
                    got = len(data)
                    view[have:have + got] = data
                if not got:
                    raise _closed()
                have += got
                conn.received += got
        if scope.cancelled_caught:
            raise self._stalled()
        view.release()
        return fresh.finish(body)

    async def _skip(self, conn: _Connection, count: int) -> None:
        """Read and drop ``count`` body bytes, holding at most one receive in memory."""
        while count > len(conn.buffer):
            count -= len(conn.buffer)
            conn.buffer.clear()
            await self._receive(conn, min(_RECV, count), eof_ok=False)
        del conn.buffer[:count]

    async def _read_chunked(self, conn: _Connection) -> bytes:
        parts = []
        while True:
            line = await self._read_line(conn)
            match = _CHUNK_HEADER.fullmatch(line)
            if match is None:
                raise ValueError(f"bad chunk header {line[:40]!r}")
            size = int(match[1], 16)
            if size == 0:
                _parse_fields(await self._read_section(conn))     # trailers: checked, not used
                return b"".join(parts)
            parts.append(await self._read_exact(conn, size))
            if await self._read_exact(conn, 2) != b"\r\n":
                raise ValueError("chunk not followed by CRLF")

    async def _read_line(self, conn: _Connection) -> bytes:
        """The next line, its CRLF included."""
        end = conn.buffer.find(b"\r\n")
        while end < 0:
            if len(conn.buffer) > _MAX_HEAD:
                raise ValueError("chunked framing line too long")
            await self._receive(conn, _RECV, eof_ok=False)
            end = conn.buffer.find(b"\r\n")
        line = bytes(conn.buffer[:end + 2])
        del conn.buffer[:end + 2]
        return line

    def _stalled(self) -> TimeoutError:
        return TimeoutError(f"no data from {self._base} for {self._read_timeout:g} s")

    async def _receive(self, conn: _Connection, max_bytes: int, *, eof_ok: bool) -> int:
        """Append up to ``max_bytes`` to the buffer; the count, 0 at the end of the stream."""
        with trio.move_on_after(self._read_timeout) as scope:
            data = await conn.stream.receive_some(max_bytes)
        if scope.cancelled_caught:
            raise self._stalled()
        if not data and not eof_ok:
            raise _closed()
        conn.buffer += data
        conn.received += len(data)
        return len(data)

    # --- the pool ---

    def _this_run(self) -> None:
        run = trio.lowlevel.current_root_task()
        if run is not self._run:
            self._idle.clear()     # a previous run's streams: unusable here, left to the garbage collector
            self._early.clear()
            self._run = run

    def _take(self) -> _Connection | None:
        """An idle connection of this run (callers check the run first: ``_this_run``), or None."""
        now = time.monotonic()
        while self._idle and now - self._idle[0].idle_since > _IDLE_MAX_S:     # oldest first
            self._idle.pop(0).close()
        return self._idle.pop() if self._idle else None

    def _give_back(self, conn: _Connection) -> None:
        conn.used = True
        conn.idle_since = time.monotonic()
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self, target: str) -> _Connection:
        where = f"GET {self._base}{target}"
        stream = None
        step = "cannot connect"
        try:
            with trio.fail_after(self._connect_timeout):
                stream = await trio.open_tcp_stream(self._hostname, self._port)
                if self._ssl is not None:
                    step = "TLS handshake failed"
                    stream = trio.SSLStream(stream, self._ssl, server_hostname=self._hostname,
                                            https_compatible=True)
                    await stream.do_handshake()
        except trio.TooSlowError:
            self._abandon(stream)
            raise TimeoutError(f"{where}: {step}: no answer in {self._connect_timeout:g} s") from None
        except (OSError, trio.BrokenResourceError) as exc:
            self._abandon(stream)
            reason = exc.__cause__ or exc          # trio wraps the ssl error
            raise ConnectionError(f"{where}: {step}: {reason}") from None
        except BaseExceptionGroup as group:
            self._abandon(stream)
            # open_tcp_stream's nursery wraps a cancellation of its attempts (a hedge that lost, a
            # reader gone) in a group: raise it as the plain cancellation it is
            cancelled, rest = group.split(trio.Cancelled)
            if rest is None:
                raise _first_leaf(cancelled) from None
            raise
        except BaseException:
            self._abandon(stream)
            raise
        return _Connection(stream)

    @staticmethod
    def _abandon(stream: trio.abc.Stream | None) -> None:
        if stream is not None:
            _Connection(stream).close()


def _closed() -> ConnectionError:
    return ConnectionError("connection closed by the server")


def _receive_blocking(fd: int, view: memoryview, have: int, length: int, timeout: float,
                      stop: threading.Event) -> tuple[int, bool]:
    """Worker thread: receive into ``view[have:length]`` from the non-blocking socket ``fd`` until
    it is full, the peer closes, no byte comes for ``timeout`` seconds, or ``stop`` is set:
    (bytes in ``view`` now, timed out). The trio thread carries every FUSE request of the mount;
    a cold packed epoch's shard blocks are ~1 GB of receives that it no longer makes."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    waited = 0.0
    while have < length and not stop.is_set():
        try:
            got = os.readv(fd, [view[have:min(length, have + _RECV_BODY)]])
        except BlockingIOError:
            if poller.poll(_POLL_S * 1000):
                waited = 0.0
            else:
                waited += _POLL_S
                if waited >= timeout:
                    return have, True
            continue
        if not got:
            break
        have += got
    return have, False


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group
