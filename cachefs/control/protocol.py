"""The control protocol: its wire format and schema, shared by the daemon (``server``) and its clients.

Stdlib only (plus ``cachefs.errors``): clients import this module and ``client``, never the daemon
stack, so ``import warmup.cli`` loads neither trio nor pyfuse3 nor boto3.

A client opens ``MOUNT/.cachefs-control`` read-write, writes one request (a JSON object, at most
``MAX_REQUEST`` bytes), then reads newline-delimited JSON replies until EOF. On a read-only mount
(where no file opens for writing) the same bytes travel by ``ioctl`` on a read-only descriptor:
``IOCTL_SEND`` carries a piece of the request, ``IOCTL_RECEIVE`` returns the next piece of the
replies (each piece a 4-byte little-endian length, then that many bytes; length 0: the end). A
daemon whose FUSE layer has no ioctl (pyfuse3) answers ENOTTY and keeps its mount writable.

    request  {"protocol": 1, "op": "sync", "args": {"wait": true}}
    replies  {"kind": "event", "data": {...}}        zero or more: progress lines, then the result
             {"kind": "end"}                          the command finished; its last event is the result
             {"kind": "error", "code": 2, "error": "one-line message"}    instead of "end"

``code`` is the CLI exit code (``cachefs.errors.ExitCode``) of the error raised in the daemon, so a
usage error there exits 2 in the client, a refused caller 13, an unknown command 14. The request's
key is ``op``, not the ``command`` of protocol 0, so a daemon older than this protocol refuses it
without side effects (it answers a line without ``kind``, which the client reports as
``Unsupported``). A client asks ``hello`` for the daemon's protocol and commands and decides on
that, never on an error's text.
"""

import json
from typing import Any

from cachefs.errors import CachefsError, ExitCode, NoDaemon, PermissionDenied, Unsupported, UsageError

CONTROL_NAME = ".cachefs-control"    # the hidden control file at the root of every mount
PROTOCOL_VERSION = 1                 # raise it when a request or reply changes shape
MIN_PROTOCOL_VERSION = 1             # the oldest client protocol this daemon still answers
MAX_REQUEST = 1 << 20                # bytes in one request (a manifest is sent in parts)
HELLO = "hello"                      # the handshake: {"protocol", "version", "commands", "restricted",
                                     #   "may_change", "loader_channel": {"socket", "wire"} or None,
                                     #   "immutable": entries kept by the kernel (absent: older daemon)}
IOCTL_PIECE = 4096                   # bytes of one ioctl's buffer (a 4-byte length, then data)
IOCTL_SEND = 0x40000000 | (IOCTL_PIECE << 16) | (ord("C") << 8) | 1      # _IOW('C', 1, 4096)
IOCTL_RECEIVE = 0x80000000 | (IOCTL_PIECE << 16) | (ord("C") << 8) | 2   # _IOR('C', 2, 4096)


# ---- requests ------------------------------------------------------------------------------------
class Request:
    """A decoded request. (Plain classes here, not dataclasses: building a dataclass costs
    milliseconds at import, and every client imports this module.)"""

    __slots__ = ("op", "args", "protocol")

    def __init__(self, op: str, args: dict[str, Any] | None = None, protocol: int = PROTOCOL_VERSION) -> None:
        self.op, self.args, self.protocol = op, args or {}, protocol

    def __repr__(self) -> str:
        return f"Request({self.op!r}, {self.args!r}, protocol={self.protocol})"


class ProtocolError(UsageError):
    """A request that cannot be decoded (not JSON, not the schema, too large)."""


def encode_request(op: str, args: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"protocol": PROTOCOL_VERSION, "op": op, "args": args or {}}).encode()


def decode_request(raw: bytes) -> Request:
    """The daemon's side: raw bytes -> Request, or a typed error (never anything else)."""
    if len(raw) > MAX_REQUEST:
        raise ProtocolError(f"request too large: {len(raw)} bytes (at most {MAX_REQUEST})")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError(f"malformed request (not JSON): {raw[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed request: not a JSON object")
    if "op" not in obj and "command" in obj:
        raise Unsupported(f"this daemon speaks control protocol {PROTOCOL_VERSION}; the client is older: "
                          f"use the cachefs that started the daemon")
    protocol, op, args = obj.get("protocol"), obj.get("op"), obj.get("args", {})
    if type(protocol) is not int:
        raise ProtocolError("malformed request: 'protocol' must be an integer")
    if not MIN_PROTOCOL_VERSION <= protocol <= PROTOCOL_VERSION:
        raise Unsupported(f"the client speaks control protocol {protocol}, this daemon "
                          f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}: remount with the same cachefs version")
    if not isinstance(op, str) or not op:
        raise ProtocolError("malformed request: 'op' must be a command name")
    if not isinstance(args, dict):
        raise ProtocolError("malformed request: 'args' must be a JSON object")
    return Request(op, args, protocol)


# ---- argument schemas ---------------------------------------------------------------------------
class Arg:
    """One argument: its JSON type (bool, int, float, str, list of str, object), choices; None means absent."""

    __slots__ = ("kind", "choices")

    def __init__(self, kind: type, choices: tuple = ()) -> None:
        self.kind, self.choices = kind, choices


def validate_args(op: str, schema: dict[str, Arg], args: dict[str, Any]) -> dict[str, Any]:
    """``args`` checked against ``schema``, without the None ones (None means absent); a UsageError
    naming the argument otherwise."""
    unknown = sorted(set(args) - set(schema))
    if unknown:
        raise UsageError(f"{op}: unknown argument(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(schema)) or 'none'})")
    for name, value in args.items():
        if value is not None and not _fits(schema[name], value):
            raise UsageError(f"{op}: argument {name!r} must be {_describe(schema[name])}, got {_short(value)}")
    return {name: value for name, value in args.items() if value is not None}


def _fits(arg: Arg, value: Any) -> bool:
    if arg.kind is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if arg.kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif arg.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, arg.kind)
    return ok and (not arg.choices or value in arg.choices)


def _describe(arg: Arg) -> str:
    if arg.choices:
        return "one of " + ", ".join(map(repr, arg.choices))
    return {list: "a list of strings", float: "a number", int: "an integer", bool: "true or false",
            str: "a string", dict: "an object"}[arg.kind]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- replies ------------------------------------------------------------------------------------
def encode_reply(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":")).encode() + b"\n"


def event(data: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "event", "data": data}


END = {"kind": "end"}


def error_reply(exc: CachefsError) -> dict[str, Any]:
    return {"kind": "error", "code": int(exc.exit_code), "error": str(exc)}


_ERRORS: dict[int, type[CachefsError]] = {ExitCode.USAGE: UsageError, ExitCode.NO_DAEMON: NoDaemon,
                                          ExitCode.PERMISSION: PermissionDenied,
                                          ExitCode.UNSUPPORTED: Unsupported}


def error_of(reply: dict[str, Any]) -> CachefsError:
    """The client's side: an error reply -> the exception to raise, carrying the daemon's exit code."""
    code, message = reply.get("code"), str(reply.get("error", "the daemon sent an error without a message"))
    if type(code) is not int or not 1 <= code <= 125:
        code = ExitCode.INTERNAL
    cls = _ERRORS.get(code, CachefsError)
    exc = cls(message)
    exc.exit_code = code
    return exc
