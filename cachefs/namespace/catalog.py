"""The listing catalog: what each directory holds, owned here and nowhere else.

One ``Catalog`` per mount keeps every directory's ``DirState`` (its listing and when it was
taken), lists a directory again once its listing is stale (one LIST per directory at a time,
single flight), saves listings to the on-disk ``ListingSnapshot`` and loads them from it, and
takes listings found by others: the list-ahead at mount (``install``), a warmup's recursive
LIST (``adopt_tree``), a newer version seen by a HEAD (``publish``, ``adopt_file``). The
namespace (``vfs.py``), the warm engine and the list-ahead all ask it; none keeps a listing of
its own.

Two calls go up to the namespace, through the ports ``daemon.py`` wires (``cachefs/ports.py``):
``listed(path, state, from_store)`` when a listing is taken (the namespace lays what the
write-back has staged over it and, for one fresh from the store, refreshes the nodes it knows),
and ``versioned(info)`` when a warmup saw a newer version of a file.

Freshness is one rule for listings and nodes alike: fresh for ``metadata_ttl`` seconds, forever
on an immutable mount. After a failed LIST the stale listing is served, and the store asked
again in at most ``OUTAGE_RETRY`` seconds. A directory that held records the write-back replayed
at start is listed once from the store before its saved listing is trusted (docs/writeback.md).
"""

import logging
import time

import trio

from cachefs.errors import StoreError
from cachefs.namespace.dirs import DirSource, DirState, dir_prefix, join, split
from cachefs.namespace.snapshot import ListingSnapshot, NoSnapshot
from cachefs.ports import Port
from cachefs.singleflight import SingleFlight
from cachefs.store import Listing, ObjectInfo

log = logging.getLogger(__name__)

OUTAGE_RETRY = 5.0      # seconds between revalidation attempts while the store is failing


