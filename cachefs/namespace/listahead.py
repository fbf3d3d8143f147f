"""Listing ahead: at mount, one recursive listing of the prefix (1,000 keys a page) gives every
directory under it its listing, so the first lookup in each folder finds it listed instead of
waiting for a LIST of its own. A training set of 100 class folders costs 100 such LISTs, each on
some reader's critical path; here they become a few pages fetched in the background while the
first reads run. rclone's ``--fast-list`` trades the same way (one recursive listing for many
per-directory ones).

A directory is handed to the vfs as soon as the listing has passed it (keys come sorted, so the
keys of one directory are contiguous), and the vfs takes it only if nothing listed it meanwhile.
Bounded by ``--list-ahead`` objects: past that the directories still open are left to their own
LISTs. A listing that fails (or a server whose keys come out of order) drops what it installed.
"""

import logging
import threading
import time

import trio

from cachefs.errors import StoreError
from cachefs.namespace.vfs import Vfs
from cachefs.store import Listing, ObjectStore

log = logging.getLogger(__name__)


async def list_ahead(vfs: Vfs, store: ObjectStore, limit: int) -> None:
    """List the whole mount in the background; returns when done, failed or cancelled."""
    saved = vfs.snapshot.load("") if vfs.snapshot is not None else None
    if saved is not None and vfs.is_fresh(saved[0]):
        return                        # a remount within the TTL: the listings were saved
    started = time.time()
    installed: list[str] = []
    stop = threading.Event()

    def install(prefix: str, listing: Listing) -> None:         # in the trio thread
        path = prefix[:-1]                                        # "a/b/" -> "a/b", "" -> ""
        if vfs.install_listing(path, listing, started):
            installed.append(path)

    def walk() -> int:
        dirs = 0
        for prefix, listing in store.list_tree("", limit):
            if stop.is_set():
                break
            trio.from_thread.run_sync(install, prefix, listing)
            dirs += 1
        return dirs

    try:
        dirs = await trio.to_thread.run_sync(walk, abandon_on_cancel=True)
    except StoreError as exc:
        log.info("listing ahead failed (%s); each folder is listed on its first lookup", exc)
        vfs.drop_listings(set(installed))
        return
    finally:
        stop.set()
    log.info("listed ahead: %d folders in %.2f s (%d taken)", dirs, time.time() - started, len(installed))
