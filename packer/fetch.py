"""Parallel GETs of source files, handed back in order with a bounded number in flight."""

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future

from cachefs.errors import NoSuchKey, VersionChanged
from cachefs.packfmt import SourceChanged
from cachefs.store import ObjectStore

from .source import SourceFile


def in_order(pool: Executor, items: Iterable, fn: Callable, window: int) -> Iterator[tuple[object, object]]:
    """(item, fn(item)) in the items' order; at most ``window`` calls submitted ahead."""
    pending: deque[tuple[object, Future]] = deque()
    source = iter(items)
    try:
        for item in source:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= window:
                first, future = pending.popleft()
                yield first, future.result()
        while pending:
            first, future = pending.popleft()
            yield first, future.result()
    finally:
        for _, future in pending:
            future.cancel()


def fetch_source(store: ObjectStore, stream_above: int, f: SourceFile) -> bytes | None:
    """The file's bytes at the listed version (None for a file above ``stream_above``: it is
    streamed by ``fetch_ranges``); SourceChanged if it changed or vanished since the listing."""
    if f.size > stream_above:
        return None
    try:
        if f.size == 0:
            now = store.head(f.path)
            if now.etag != f.etag or now.size != 0:
                raise VersionChanged(f"{f.path}: ETag {now.etag}")
            return b""
        return store.get(f.path, 0, f.size, f.etag, f.size)
    except (VersionChanged, NoSuchKey) as exc:
        raise SourceChanged(f"source object {f.path!r} changed while it was packed ({exc}); run the pack "
                            "again") from exc


def fetch_ranges(pool: Executor, store: ObjectStore, f: SourceFile, range_size: int,
                 in_flight: int) -> Iterator[bytes]:
    """A large file's bytes as ranged GETs of the listed version, in order, ``in_flight`` at once."""
    ranges = [(start, min(start + range_size, f.size)) for start in range(0, f.size, range_size)]
    for _, data in in_order(pool, ranges, lambda r: _get_range(store, f, *r), in_flight):
        yield data


def _get_range(store: ObjectStore, f: SourceFile, start: int, end: int) -> bytes:
    try:
        return store.get(f.path, start, end, f.etag, f.size)
    except (VersionChanged, NoSuchKey) as exc:
        raise SourceChanged(f"source object {f.path!r} changed while it was packed ({exc}); run the pack "
                            "again") from exc