class Catalog:
    def __init__(self, source: DirSource, snapshot: ListingSnapshot | None, *, metadata_ttl: float,
                 immutable: bool, limiter: trio.CapacityLimiter | None = None,
                 replayed: set[str] | None = None, listed: Port | None = None,
                 versioned: Port | None = None) -> None:
        self.source = source
        self.snapshot = snapshot
        self.saved = snapshot if snapshot is not None else NoSnapshot()   # told of the mount's own changes
        self.ttl = metadata_ttl
        self.immutable = immutable
        self.limiter = limiter or trio.CapacityLimiter(16)
        self._replayed = replayed if replayed is not None else set()     # the write-back's; read, never changed
        self._relisted: set[str] = set()        # ... of which these were listed from the store since
        self.listed = listed if listed is not None else Port("listed")
        self.versioned = versioned if versioned is not None else Port("versioned")
        self._dirs: dict[str, DirState] = {}
        self._flights = SingleFlight()

    # ---- freshness ---------------------------------------------------------------------------
    def is_fresh(self, stamp: float) -> bool:
        return self.immutable or time.time() - stamp < self.ttl

    def retry_stamp(self) -> float:
        """A freshness stamp after a failed revalidation: try the store again in at most
        OUTAGE_RETRY seconds, instead of waiting out its retries on every lookup."""
        return time.time() - self.ttl + min(self.ttl, OUTAGE_RETRY)

    def _unsettled(self, path: str) -> bool:
        """A replayed record's directory not yet listed from the store (its saved listing may
        predate what the replay published)."""
        return path in self._replayed and path not in self._relisted

    # ---- listings ----------------------------------------------------------------------------
    def cached(self, path: str) -> DirState | None:
        """The listing of ``path`` held in memory, fresh or not."""
        return self._dirs.get(path)

    def fresh(self, path: str) -> DirState | None:
        """The listing of ``path`` if it can be answered from now, with no wait (else None)."""
        state = self._dirs.get(path)
        if state is None or not self.is_fresh(state.listed_at) or self._unsettled(path):
            return None
        return state

    async def state(self, path: str) -> DirState:
        """The listing of directory ``path``: from memory, from the snapshot, or listed now."""
        state = self._dirs.get(path)
        if state is not None and self.is_fresh(state.listed_at):
            return state
        if state is None and self.snapshot is not None:
            saved = self.snapshot.load(dir_prefix(path))
            if saved is not None:
                state = self._dirs[path] = DirState.from_listing(saved[1], saved[0])
                self.listed(path, state, False)
                if self.is_fresh(state.listed_at) and not self._unsettled(path):
                    return state
        return await self._flights.do(path, lambda: self._relist(path, state))

    async def _relist(self, path: str, stale: DirState | None) -> DirState:
        prefix = dir_prefix(path)
        started = time.time()
        try:
            listing = await trio.to_thread.run_sync(self.source.list_dir, prefix, limiter=self.limiter)
        except StoreError as exc:
            if stale is None:
                raise
            log.info("listing %r failed (%s); serving the previous listing", prefix, exc)
            stale.listed_at = self.retry_stamp()
            return stale
        state = self._dirs[path] = DirState.from_listing(listing, started)
        if self.snapshot is not None:
            self.snapshot.save(prefix, listing, started)
        if path in self._replayed:
            self._relisted.add(path)
        self.listed(path, state, True)
        return state

    def install(self, path: str, listing: Listing, listed_at: float) -> bool:
        """A directory's listing found ahead (``listahead.py``): taken unless it has one already."""
        if path in self._dirs or self._unsettled(path) or self._flights.in_flight(path):
            return False
        state = self._dirs[path] = DirState.from_listing(listing, listed_at)
        self.saved.save(dir_prefix(path), listing, listed_at)
        self.listed(path, state, False)
        return True

    def drop(self, paths: set[str]) -> None:
        """Forget these listings (the next lookup lists them again)."""
        self._dirs = {path: state for path, state in self._dirs.items() if path not in paths}

    def adopt_tree(self, path: str, infos: list[ObjectInfo], listed_at: float) -> None:
        """Take a recursive listing (every object below directory ``path``, as ``list_all``
        returns it) as the listing of ``path`` and of each directory under it, in memory and
        in the snapshot: reading the tree then issues no LIST until the TTL runs out."""
        prefix = dir_prefix(path)
        listings: dict[str, Listing] = {path: Listing()}
        for info in infos:
            parent = path
            for name in info.path[len(prefix):].split("/")[:-1]:
                child = join(parent, name)
                if child not in listings:
                    listings[child] = Listing()
                    listings[parent].dirs.append(name)
                parent = child
            listings[parent].files.append(info)
        for dir_path, listing in listings.items():
            state = self._dirs[dir_path] = DirState.from_listing(listing, listed_at)
            if self.snapshot is not None:
                self.snapshot.save(dir_prefix(dir_path), listing, listed_at)
            self.listed(dir_path, state, True)

    # ---- single entries ----------------------------------------------------------------------
    def set_file(self, path: str, info: ObjectInfo | None) -> None:
        """Show (``info``) or hide (None) a file in its parent's cached listing."""
        parent, name = split(path)
        state = self._dirs.get(parent)
        if state is not None:
            if info is None:
                state.files.pop(name, None)
            else:
                state.files[name] = info

    def set_dir(self, path: str, present: bool) -> None:
        parent, name = split(path)
        state = self._dirs.get(parent)
        if state is not None:
            (state.dirs.add if present else state.dirs.discard)(name)
        if present:
            self._dirs[path] = DirState(time.time(), {}, set())
        else:
            self._dirs.pop(path, None)

    def publish(self, info: ObjectInfo) -> None:
        """A newer version seen by a HEAD: the parent's cached listing and the snapshot show it,
        so a later lookup from an older listing never reverts a node to the old version."""
        self.set_file(info.path, info)
        if self.snapshot is not None:
            self.snapshot.update_file(info)

    def adopt_file(self, info: ObjectInfo) -> None:
        """A newer version of a file (a warmup's HEAD after a 412): shown from now on, by the
        listing and by the namespace's node of it."""
        self.versioned(info)
        self.publish(info)

    def close(self) -> None:
        if self.snapshot is not None:
            self.snapshot.close()
