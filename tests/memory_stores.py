"""An in-memory object store whose calls are counted, failed or held, and the block cache built
over it: the kernel-free read path's test support (tiers, namespace, write-back and warm tests)."""

import random
import threading
import uuid
from collections import Counter
from contextlib import asynccontextmanager

import fsspec
import pytest
import trio
import trio.testing

from cachefs.errors import StoreError
from cachefs.metrics import Metrics
from cachefs.store import ObjectStore
from cachefs.store.fsspec_store import FsspecStore
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier

BS = 64 << 10


# --- helpers ------------------------------------------------------------------------------------

class Gate:
    """Holds the store calls it matches (in their worker thread) until opened."""

    def __init__(self, method: str, match) -> None:
        self.method, self.match = method, match
        self.reached = threading.Event()
        self.opened = threading.Event()

    def open(self) -> None:
        self.opened.set()

    async def wait_reached(self, timeout: float = 5.0) -> None:
        assert await trio.to_thread.run_sync(self.reached.wait, timeout), "no call reached the gate"


class CountingStore(ObjectStore):
    """Wraps a store: counts calls per method, and can fail them or hold them at a Gate."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.identity, self.url = inner.identity, inner.url
        self.calls: Counter[str] = Counter()
        self.gets: list[tuple[str, int, int]] = []          # (path, start, end) of every get
        self.started: list[tuple[str, int, int]] = []       # (path, start, end) of every start_get hint
        self.failures: dict[str, StoreError] = {}
        self.gates: list[Gate] = []
        self._lock = threading.Lock()

    def hold(self, method: str, match=lambda *args: True) -> Gate:
        gate = Gate(method, match)
        self.gates.append(gate)
        return gate

    def open_gates(self) -> None:
        for gate in self.gates:
            gate.open()

    def _enter(self, method: str, *args) -> None:
        with self._lock:
            self.calls[method] += 1
        for gate in list(self.gates):
            if gate.method == method and gate.match(*args):
                gate.reached.set()
                assert gate.opened.wait(10), "gate never opened"
        error = self.failures.get(method)
        if error is not None:
            raise type(error)(*error.args)

    def check(self) -> None:
        self._enter("check")
        self.inner.check()

    def list_dir(self, prefix):
        self._enter("list_dir", prefix)
        return self.inner.list_dir(prefix)

    def list_all(self, prefix=""):
        self._enter("list_all", prefix)
        return self.inner.list_all(prefix)

    def head(self, path):
        self._enter("head", path)
        return self.inner.head(path)

    def start_get(self, path, start, end, etag, size):
        self.started.append((path, start, end))
        self.inner.start_get(path, start, end, etag, size)

    def get(self, path, start, end, etag, size):
        self._enter("get", path, start, end)
        with self._lock:
            self.gets.append((path, start, end))
        return self.inner.get(path, start, end, etag, size)


class MemoryBucket:
    """A memory:// tree of objects; ``store()`` gives a fresh CountingStore over it."""

    def __init__(self) -> None:
        self.url = f"memory://bkt-{uuid.uuid4().hex[:12]}/root"
        self.fs = fsspec.filesystem("memory")

    def put(self, path: str, data: bytes) -> None:
        full = f"{self.url}/{path}"
        self.fs.makedirs(self.fs._parent(full), exist_ok=True)
        self.fs.pipe_file(full, data)

    def store(self) -> CountingStore:
        return CountingStore(FsspecStore(self.url, metrics=Metrics(), max_attempts=1))

    def version(self, store: CountingStore, path: str) -> FileVersion:
        info = store.inner.head(path)         # not counted
        return FileVersion(path, info.etag, info.size)

    def one_file(self, data: bytes) -> tuple[bytes, CountingStore, FileVersion]:
        """``data`` as the object "f": the bytes, a fresh store over the bucket, f's version."""
        self.put("f", data)
        store = self.store()
        return data, store, self.version(store, "f")

    def remove(self) -> None:
        self.fs.rm(self.fs._strip_protocol(self.url), recursive=True)


@pytest.fixture
def bucket_mem():
    bucket = MemoryBucket()
    yield bucket
    bucket.remove()


def blob(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def make_disk(root, metrics: Metrics) -> DiskTier:
    return DiskTier(root, capacity=64 << 20, free_space_ratio=0.0, metrics=metrics, fsync=False)


def make_cache(store: ObjectStore, metrics: Metrics, disk: DiskTier | None = None, *, mem: int = 16 << 20,
               readahead: int = 8 * BS, max_fetches: int = 8, max_readaheads: int = 4,
               readahead_at_lookup: bool = False) -> Tiers:
    return Tiers(store, MemoryTier(mem, metrics), disk, metrics, block_size=BS, readahead_size=readahead,
                 max_fetches=max_fetches, max_readaheads=max_readaheads, readahead_at_lookup=readahead_at_lookup)


@asynccontextmanager
async def serving(*parts):
    """Run each part's ``run`` (DiskTier, Tiers) in a nursery for the body's duration."""
    async with trio.open_nursery() as nursery:
        for part in parts:
            await nursery.start(part.run)
        try:
            yield nursery
        finally:
            nursery.cancel_scope.cancel()


def count(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.counter_value(f"cachefs_{name}_total", **labels)


async def until(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.002)
