"""The loader channel's wire format, shared by the daemon (``channel``) and the loader
(``cachefs.data.direct``). Stdlib only: every training process and DataLoader worker imports it.

A unix socket, ``CACHE_DIR/loader.sock`` (mode 0600, peers checked), one request per connection,
a JSON line; the daemon names the socket and the wire version it speaks in its control
handshake (``hello``: ``loader_channel``), so a loader never reads the daemon's status or files.

Wire 2::

    {"wire": 2, "op": "files", "shard": 3, "name": "00003.tfrecord", "first": 0, "count": 64}
    -> {"wire": 2, "ok": true, "block_size": B, "extents": [[index, length, offset], ...]}
       with one descriptor per extent in SCM_RIGHTS, in the same order: block ``index`` of the
       shard (``length`` bytes) is bytes [offset, offset + length) of that descriptor's file.
       Only blocks the disk tier holds are listed; the daemon fetches nothing.

    {"wire": 2, "op": "warm", "shard": 3, "name": "00003.tfrecord"}
    -> {"wire": 2, "ok": true, "queued": true}     the daemon's shard warm takes the shard (once)

    any error -> {"wire": 2, "ok": false, "error": "..."} and no descriptors.

Wire 1 (a loader of an older release: no ``wire`` key, ``files`` implied) is still answered, in its
own shape: ``"blocks": [[index, length], ...]`` (that loader reads each block file's header
itself to find the data).
"""

import json
from dataclasses import dataclass

WIRE = 2
SOCKET_NAME = "loader.sock"
FILES_PER_ANSWER = 128       # descriptors in one answer (SCM_RIGHTS carries at most 253)
MAX_REQUEST = 4096           # bytes of one request line


class WireError(ValueError):
    """A request or answer that is not what this wire version says (or an answer saying no)."""


@dataclass(frozen=True, slots=True)
class Files:
    """Ask for the descriptors of blocks [first, first + count) of a shard."""
    shard: int
    name: str
    first: int = 0
    count: int = FILES_PER_ANSWER
    wire: int = WIRE


@dataclass(frozen=True, slots=True)
class Warm:
    """Ask the daemon to warm a whole shard (its shard warm, ``--shard-warm``)."""
    shard: int
    name: str
    wire: int = WIRE


@dataclass(frozen=True, slots=True)
class Extent:
    index: int       # the block of the shard
    length: int      # its bytes
    offset: int      # where they start in the descriptor's file


@dataclass(frozen=True, slots=True)
class FilesAnswer:
    block_size: int
    extents: list[Extent]


def encode_request(request: Files | Warm) -> bytes:
    body = {"wire": WIRE, "op": "warm" if isinstance(request, Warm) else "files", "shard": request.shard,
            "name": request.name}
    if isinstance(request, Files):
        body.update(first=request.first, count=request.count)
    return json.dumps(body).encode() + b"\n"


def decode_request(line: bytes) -> Files | Warm:
    """The request on a line; WireError for anything malformed or of an unknown version or op."""
    try:
        body = json.loads(line)
        wire = int(body.get("wire", 1))
        op = body.get("op", "files")
        shard, name = int(body["shard"]), str(body["name"])
        if wire not in (1, WIRE):
            raise WireError(f"wire {wire} is not spoken here (1..{WIRE})")
        if op == "warm" and wire >= 2:
            return Warm(shard, name)
        if op != "files":
            raise WireError(f"unknown op {op!r}")
        first, count = max(int(body["first"]), 0), min(max(int(body["count"]), 0), FILES_PER_ANSWER)
        return Files(shard, name, first, count, wire)
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WireError(f"bad request: {exc}") from None


def encode_files(request: Files, block_size: int, extents: list[Extent]) -> bytes:
    """The answer to ``request`` in its wire's shape (wire 1 lists [index, length] only)."""
    if request.wire == 1:
        return _line({"ok": True, "block_size": block_size, "blocks": [[e.index, e.length] for e in extents]})
    return _line({"wire": WIRE, "ok": True, "block_size": block_size,
                  "extents": [[e.index, e.length, e.offset] for e in extents]})


def encode_warm(queued: bool) -> bytes:
    return _line({"wire": WIRE, "ok": True, "queued": queued})


def encode_error(request_wire: int, error: str) -> bytes:
    return _line({"ok": False, "error": error} if request_wire == 1 else {"wire": WIRE, "ok": False, "error": error})


def decode_files(message: bytes, descriptors: int) -> FilesAnswer:
    """A ``files`` answer; WireError when it says no, is malformed, or lists another number of
    extents than the descriptors that came with it."""
    body = _decoded(message)
    try:
        extents = [Extent(int(i), int(n), int(o)) for i, n, o in body["extents"]]
        answer = FilesAnswer(int(body["block_size"]), extents)
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"bad answer: {exc}") from None
    if len(extents) != descriptors or answer.block_size <= 0:
        raise WireError(f"{len(extents)} extents with {descriptors} descriptors")
    if any(e.index < 0 or e.length <= 0 or e.offset < 0 for e in extents):
        raise WireError("an extent out of range")
    return answer


def decode_warm(message: bytes) -> bool:
    """Whether the daemon queued the warm; WireError when it says no or is malformed."""
    return bool(_decoded(message).get("queued"))


def _decoded(message: bytes) -> dict:
    try:
        body = json.loads(message.split(b"\n", 1)[0])
    except ValueError as exc:
        raise WireError(f"unreadable answer: {exc}") from None
    if not isinstance(body, dict) or body.get("wire") != WIRE:
        raise WireError(f"answer of wire {body.get('wire') if isinstance(body, dict) else None}, not {WIRE}")
    if not body.get("ok"):
        raise WireError(str(body.get("error", "refused")))
    return body


def _line(body: dict) -> bytes:
    return json.dumps(body).encode() + b"\n"
