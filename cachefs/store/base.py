"""The object-store interface: what the tiers, the namespace and write-back ask of a store.

Every method but ``get_async`` is blocking: the trio thread calls them through
``trio.to_thread.run_sync`` under a ``CapacityLimiter``. Paths are relative to
the mount root (the URL's prefix), "/"-separated, never with a leading "/".
Directory paths passed to ``list_dir`` are "" (the root) or end with "/".
"""

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import trio

from cachefs.errors import StoreError


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
    #: The store as a user names it (``s3://bucket/prefix``): for messages, never the identity.
    url: str

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

    def list_tree(self, prefix: str, limit: int) -> Generator[tuple[str, Listing], None, bool]:
        """Every directory below ``prefix`` (itself included) with the listing ``list_dir`` would
        give it, from one recursive listing, each yielded as soon as it is complete. Stops after
        ``limit`` objects and then returns True (the directories still open are not yielded).
        Stores without a recursive listing yield nothing."""
        yield from ()
        return False

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

    @property
    def cancellable_gets(self) -> bool:
        """Whether cancelling ``get_async`` stops the GET itself (its connection closed), so a
        second GET can race it (hedging); a GET in a worker thread runs on after a cancel. Here:
        False for the threaded ``get_async`` below, True for a store that overrides it (a trio task)."""
        return type(self).get_async is not ObjectStore.get_async

    async def get_async(self, path: str, start: int, end: int, etag: str, size: int, *,
                        limiter: trio.CapacityLimiter) -> bytes:
        """``get`` from the trio thread, at most ``limiter``'s number at once. Here: ``get`` in a
        worker thread; a store that can GET without a thread overrides this."""
        return await trio.to_thread.run_sync(self.get, path, start, end, etag, size, limiter=limiter)

    def start_get(self, path: str, start: int, end: int, etag: str, size: int) -> None:  # noqa: B027 (a hint: doing nothing is right)
        """A hint, from the trio thread, with no await: ``get_async`` of this range follows soon
        (its task is started). A store may send the request now and let that call read the
        answer; this one does nothing."""

    # --- writes (write-back). Each is blocking, retried like reads, and idempotent where S3 is.
    # An object appears only complete: ``put`` is one request; a multipart upload shows nothing
    # until ``finish_upload``. Stores that cannot write raise StoreError.

    def put(self, path: str, data: bytes) -> ObjectInfo:
        """Store ``data`` as the object ``path`` in one request; return its new metadata."""
        raise StoreError(f"{self.url}: this store is read-only")

    def start_upload(self, path: str) -> str:
        """Begin a multipart upload of ``path``; return its upload id."""
        raise StoreError(f"{self.url}: this store is read-only")

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        """Upload part ``number`` (1-based) of an upload; return the part's ETag."""
        raise StoreError(f"{self.url}: this store is read-only")

    def finish_upload(self, path: str, upload_id: str, parts: list[tuple[int, str]], size: int) -> ObjectInfo:
        """Complete an upload from (number, ETag) pairs; the object appears now. Verifies ``size``."""
        raise StoreError(f"{self.url}: this store is read-only")

    def abort_upload(self, path: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts (never raises NoSuchKey)."""
        raise StoreError(f"{self.url}: this store is read-only")

    def delete(self, path: str) -> None:
        """Delete the object ``path``; deleting a missing object succeeds."""
        raise StoreError(f"{self.url}: this store is read-only")

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Server-side copy of ``src`` to ``dst`` (the object appears complete)."""
        raise StoreError(f"{self.url}: this store is read-only")

    def make_dir(self, path: str) -> None:
        """Make an empty directory ``path`` persist (an S3 "path/" marker object)."""
        raise StoreError(f"{self.url}: this store is read-only")

    def remove_dir(self, path: str) -> None:
        """Remove the marker of directory ``path`` (missing is fine)."""
        raise StoreError(f"{self.url}: this store is read-only")

    def close(self) -> None:  # noqa: B027  (optional: stores that hold no connections need nothing)
        """Release connections."""
