"""Directory listings persisted in the cache dir, so a remount does not relist.

One SQLite file per store identity under ``CACHE_DIR/meta/``. A directory row
records when it was listed; its entries are the children the store returned.
Touched only from the trio thread (a listing is rare next to reads).
"""

import contextlib
import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from cachefs.store import Listing, ObjectInfo

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dirs (path TEXT PRIMARY KEY, listed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    dir TEXT NOT NULL, name TEXT NOT NULL, is_dir INTEGER NOT NULL,
    size INTEGER NOT NULL, mtime REAL NOT NULL, etag TEXT NOT NULL,
    PRIMARY KEY (dir, name)) WITHOUT ROWID;
"""


class ListingSnapshot:
    def __init__(self, cache_dir: str, store_identity: str) -> None:
        meta = Path(cache_dir) / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        name = hashlib.blake2b(store_identity.encode(), digest_size=12).hexdigest()
        self.path = meta / f"listing-{name}.sqlite"
        self._unlinked = False
        # the mount's own changes of late, per saved directory: (when, sql, args), laid again over a
        # listing that began before them (``save``)
        self._recent: dict[str, list[tuple[float, str, tuple]]] = {}
        self._db: sqlite3.Connection | None = None
        try:
            self._db = self._open()
        except sqlite3.Error as exc:    # a full cache filesystem: this run's listings in memory
            self._discard(f"cannot be opened: {exc}")

    def _open(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            return db
        except sqlite3.DatabaseError as exc:
            # A corrupt snapshot is only a cache: start over rather than fail the mount.
            log.info("listing snapshot %s unreadable (%s); starting a new one", self.path, exc)
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None)
            db.executescript(_SCHEMA)
            return db

    def listed_at(self, dir_path: str) -> float | None:
        """When the stored listing of ``dir_path`` was made (None: none stored), without reading it."""
        try:
            row = self._db.execute("SELECT listed_at FROM dirs WHERE path = ?", (dir_path,)).fetchone()
        except sqlite3.DatabaseError as exc:
            log.info("listing snapshot read failed for %r: %s", dir_path, exc)
            return None
        return row[0] if row is not None else None

    def load(self, dir_path: str) -> tuple[float, Listing] | None:
        """The stored listing of ``dir_path`` ("" or ending in "/") and when it was made."""
        listed_at = self.listed_at(dir_path)
        if listed_at is None:
            return None
        try:
            listing = Listing()
            rows = self._db.execute(
                "SELECT name, is_dir, size, mtime, etag FROM entries WHERE dir = ?", (dir_path,))
            for name, is_dir, size, mtime, etag in rows:
                if is_dir:
                    listing.dirs.append(name)
                else:
                    listing.files.append(ObjectInfo(dir_path + name, size, mtime, etag))
            return listed_at, listing
        except sqlite3.DatabaseError as exc:
            log.info("listing snapshot read failed for %r: %s", dir_path, exc)
            return None

    def save(self, dir_path: str, listing: Listing, listed_at: float) -> None:
        rows = [(dir_path, name, 1, 0, 0.0, "") for name in listing.dirs]
        rows += [(dir_path, info.path.rsplit("/", 1)[-1], 0, info.size, info.mtime, info.etag)
                 for info in listing.files]
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM entries WHERE dir = ?", (dir_path,))
                self._db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)", rows)
                self._db.execute("INSERT OR REPLACE INTO dirs VALUES (?, ?)", (dir_path, listed_at))
                # A LIST that began before one of the mount's own changes may not show it (an upload
                # that ended meanwhile, a delete): the change is laid again over what it saved, or a
                # remount would hide the upload or bring the deleted file back.
                for when, sql, args in self._recent.get(dir_path, ()):
                    if when >= listed_at - _CHANGE_SLACK:
                        self._db.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            log.info("listing snapshot write failed for %r: %s", dir_path, exc)

    def update_file(self, info: ObjectInfo) -> None:
        """Record a revalidated object (after a HEAD)."""
        dir_path, _, name = info.path.rpartition("/")
        dir_path = dir_path + "/" if dir_path else ""
        try:
            self._db.execute("UPDATE entries SET size = ?, mtime = ?, etag = ? WHERE dir = ? AND name = ?",
                             (info.size, info.mtime, info.etag, dir_path, name))
        except sqlite3.DatabaseError as exc:
            log.info("listing snapshot update failed for %r: %s", info.path, exc)

    # ---- the mount's own changes (bug 1 in docs/reliability.md) --------------------------------
    # A saved listing must show what this mount itself did in the bucket, or a remount within
    # the TTL hides it. Rows change only in directories already saved (no listing, no rows).
    def file_changed(self, path: str, info: ObjectInfo | None) -> None:
        """The mount made the object ``path`` (``info``: uploaded or copied) or deleted it (None,
        once the tombstone is journaled)."""
        dir_path, name = _parent(path)
        if info is None:
            self._own_change(dir_path, "DELETE FROM entries WHERE dir = ? AND name = ?", (dir_path, name))
        else:
            self._own_change(dir_path, "INSERT OR REPLACE INTO entries SELECT ?, ?, 0, ?, ?, ? WHERE EXISTS "
                             "(SELECT 1 FROM dirs WHERE path = ?)",
                             (dir_path, name, info.size, info.mtime, info.etag, dir_path))

    def dir_changed(self, path: str, present: bool) -> None:
        """The mount made (journaled) the directory ``path`` or removed it (with its listing)."""
        dir_path, name = _parent(path)
        if present:
            self._own_change(dir_path, "INSERT OR REPLACE INTO entries SELECT ?, ?, 1, 0, 0.0, '' WHERE EXISTS "
                             "(SELECT 1 FROM dirs WHERE path = ?)", (dir_path, name, dir_path))
            return
        self._own_change(dir_path, "DELETE FROM entries WHERE dir = ? AND name = ?", (dir_path, name))
        self._change("DELETE FROM entries WHERE dir = ?", (path + "/",))
        self._change("DELETE FROM dirs WHERE path = ?", (path + "/",))

    @contextlib.contextmanager
    def stale_while(self, path: str) -> Iterator[None]:
        """The saved listing of directory ``path`` reads as stale (listed at 0) inside the block:
        a change no journal record covers (a rename's server-side copy) cannot be hidden by a
        SIGKILL before the block tells the snapshot about it."""
        dir_path = path + "/" if path else ""
        row = self._query("SELECT listed_at FROM dirs WHERE path = ?", (dir_path,))
        if row is not None:
            self._change("UPDATE dirs SET listed_at = 0 WHERE path = ?", (dir_path,))
        try:
            yield
        finally:
            if row is not None:
                self._change("UPDATE dirs SET listed_at = ? WHERE path = ?", (row[0], dir_path))

    def sync(self) -> None:
        """Make every change so far durable (fsync the WAL and the database file). Blocking, for a
        worker thread: the write-back calls it before removing the journal record that covers a
        change, so a power cut or a cache dir failing under us (whose unsynced pages are lost)
        cannot roll the snapshot back to before a change no record covers any more."""
        for suffix in ("-wal", ""):
            try:
                fd = os.open(f"{self.path}{suffix}", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if self._unlinked:              # a dropped snapshot stays dropped after a power cut
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._unlinked = False

    def _own_change(self, dir_path: str, sql: str, args: tuple) -> None:
        """``_change``, remembered for a while as a change of ``dir_path``'s entries (``save``)."""
        now = time.time()
        recent = self._recent.setdefault(dir_path, [])
        recent.append((now, sql, args))
        if len(recent) > _CHANGES_KEPT or recent[0][0] < now - _CHANGE_MEMORY:
            recent[:] = [change for change in recent if change[0] >= now - _CHANGE_MEMORY][-_CHANGES_KEPT:]
        self._change(sql, args)

    def _change(self, sql: str, args: tuple) -> None:
        try:
            self._db.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            self._discard(f"update failed ({args[:2]}): {exc}")

    def _discard(self, why: str) -> None:
        """A change of the mount's own the snapshot could not record (a full or failing cache disk):
        the saved listings must not outlive this run, or a remount would show a directory as it was
        before the change. Their files are unlinked (that needs no free space; ``sync`` makes it
        durable before the record covering the change goes) and an empty snapshot takes over."""
        log.info("listing snapshot %s dropped: %s", self.path, why)
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        self._unlinked = True
        try:
            self._db = self._open()
        except sqlite3.Error:           # no room for a new file: keep this run's listings in memory
            self._db = sqlite3.connect(":memory:", isolation_level=None)
            self._db.executescript(_SCHEMA)

    def _query(self, sql: str, args: tuple):
        try:
            return self._db.execute(sql, args).fetchone()
        except sqlite3.DatabaseError as exc:
            log.info("listing snapshot read failed (%s): %s", args[:1], exc)
            return None

    def close(self) -> None:
        self._db.close()


_CHANGE_SLACK = 1.0       # seconds: a change this much before a LIST began is laid over it too
_CHANGE_MEMORY = 600.0    # seconds a change is remembered for listings that began before it
_CHANGES_KEPT = 4096      # changes remembered per directory at most


def _parent(path: str) -> tuple[str, str]:
    """(the saved directory key, "" or ending in "/"; the name) of ``path``."""
    dir_path, _, name = path.rpartition("/")
    return (dir_path + "/" if dir_path else ""), name


class NoSnapshot:
    """No saved listings (a Vfs built without a snapshot): the mount's changes go nowhere."""

    def save(self, dir_path: str, listing: Listing, listed_at: float) -> None:
        pass

    def file_changed(self, path: str, info: ObjectInfo | None) -> None:
        pass

    def dir_changed(self, path: str, present: bool) -> None:
        pass

    def sync(self) -> None:
        pass

    @contextlib.contextmanager
    def stale_while(self, path: str) -> Iterator[None]:
        yield
