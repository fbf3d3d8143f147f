"""What a GET asks for and which answers provably hold those bytes (every transport checks the same way).

Servers differ (docs/design.md, measured facts). A ranged GET is accepted when its answer is:

- 206 with a Content-Range naming exactly the asked bytes (and the pinned size);
- 200 with the whole object (``kind`` whole_object): the asked bytes are sliced out. When the
  object is much bigger than the range, the transport reads only up to the range's end and closes
  the connection (``window``): a 4 MiB block of a 512 MiB object never buffers the object; past
  ``MAX_SKIP`` bytes of skipping the read fails clearly instead;
- 200 with exactly the asked length and a Content-Range naming the asked bytes (rclone serve s3
  1.75: ``range_200_content_range``), or without Content-Range but with the pinned ETag
  (``range_200_etag``).

Anything else is refused: an ETag other than the pinned one is VersionChanged; a body of another
length, or a Content-Range naming other bytes (a confused proxy or cache in front of the store), is
``BadAnswer`` (retried, then BadResponse: EIO): never wrong bytes; a 200 of the asked length that
proves nothing is BadResponse. The store counts each accepted 200 in
``cachefs_store_range_fallbacks_total{kind}`` and warns once per kind.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from cachefs.errors import BadResponse, VersionChanged
from cachefs.store.s3.sigv4 import check_headers

_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_CODE_RE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE_RE = re.compile(rb"<Message>([^<]*)</Message>")
MAX_WASTE = 8 << 20     # a whole-object answer with more unwanted bytes is cut short (``window``)
MAX_SKIP = 64 << 20     # ... and one that would need more bytes skipped is refused

# (status, Content-Length) -> (skip, take) to read only part of a body, or None: see ``window``
Window = Callable[[int, int | None], tuple[int, int] | None]
KINDS = ("whole_object", "range_200_content_range", "range_200_etag")
BEHAVIOUR = {
    "whole_object": "answers ranged GETs with 200 and the whole object (the asked bytes are sliced out)",
    "range_200_content_range": "answers ranged GETs with 200 (not 206) and a matching Content-Range",
    "range_200_etag": "answers ranged GETs with 200 (not 206), no Content-Range; the pinned ETag matches",
}


@dataclass(slots=True)
class Reply:
    """What the store reads of one S3 answer, whichever transport brought it (header values as
    sent; ``cut``: the transport read only the asked bytes of a whole-object answer, ``window``)."""
    status: int
    etag: str | None = None
    content_range: str | None = None
    content_length: int | None = None
    last_modified: str | None = None
    cut: bool = False


class S3Error(Exception):
    """An S3 error answer: its HTTP status, the Code and Message of its XML body (the status as
    the code when there is no body, as for HEAD), Retry-After, and the bucket's region when the
    server names it (a request signed for the wrong region)."""

    def __init__(self, operation: str, status: int, code: str, message: str = "", *,
                 retry_after: str | None = None, region: str | None = None) -> None:
        super().__init__(f"{operation}: {status} {code}" + (f": {message}" if message else ""))
        self.operation = operation
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.region = region


class BadAnswer(Exception):
    """An answer that is unusable, where the next one may be fine (a Content-Range naming other
    bytes, an unreadable listing page: a confused proxy or cache in front of the store): retried,
    then BadResponse."""


class ShortBody(BadAnswer):
    """The body length differs from what was asked: retried, then BadResponse."""


@dataclass(frozen=True, slots=True)
class Want:
    url: str
    etag: str
    start: int
    end: int
    size: int

    @property
    def ranged(self) -> bool:
        return not (self.start == 0 and self.end == self.size)

    @property
    def length(self) -> int:
        return self.end - self.start


def get_headers(want: Want) -> dict[str, str]:
    """If-Match and Range of a GET, as HTTP headers, checked (an ETag with CR/LF is refused)."""
    headers = {}
    if want.etag:
        headers["If-Match"] = f'"{want.etag}"'
    if want.ranged:
        headers["Range"] = f"bytes={want.start}-{want.end - 1}"
    return check_headers(headers)


def window(want: Want, status: int, content_length: int | None) -> tuple[int, int] | None:
    """(skip, take) when the answer is the whole of a big object and only the asked bytes should
    be read (the connection is then closed); None to read the body as it comes."""
    if not (want.ranged and status == 200 and content_length == want.size):
        return None
    if want.size - want.length <= MAX_WASTE:
        return None
    if want.start > MAX_SKIP:
        raise BadResponse(f"get {want.url}: the server ignores Range (200 with the whole {want.size}-byte "
                          f"object); refusing to download {want.start} bytes to skip them")
    return want.start, want.length


def verify(want: Want, reply: Reply, body: bytes) -> tuple[bytes, str | None]:
    """(the bytes [start, end), the fallback kind or None) of a GET answer; VersionChanged,
    BadResponse or BadAnswer when it does not provably hold them."""
    got = etag_of(reply.etag)
    if got and want.etag and got != want.etag:
        raise VersionChanged(f"get {want.url}: object changed (ETag {got}, pinned {want.etag})")
    status = reply.status
    kind = None
    if want.ranged:
        body, kind = _ranged_body(want, status, reply, body)
    elif status != 200:
        raise BadResponse(f"get {want.url}: whole-object GET answered {status}")
    if len(body) != want.length:
        raise ShortBody(f"got {len(body)} bytes, asked {want.length}")
    return body, kind


def _ranged_body(want: Want, status: int, reply: Reply, body: bytes) -> tuple[bytes, str | None]:
    content_range = reply.content_range
    if status == 206:
        _check_content_range(want, content_range)
        return body, None
    if status != 200:
        raise BadResponse(f"get {want.url}: asked bytes {want.start}-{want.end - 1}, got {status}")
    if reply.cut:          # the transport read only [start, end) of the whole object
        return body, "whole_object"
    if len(body) == want.size:
        return body[want.start:want.end], "whole_object"
    if len(body) != want.length:
        raise ShortBody(f"asked bytes {want.start}-{want.end - 1}, got 200 with {len(body)} bytes")
    if content_range:
        _check_content_range(want, content_range)
        return body, "range_200_content_range"
    if want.etag and etag_of(reply.etag) == want.etag:
        return body, "range_200_etag"
    raise BadResponse(f"get {want.url}: asked bytes {want.start}-{want.end - 1}, got 200 with {len(body)} "
                      "bytes and neither Content-Range nor the pinned ETag to prove which")


def _check_content_range(want: Want, content_range: str | None) -> None:
    match = _CONTENT_RANGE_RE.match(content_range or "")
    if not match or (int(match[1]), int(match[2])) != (want.start, want.end - 1):
        raise BadAnswer(f"asked bytes {want.start}-{want.end - 1}, got Content-Range {content_range!r}")
    if match[3] != "*" and int(match[3]) != want.size:
        raise VersionChanged(f"get {want.url}: object size is now {match[3]}, pinned {want.size}")


def etag_of(value: str | None) -> str:
    return (value or "").strip('"')


def content_length(value: str | None) -> int | None:
    """A Content-Length header's value, or None when absent or not a plain number."""
    return int(value) if value is not None and value.isdigit() else None


