"""The control file's daemon side: how `cachefs status`, warmup and sync talk to a live daemon.

One session per open of ``MOUNT/.cachefs-control``: the client writes one request, then reads the
replies (``protocol`` has the wire format). It lives inside the mount, so it works unchanged inside
a container that only sees the mount (as JuiceFS's ``.control``). Commands come from one table
(``commands``); a long one (a warmup) streams progress lines.

Who may drive the daemon: the FUSE request context of the ``open`` (uid, gid, pid) travels with
the session. A command that changes state runs only for uid 0 or the mount's owner (the daemon's
``--uid``, else the uid that mounted); read-only ones (``hello``, ``status``, ``warmup_check``)
answer everyone who can open the file. The file stays mode 0666 so that every user of an
``--allow-other`` mount can ask ``status``: this check, not the mode, is the guard.
"""

import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from cachefs import __version__
from cachefs.control import protocol
from cachefs.control.commands import Command
from cachefs.errors import CachefsError, PermissionDenied, Unsupported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who opened the control file (from pyfuse3's ``RequestContext``)."""

    uid: int
    gid: int
    pid: int

    @classmethod
    def of(cls, ctx: Any) -> "Caller":
        return cls(int(ctx.uid), int(ctx.gid), int(ctx.pid))


class _Session:
    __slots__ = ("caller", "request", "too_large", "replies", "buffer", "done")

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.request = bytearray()
        self.too_large = False
        self.replies: AsyncIterator[dict] | None = None
        self.buffer = b""
        self.done = False


class Control:
    def __init__(self, fh_counter: Callable[[], int], commands: dict[str, Command] | None = None,
                 owner_uid: int | None = None, advertised: Callable[[], dict] | None = None) -> None:
        self._new_fh = fh_counter
        self._commands = commands or {}
        self._advertised = advertised or dict      # more the handshake tells (the loader channel)
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self._sessions: dict[int, _Session] = {}

    def owns(self, fh: int) -> bool:
        return fh in self._sessions

    def open(self, ctx: Any) -> int:
        """A new session for the caller of this FUSE ``open`` (``ctx``: uid, gid, pid)."""
        fh = self._new_fh()
        while fh in self._sessions:          # handle numbers wrap: never one a live session has
            fh = self._new_fh()
        self._sessions[fh] = _Session(Caller.of(ctx))
        return fh

    def answering(self, fh: int) -> bool:
        """Whether the session's request was read and its replies begun."""
        return self._sessions[fh].replies is not None

    def write(self, fh: int, data: bytes) -> int:
        session = self._sessions[fh]
        if session.replies is not None:
            raise OSError(errno.EINVAL, "one request per open")
        if len(session.request) + len(data) > protocol.MAX_REQUEST:
            session.too_large = True       # answered with a typed error when the client reads
        else:
            session.request += data
        return len(data)

    async def read(self, fh: int, size: int) -> bytes:
        session = self._sessions[fh]
        if session.replies is None:
            session.replies = self._run(session)
        while not session.buffer and not session.done:
            try:
                reply = await anext(session.replies)
            except StopAsyncIteration:
                session.done = True
                break
            session.buffer = protocol.encode_reply(reply)
        out, session.buffer = session.buffer[:size], session.buffer[size:]
        return out

    def release(self, fh: int) -> None:
        session = self._sessions.pop(fh, None)
        if session is not None and session.replies is not None:
            # An abandoned stream (client gone, Ctrl-C): close the generator so it stops.
            trio.lowlevel.spawn_system_task(session.replies.aclose)

    # ---- one request ---------------------------------------------------------------------------
    async def _run(self, session: _Session) -> AsyncIterator[dict]:
        """The replies to a session's request: events then "end", or one typed error."""
        request = None
        try:
            request = self.decode(session)
            if request.op == protocol.HELLO:
                yield protocol.event(self.hello(session.caller))
            else:
                command, args = self.authorize(request, session.caller)
                async for data in command.handler(args):
                    yield protocol.event(data)
        except CachefsError as exc:
            yield protocol.error_reply(exc)
            return
        except Exception as exc:   # a bug in a command must not take the daemon down
            log.exception("control command %s failed", request.op if request else "?")
            yield protocol.error_reply(CachefsError(f"internal error: {exc}"))
            return
        yield protocol.END

    def decode(self, session: _Session) -> protocol.Request:
        if session.too_large:
            raise protocol.ProtocolError(f"request larger than {protocol.MAX_REQUEST} bytes "
                                         f"(send a manifest in parts)")
        return protocol.decode_request(bytes(session.request))

    def authorize(self, request: protocol.Request, caller: Caller) -> tuple[Command, dict[str, Any]]:
        """The command to run and its checked arguments, its caller allowed; a typed error otherwise."""
        command = self._commands.get(request.op)
        if command is None:
            raise Unsupported(f"unknown command {request.op[:80]!r} (this daemon has: "
                              f"{', '.join(self.names())})")
        if command.changes_state and not self.may_change(caller):
            raise PermissionDenied(f"{request.op}: only root and the mount's owner (uid {self.owner_uid}) may "
                                   f"change this mount; uid {caller.uid} may use the read-only commands")
        return command, protocol.validate_args(request.op, command.args, request.args)

    def may_change(self, caller: Caller) -> bool:
        return caller.uid in (0, self.owner_uid)

    def names(self) -> list[str]:
        return sorted([protocol.HELLO, *self._commands])

    def hello(self, caller: Caller) -> dict:
        return {"protocol": protocol.PROTOCOL_VERSION, "min_protocol": protocol.MIN_PROTOCOL_VERSION,
                "version": __version__, "commands": self.names(),
                "restricted": sorted(n for n, c in self._commands.items() if c.changes_state),
                "may_change": self.may_change(caller), **self._advertised()}
