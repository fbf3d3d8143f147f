"""The object-store interface and the factory that turns a URL into a store.

Every method but ``get_async`` is blocking: the trio thread calls them through
``trio.to_thread.run_sync`` under a ``CapacityLimiter``. Paths are relative to
the mount root (the URL's prefix), "/"-separated, never with a leading "/".
Directory paths passed to ``list_dir`` are "" (the root) or end with "/".
"""

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import trio

from .errors import ConfigError, StoreError
from .metrics import Metrics


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    path: str      # relative to the mount root
    size: int
    mtime: float   # seconds since the epoch
    etag: str      # ETag without quotes, or another version token for non-S3 stores


@dataclass(slots=True)
class Listing:
    files: list[ObjectInfo] = field(default_factory=list)   # direct children
    dirs: list[str] = field(default_factory=list)           # child directory names, no "/"


class ObjectStore(ABC):
    #: Scheme, endpoint, bucket and root prefix; never credentials. Part of every cache key.
    identity: str

    @abstractmethod
    def check(self) -> None:
        """Verify at mount time that the bucket and root exist and credentials work.

        Raises NoSuchBucket, NoSuchKey (prefix has no objects), AccessDenied, Unreachable.
        """

    @abstractmethod
    def list_dir(self, prefix: str) -> Listing:
        """All direct children of ``prefix`` (every page), as files and sub-directories."""

    @abstractmethod
    def list_all(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, recursively, page by page."""

    @abstractmethod
    def head(self, path: str) -> ObjectInfo:
        """Current metadata of one object. Raises NoSuchKey."""

    @abstractmethod
    def get(self, path: str, start: int, end: int, etag: str, size: int) -> bytes:
        """Bytes [start, end) of the object version ``etag`` whose size is ``size``.

        Returns exactly ``end - start`` bytes or raises: VersionChanged when the
        object is no longer at ``etag`` (412, or a response carrying another
        ETag), BadResponse when the server ignored the range or sent the wrong
        length, NoSuchKey, AccessDenied, Unreachable (after retries).
        """

    async def get_async(self, path: str, start: int, end: int, etag: str, size: int, *,
                        limiter: trio.CapacityLimiter) -> bytes:
        """``get`` from the trio thread, at most ``limiter``'s number at once. Here: ``get`` in a
        worker thread; a store that can GET without a thread overrides this."""
        return await trio.to_thread.run_sync(self.get, path, start, end, etag, size, limiter=limiter)

    # --- writes (write-back). Each is blocking, retried like reads, and idempotent where S3 is.
    # An object appears only complete: ``put`` is one request; a multipart upload shows nothing
    # until ``finish_upload``. Stores that cannot write raise StoreError.

    def put(self, path: str, data: bytes) -> ObjectInfo:
        """Store ``data`` as the object ``path`` in one request; return its new metadata."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def start_upload(self, path: str) -> str:
        """Begin a multipart upload of ``path``; return its upload id."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        """Upload part ``number`` (1-based) of an upload; return the part's ETag."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def finish_upload(self, path: str, upload_id: str, parts: list[tuple[int, str]], size: int) -> ObjectInfo:
        """Complete an upload from (number, ETag) pairs; the object appears now. Verifies ``size``."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def abort_upload(self, path: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts (never raises NoSuchKey)."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def delete(self, path: str) -> None:
        """Delete the object ``path``; deleting a missing object succeeds."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Server-side copy of ``src`` to ``dst`` (the object appears complete)."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def make_dir(self, path: str) -> None:
        """Make an empty directory ``path`` persist (an S3 "path/" marker object)."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def remove_dir(self, path: str) -> None:
        """Remove the marker of directory ``path`` (missing is fine)."""
        raise StoreError(f"{self.identity}: this store is read-only")

    def close(self) -> None:
        """Release connections."""


# --- URLs and the store factory -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL. For ``s3://`` ``bucket`` is the bucket; for other
    schemes it is the URL's host part (often "" as in ``file:///data``).
    ``prefix`` is the mount root inside it: no leading or trailing "/"."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme}://{self.bucket}{tail}"


_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIGNED_RE = re.compile(r"(?i)[?&](x-amz-(credential|signature|security-token)|awsaccesskeyid|signature)=")


def parse_url(url: str) -> StoreURL:
    """Split ``scheme://bucket/prefix``; raise ConfigError (one line) if malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME_RE.match(scheme.lower()):
        shown = "(not shown: it may carry credentials)" if "@" in url else repr(url)
        raise ConfigError(f"not a store URL (expected scheme://bucket/prefix): {shown}")
    netloc, _, path = rest.partition("/")
    if "@" in netloc or _SIGNED_RE.search(rest):
        raise ConfigError(f"{scheme}:// URL must not carry credentials; use the environment or a credentials file")
    parsed = StoreURL(scheme.lower(), netloc, path.strip("/"))
    _check_parsed(parsed, url)
    return parsed


def _check_parsed(parsed: StoreURL, url: str) -> None:
    if parsed.scheme == "s3" and not _BUCKET_RE.match(parsed.bucket):
        raise ConfigError(f"s3 URL needs a bucket name (s3://bucket/prefix): {url!r}")
    if not parsed.bucket and not parsed.prefix:
        raise ConfigError(f"store URL names no location: {url!r}")
    if parsed.scheme != "s3" and parsed.scheme not in fsspec.available_protocols():
        raise ConfigError(f"unknown store URL scheme {parsed.scheme!r}: {url!r}")
    if any(part in (".", "..") for part in parsed.prefix.split("/")):
        raise ConfigError(f"store URL prefix must not contain '.' or '..': {url!r}")


def open_store(url: str, *, metrics: Metrics, endpoint_url: str | None = None, region: str | None = None,
               profile: str | None = None, max_connections: int = 64, connect_timeout: float = 5.0,
               read_timeout: float = 30.0, max_attempts: int = 5, lean_requests: bool = True) -> ObjectStore:
    """The store for ``url``: S3Store for ``s3://``, FsspecStore for any other fsspec scheme."""
    parsed = parse_url(url)
    if parsed.scheme == "s3":
        from .store_s3 import S3Options, S3Store
        options = S3Options(endpoint_url=endpoint_url, region=region, profile=profile,
                            max_connections=max_connections, connect_timeout=connect_timeout,
                            read_timeout=read_timeout, max_attempts=max_attempts, lean_requests=lean_requests)
        return S3Store(parsed.bucket, parsed.prefix, metrics=metrics, options=options)
    from .store_fsspec import FsspecStore
    return FsspecStore(url, metrics=metrics, max_attempts=max_attempts)
