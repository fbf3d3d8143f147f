"""Any other fsspec URL (``file://``, ``memory://``, ...) as an ObjectStore.

These filesystems have no ETag and no conditional reads, so the version token
is the ETag when the backend reports one, else built from mtime, size and inode;
``get`` compares it before and after reading and raises VersionChanged if it
moved, so a read never returns bytes of another version than the one pinned.
"""

import contextlib
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, TypeVar

import fsspec

from cachefs.errors import (
    AccessDenied,
    BadResponse,
    ConfigError,
    NoSuchBucket,
    NoSuchKey,
    StoreError,
    Unreachable,
    VersionChanged,
)
from cachefs.metrics import Metrics
from cachefs.store.base import Listing, ObjectInfo, ObjectStore
from cachefs.store.metrics import StoreMetrics
from cachefs.store.retry import call_with_retries
from cachefs.store.url import parse_url

T = TypeVar("T")

_SKIPPED_NAMES = ("", ".", "..")


def is_temp_failure(exc: BaseException) -> bool:
    return isinstance(exc, (TimeoutError, ConnectionError))


def map_error(exc: OSError, *, op: str, url: str) -> StoreError:
    where = f"{op} {url}"
    if isinstance(exc, FileNotFoundError):
        return NoSuchKey(f"{where}: not found")
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{where}: permission denied")
    if is_temp_failure(exc):
        return Unreachable(f"{where}: {type(exc).__name__}: {exc}")
    return StoreError(f"{where}: {type(exc).__name__}: {exc}")