def http_date(value: str | None) -> float:
    """Seconds since the epoch of an HTTP date (Last-Modified); BadAnswer when absent or unreadable."""
    try:
        return parsedate_to_datetime(value or "").timestamp()
    except (TypeError, ValueError):
        raise BadAnswer(f"unreadable Last-Modified {str(value)[:60]!r}") from None


def error_of(operation: str, status: int, body: bytes | None, headers) -> S3Error:
    """The S3Error of an error answer: Code and Message from its XML body (the status as the code
    when there is none), Retry-After and x-amz-bucket-region from its ``headers`` (a mapping
    with case-insensitive lookup, or None)."""
    body = body or b""
    code = _CODE_RE.search(body)
    message = _MESSAGE_RE.search(body)
    get = headers.get if headers is not None else (lambda name: None)
    return S3Error(operation, status, code[1].decode(errors="replace") if code else str(status),
                   message[1].decode(errors="replace") if message else "",
                   retry_after=get("retry-after"), region=get("x-amz-bucket-region"))


def error_in_body(operation: str, status: int, body: bytes, headers) -> S3Error | None:
    """The error a 200 answer carries in its body, or None: CompleteMultipartUpload and CopyObject
    may answer 200 and fail later, sending ``<Error>`` instead of their result."""
    head = body.lstrip()[:200]
    if head.startswith(b"<?xml"):
        head = head[head.find(b"?>") + 2:].lstrip()
    return error_of(operation, status, body, headers) if head.startswith(b"<Error>") else None
