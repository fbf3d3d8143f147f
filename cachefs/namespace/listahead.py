"""Listing ahead: at mount, one recursive listing of the prefix (1,000 keys a page) gives every
directory under it its listing, so the first lookup in each folder finds it listed instead of
waiting for a LIST of its own. A training set of 100 class folders costs 100 such LISTs, each on
some reader's critical path; here they become a few pages fetched in the background while the
first reads run. rclone's ``--fast-list`` trades the same way (one recursive listing for many
per-directory ones).

A directory is handed to the catalog as soon as the listing has passed it (keys come sorted, so
the keys of one directory are contiguous), which takes it only if nothing listed it meanwhile.
Bounded by ``--list-ahead`` objects: past that the directories still open are left to their own
LISTs. A listing that fails (or a server whose keys come out of order) drops what it installed.
"""

import logging
import threading
import time

import trio

from cachefs.errors import StoreError
from cachefs.namespace.catalog import Catalog
from cachefs.store import Listing, ObjectStore

log = logging.getLogger(__name__)


class ListAhead:
    """The listing ahead of one mount, and what ``cachefs status`` says of it."""

    def __init__(self, catalog: Catalog, store: ObjectStore, limit: int) -> None:
        self.catalog, self.store, self.limit = catalog, store, limit
        self.state = "waiting"       # -> running -> done | stopped at the limit | failed; or skipped
        self.folders = 0             # complete folders the listing gave
        self.taken: list[str] = []   # ... that the catalog took (no listing of its own yet)
        self.seconds = 0.0

    def status(self) -> dict:
        return {"state": self.state, "folders": self.folders, "taken": len(self.taken),
                "limit": self.limit, "seconds": round(self.seconds, 2)}

    async def run(self) -> None:
        """List the whole mount in the background; returns when done, failed or cancelled."""
        catalog = self.catalog
        saved_at = catalog.snapshot.listed_at("") if catalog.snapshot is not None else None
        if saved_at is not None and catalog.is_fresh(saved_at):
            self.state = "skipped"           # a remount within the TTL: the listings were saved
            return
        self.state, started, stop = "running", time.time(), threading.Event()

        def install(prefix: str, listing: Listing) -> None:         # in the trio thread
            self.folders += 1
            path = prefix[:-1]                                        # "a/b/" -> "a/b", "" -> ""
            if catalog.install(path, listing, started):
                self.taken.append(path)

        def walk() -> bool:
            """True when the listing stopped at the limit."""
            tree = self.store.list_tree("", self.limit)
            while not stop.is_set():
                try:
                    prefix, listing = next(tree)
                except StopIteration as end:
                    return bool(end.value)
                trio.from_thread.run_sync(install, prefix, listing)
            return False

        try:
            truncated = await trio.to_thread.run_sync(walk, abandon_on_cancel=True)
        except StoreError as exc:
            self.state = "failed"
            log.info("listing ahead failed (%s); each folder is listed on its first lookup", exc)
            catalog.drop(set(self.taken))
            self.taken.clear()
            return
        finally:
            stop.set()
            self.seconds = time.time() - started
        self.state = "stopped at the limit" if truncated else "done"
        log.info("listed ahead: %d folders in %.2f s (%d taken)%s", self.folders, self.seconds, len(self.taken),
                 f"; stopped at --list-ahead {self.limit} objects" if truncated else "")