def _status_of(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    return "not_found" if isinstance(exc, FileNotFoundError) else "error"


def _seconds(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value or 0.0)


def version_token(info: dict) -> str:
    """The ETag if the backend has one, else mtime (ns), size and inode in hex."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag).strip('"')
    mtime_ns = int(_seconds(info.get("mtime", info.get("created"))) * 1e9)
    token = f"{mtime_ns:x}-{int(info['size']):x}"
    return f"{token}-{int(info['ino']):x}" if info.get("ino") else token


def _object_info(path: str, info: dict) -> ObjectInfo:
    mtime = _seconds(info.get("mtime", info.get("created")))
    return ObjectInfo(path=path, size=int(info["size"]), mtime=mtime, etag=version_token(info))


class FsspecStore(ObjectStore):
    """A directory tree of an fsspec filesystem, rooted at the URL's path."""

    def __init__(self, url: str, *, metrics: Metrics, max_attempts: int = 5) -> None:
        self._parsed = parse_url(url)
        try:
            self._fs = fsspec.filesystem(self._parsed.scheme)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open {self._parsed.scheme}:// store: {exc}") from exc
        self._root = self._fs._strip_protocol(url).rstrip("/")
        self._metrics = metrics
        self._m = metrics.group(StoreMetrics)
        self._max_attempts = max_attempts
        self.identity = f"{self._parsed.scheme}|{self._root}"
        self.url = str(self._parsed)
        self._uploads: dict[str, dict[int, bytes]] = {}   # multipart emulation: parts in memory
        self._uploads_lock = threading.Lock()

    def _full(self, path: str) -> str:
        return f"{self._root}/{path}".rstrip("/") if path else self._root

    def _url(self, path: str) -> str:
        return f"{self._parsed}/{path}" if path else str(self._parsed)

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()`` retried and counted; OSErrors become cachefs errors."""
        try:
            return call_with_retries(lambda: self._timed(op, fn), op=op, is_temp_failure=is_temp_failure,
                                     max_attempts=self._max_attempts, metrics=self._metrics)
        except OSError as exc:
            raise map_error(exc, op=op, url=self._url(path)) from exc

    def _timed(self, op: str, fn: Callable[[], T]) -> T:
        started, failure = time.monotonic(), None
        try:
            return fn()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._m.store_requests.labels(op, _status_of(failure)).inc()
            self._m.store_latency.labels(op).observe(time.monotonic() - started)

    # --- ObjectStore ---

    def check(self) -> None:
        if self._call("check", "", lambda: self._fs.isdir(self._root)):
            return
        if not self._parsed.prefix:
            raise NoSuchBucket(f"check {self._parsed}: no such bucket or directory")
        raise NoSuchKey(f"no objects under {self._parsed}")

    def head(self, path: str) -> ObjectInfo:
        info = self._call("head", path, lambda: self._fs.info(self._full(path)))
        if info.get("type") != "file":
            raise NoSuchKey(f"head {self._url(path)}: not a file")
        return _object_info(path, info)

    def get(self, path: str, start: int, end: int, etag: str, size: int) -> bytes:
        if not 0 <= start <= end <= size:
            raise ValueError(f"bad range [{start}, {end}) for an object of {size} bytes")
        self._check_version(path, etag)
        data = self._call("get", path, lambda: self._fs.cat_file(self._full(path), start, end))
        self._check_version(path, etag)
        if len(data) != end - start:
            raise BadResponse(f"get {self._url(path)}: got {len(data)} bytes, asked {end - start}")
        self._m.store_bytes.inc(len(data))
        return data

    def _check_version(self, path: str, etag: str) -> None:
        now = version_token(self._call("head", path, lambda: self._fs.info(self._full(path))))
        if now != etag:
            raise VersionChanged(f"get {self._url(path)}: object changed (version {now}, pinned {etag})")

    def list_dir(self, prefix: str) -> Listing:
        full = self._full(prefix)
        try:
            entries = self._call("list", prefix, lambda: self._fs.ls(full, detail=True))
        except NoSuchKey:
            return Listing()   # like S3: listing an absent prefix gives nothing
        listing = Listing()
        for entry in entries:
            self._add_entry(listing, prefix, entry)
        return listing

    def _add_entry(self, listing: Listing, prefix: str, entry: dict) -> None:
        name = posixpath.basename(entry["name"].rstrip("/"))
        if name in _SKIPPED_NAMES:
            return
        if entry.get("type") == "directory":
            listing.dirs.append(name)
        elif entry.get("type") == "file":
            listing.files.append(_object_info(prefix + name, entry))

    def list_all(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found = self._call("list", prefix, lambda: self._fs.find(self._full(prefix), detail=True))
        skip = len(self._root) + 1
        for name in sorted(found):
            if found[name].get("type") == "file":
                yield _object_info(name[skip:], found[name])

    # --- writes: a temporary name then a move, so an object appears only complete ---

    def put(self, path: str, data: bytes) -> ObjectInfo:
        full = self._full(path)
        self._call("put", path, lambda: self._write_whole(full, data))
        return self.head(path)

    def _write_whole(self, full: str, data: bytes) -> None:
        self._fs.makedirs(self._fs._parent(full), exist_ok=True)
        temp = f"{full}.cachefs-{uuid.uuid4().hex[:12]}.tmp"
        self._fs.pipe_file(temp, data)
        self._fs.mv(temp, full)

    def start_upload(self, path: str) -> str:
        upload_id = uuid.uuid4().hex
        with self._uploads_lock:
            self._uploads[upload_id] = {}
        return upload_id

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        with self._uploads_lock:
            self._uploads[upload_id][number] = bytes(data)
        return f"part-{number}-{len(data)}"

    def finish_upload(self, path: str, upload_id: str, parts: list[tuple[int, str]], size: int) -> ObjectInfo:
        with self._uploads_lock:
            stored = self._uploads.pop(upload_id)
        data = b"".join(stored[number] for number, _ in sorted(parts))
        if len(data) != size:
            raise BadResponse(f"finish_upload {self._url(path)}: {len(data)} bytes, expected {size}")
        return self.put(path, data)

    def abort_upload(self, path: str, upload_id: str) -> None:
        with self._uploads_lock:
            self._uploads.pop(upload_id, None)

    def delete(self, path: str) -> None:
        with contextlib.suppress(NoSuchKey):
            self._call("delete", path, lambda: self._fs.rm_file(self._full(path)))

    def copy(self, src: str, dst: str) -> ObjectInfo:
        self._call("copy", dst, lambda: self._fs.copy(self._full(src), self._full(dst)))
        return self.head(dst)

    def make_dir(self, path: str) -> None:
        self._call("put", path, lambda: self._fs.makedirs(self._full(path), exist_ok=True))

    def remove_dir(self, path: str) -> None:
        try:
            self._call("delete", path, lambda: self._fs.rmdir(self._full(path)))
        except (NoSuchKey, StoreError):
            pass   # gone already, or not empty (files below still name it)
