"""Directory listings persisted in the cache dir, so a remount does not relist.

One SQLite file per store identity under ``CACHE_DIR/meta/``. A directory row
records when it was listed; its entries are the children the store returned.
Touched only from the trio thread (a listing is rare next to reads).
"""

import hashlib
import logging
import sqlite3
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
        self._db = self._open()

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

    def load(self, dir_path: str) -> tuple[float, Listing] | None:
        """The stored listing of ``dir_path`` ("" or ending in "/") and when it was made."""
        try:
            row = self._db.execute("SELECT listed_at FROM dirs WHERE path = ?", (dir_path,)).fetchone()
            if row is None:
                return None
            listing = Listing()
            rows = self._db.execute(
                "SELECT name, is_dir, size, mtime, etag FROM entries WHERE dir = ?", (dir_path,))
            for name, is_dir, size, mtime, etag in rows:
                if is_dir:
                    listing.dirs.append(name)
                else:
                    listing.files.append(ObjectInfo(dir_path + name, size, mtime, etag))
            return row[0], listing
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

    def close(self) -> None:
        self._db.close()

