"""The control file: how `cachefs status` (and later warmup, sync) talk to a live daemon.

A client opens ``MOUNT/.cachefs-control`` read-write, writes one JSON request
``{"command": NAME, ...args}``, then reads newline-delimited JSON replies until
EOF. It lives inside the mount, so it works unchanged inside a container that
only sees the mount (as JuiceFS's ``.control``). Each command is an async
generator registered by name: a long command (a warmup) streams progress lines.
"""

import errno
import json
import logging
from collections.abc import AsyncIterator, Callable

import trio

from cachefs.errors import CachefsError

log = logging.getLogger(__name__)

Command = Callable[[dict], AsyncIterator[dict]]
_MAX_REQUEST = 1 << 20


class _Session:
    __slots__ = ("request", "replies", "buffer", "done")

    def __init__(self) -> None:
        self.request = bytearray()
        self.replies: AsyncIterator[dict] | None = None
        self.buffer = b""
        self.done = False


class Control:
    def __init__(self, fh_counter: Callable[[], int]) -> None:
        self._new_fh = fh_counter
        self._commands: dict[str, Command] = {}
        self._sessions: dict[int, _Session] = {}

    def register(self, name: str, command: Command) -> None:
        self._commands[name] = command

    def owns(self, fh: int) -> bool:
        return fh in self._sessions

    def open(self) -> int:
        fh = self._new_fh()
        self._sessions[fh] = _Session()
        return fh

    def write(self, fh: int, data: bytes) -> int:
        session = self._sessions[fh]
        if session.replies is not None or len(session.request) + len(data) > _MAX_REQUEST:
            raise OSError(errno.EINVAL, "one request per open, at most 1 MiB")
        session.request += data
        return len(data)

    async def read(self, fh: int, size: int) -> bytes:
        session = self._sessions[fh]
        if session.replies is None:
            session.replies = self._start(bytes(session.request))
        while not session.buffer and not session.done:
            try:
                reply = await anext(session.replies)
            except StopAsyncIteration:
                session.done = True
                break
            session.buffer = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        out, session.buffer = session.buffer[:size], session.buffer[size:]
        return out

    def release(self, fh: int) -> None:
        session = self._sessions.pop(fh, None)
        if session is not None and session.replies is not None:
            # An abandoned stream (client gone, Ctrl-C): close the generator so it stops.
            trio.lowlevel.spawn_system_task(session.replies.aclose)

    async def _start(self, raw: bytes) -> AsyncIterator[dict]:
        try:
            request = json.loads(raw.decode() or "{}")
            command = self._commands[request.pop("command")]
        except (ValueError, KeyError, AttributeError, TypeError):
            yield {"error": f"bad request {raw[:200]!r}; commands: {sorted(self._commands)}"}
            return
        try:
            async for reply in command(request):
                yield reply
        except CachefsError as exc:
            yield {"error": str(exc)}
        except Exception as exc:   # a bug in a command must not take the daemon down
            log.exception("control command %s failed", request)
            yield {"error": f"internal error: {exc}"}
