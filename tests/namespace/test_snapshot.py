"""The listing snapshot and the mount's own changes on a failing cache disk: a change it cannot
record drops the saved listings for good, so a remount never shows a directory as it was before
the change (the crash campaign saw a deleted log come back for the metadata TTL)."""

import sqlite3

from cachefs.namespace.snapshot import ListingSnapshot
from cachefs.store import Listing, ObjectInfo

IDENTITY = "s3://bucket/prefix@endpoint"


class FullDisk:
    """A connection whose writes fail as SQLite's do on a full disk; reads pass."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, args=()):
        if not sql.lstrip().upper().startswith("SELECT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, args)

    def close(self) -> None:
        self.db.close()


def saved_logs(cache_dir) -> ListingSnapshot:
    snapshot = ListingSnapshot(str(cache_dir), IDENTITY)
    listing = Listing()
    listing.files.append(ObjectInfo("logs/L3.log", 10, 1.0, "etag-1"))
    snapshot.save("logs/", listing, listed_at=100.0)
    snapshot.sync()
    return snapshot


def names(snapshot: ListingSnapshot, dir_path: str) -> list[str] | None:
    saved = snapshot.load(dir_path)
    return None if saved is None else sorted(info.path for info in saved[1].files)


def test_a_recorded_delete_survives_a_reopen(tmp_path):
    snapshot = saved_logs(tmp_path)
    snapshot.file_changed("logs/L3.log", None)
    snapshot.sync()
    snapshot.close()
    assert names(ListingSnapshot(str(tmp_path), IDENTITY), "logs/") == []


def test_a_delete_the_full_disk_refused_drops_the_saved_listings(tmp_path):
    snapshot = saved_logs(tmp_path)
    snapshot._db = FullDisk(snapshot._db)
    snapshot.file_changed("logs/L3.log", None)       # the row could not be removed
    snapshot.sync()                                  # the barrier before the journal record goes
    assert names(snapshot, "logs/") is None          # this run relists too
    reopened = ListingSnapshot(str(tmp_path), IDENTITY)
    assert names(reopened, "logs/") is None          # never the listing from before the delete


def test_with_no_room_for_a_new_file_the_snapshot_lives_in_memory(tmp_path, monkeypatch):
    snapshot = saved_logs(tmp_path)
    snapshot._db = FullDisk(snapshot._db)

    def no_room(self):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ListingSnapshot, "_open", no_room)
    snapshot.file_changed("logs/L3.log", None)
    assert not snapshot.path.exists()
    listing = Listing()
    listing.files.append(ObjectInfo("logs/L4.log", 1, 1.0, "etag-4"))
    snapshot.save("logs/", listing, listed_at=200.0)
    assert names(snapshot, "logs/") == ["logs/L4.log"]
    snapshot.sync()


def test_listed_at_says_when_a_listing_was_saved_without_reading_it(tmp_path):
    snapshot = saved_logs(tmp_path)
    assert snapshot.listed_at("logs/") == 100.0
    assert snapshot.listed_at("") is None and snapshot.listed_at("other/") is None
    snapshot._db.close()                              # a broken database: no timestamp, no traceback
    assert snapshot.listed_at("logs/") is None


def test_a_listing_that_began_before_the_mounts_own_change_does_not_undo_it(tmp_path):
    """A LIST that started before an upload ended (or a delete) is saved after it: the change is
    laid over it again, so a remount neither hides the upload nor brings the deleted file back
    (seen once as ENOENT for an uploaded file after a CSI volume's processes were killed)."""
    import time
    snapshot = saved_logs(tmp_path)
    began = time.time()
    snapshot.file_changed("logs/new.log", ObjectInfo("logs/new.log", 5, 2.0, "etag-new"))
    snapshot.file_changed("logs/L3.log", None)
    stale = Listing()                                  # what the LIST saw: L3 still there, new.log not yet
    stale.files.append(ObjectInfo("logs/L3.log", 10, 1.0, "etag-1"))
    snapshot.save("logs/", stale, listed_at=began)
    assert names(snapshot, "logs/") == ["logs/new.log"]
    later = Listing()                                  # a LIST that began after both: taken as it is
    later.files.append(ObjectInfo("logs/other.log", 3, 3.0, "etag-o"))
    snapshot.save("logs/", later, listed_at=time.time() + 5)
    assert names(snapshot, "logs/") == ["logs/other.log"]
