"""The write-back journal: staging files and the records that name them (docs/design.md, invariant 5).

On-disk format (``STAGING = CACHE_DIR/staging`` unless ``staging_dir`` says otherwise)::

    STAGING/data/<id>            a staged file's whole content, written in place by the daemon
    STAGING/records/<id>.json    one record, {"v": 1, "id", "seq", "kind", "path", "created"} and,
                                 for a ``file``, "sealed": the bytes of ``data/<id>`` known durable
    STAGING/run.json             the boot and mount instance of the staging filesystem the last
                                 daemon ran on (``run_identity``)
    STAGING/lost+found/          staging files a start could not trust, kept for a human
    STAGING/records/*.tmp        a record being written (deleted at start)
    STAGING/uploads/<id>.json    an open multipart upload, {"v": 1, "path", "upload_id"}: written
                                 before its first part, removed once it is completed or aborted

``id`` and ``seq`` are 16 hex digits from one counter (the largest seen + 1 at start). ``kind``:

- ``file``: the object ``path`` must end up holding ``data/<id>``;
- ``delete``: the object ``path`` must be deleted (a tombstone);
- ``mkdir`` / ``rmdir``: the directory marker ``path/`` must exist / must not.

A record is the truth; a data file without a record is garbage. Records are written
atomically: temporary name, fsync, rename, fsync of the directory. ``seq`` orders records
of one path: the record with the largest ``seq`` wins (``file`` and ``delete`` compete for a
path; ``mkdir`` and ``rmdir`` for a directory).

Who writes what, in order, and the crash state each step can leave (repair at the next start):

1. Create (or copy-up of an existing object): create ``data/<id>``, fill it (copy-up), then write
   the ``file`` record. Crash before the record: an orphan data file, deleted (the create or
   open never returned, so nothing was acknowledged).
2. Writes go to the data file with ``pwrite``; ``fsync`` of the file fsyncs it and its record
   (local durability). A SIGKILL loses nothing written (the page cache survives); a power cut
   loses what was written after the last fsync, as on a local disk.
   ``sealed`` (the size at the last fsync, or of a fsynced copy-up) is rewritten after each fsync
   that changed the size, and lowered *before* a truncate below it. After an unclean stop that may
   have dropped unsynced pages (another boot, or the staging filesystem mounted again: an ext4
   emergency read-only, a power cut), replay trusts only ``[0, sealed)``: a longer staging file is
   copied to ``lost+found/`` and cut back to ``sealed``, a shorter one (fsynced data gone) is kept
   there and its record dropped; after a plain SIGKILL (same boot, same mount: the page cache
   survived) the whole file is what was written and is uploaded as is. "Same mount" is statx's
   STATX_MNT_ID_UNIQUE (Linux 6.8+); where the kernel lacks it every start trusts the page cache.
   One exception: a SIGKILL can stop a ``pwrite`` part way (the kernel copies page by page and
   gives up at a fatal signal), leaving the front half of a log record that was never answered.
   So a write that grows a file is *marked* first (``write_data``: the staging id and its size
   before the write, in the memory-mapped file ``extending``, then an armed word), and unmarked
   once whole, before the answer goes back. A trusted replay cuts a file still marked back to its
   size before the write; the kernel sends the write again to the next daemon, or its caller got
   an error. An untrusted one ignores the mark (the cut to ``sealed`` covers it).
3. Rename: the record is rewritten with the new path and a new ``seq``, then a ``delete`` record
   is written for the old path if an object may exist there. Crash in between: the old object
   stays until the user deletes it (no data loss).
4. Unlink: a ``delete`` record (when an object may exist), then the ``file`` record and the data
   file are removed. Crash in between: two records for one path, the newer ``delete`` wins.
5. Upload done (the object is complete and verified in the store): the ``file`` record is
   removed, then the data file. Crash in between: an orphan data file, deleted; crash before:
   the same content is uploaded again (idempotent).
6. Superseded records (an older ``seq`` for the same path) are removed with their data at start.
7. Multipart upload: the upload id is noted (``note_upload``) before the first part is sent and
   the note removed after the completion or abort. Crash in between: the next start aborts
   every noted upload (``open_uploads``; an abort of a completed or already aborted upload is a
   no-op), so no upload stays open (and billed) in the bucket. Crash between the store creating
   the upload and the note: the one window left, for a bucket lifecycle rule to close.

At start ``replay`` applies these repairs and returns the surviving records; the write-back
engine re-queues every one of them. The journal itself holds no in-memory state beyond
the counter: the engine (one trio thread) owns the index and calls these blocking
functions from worker threads.
"""

import contextlib
import ctypes
import json
import logging
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass, replace

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE, DELETE, MKDIR, RMDIR = "file", "delete", "mkdir", "rmdir"
_KINDS = (FILE, DELETE, MKDIR, RMDIR)
_HEX = re.compile(r"[0-9a-f]{16}")
_STATX_MNT_ID_UNIQUE = 0x4000
_MARK = struct.Struct("<8sQQ")            # magic, staging id, its size before the write under way
_ARMED = struct.Struct("<Q")              # after it: 1 while that write is under way
_MARK_MAGIC = b"CFSEXT01"


@dataclass(slots=True)
class Record:
    id: int
    seq: int
    kind: str
    path: str
    created: float
    sealed: int | None = None     # a file's bytes known durable (None: a record of an older version)

    def to_json(self) -> bytes:
        data = asdict(self)
        data["id"], data["seq"] = f"{self.id:016x}", f"{self.seq:016x}"
        if self.sealed is None:
            del data["sealed"]
        return json.dumps({"v": FORMAT_VERSION, **data}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Record":
        """Parse a record; ValueError for anything but a well-formed one (UnicodeDecodeError and
        JSONDecodeError are ValueErrors too)."""
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION or data.get("kind") not in _KINDS:
            raise ValueError(f"unknown record format: {raw[:200]!r}")
        ident, seq, path, created = data.get("id"), data.get("seq"), data.get("path"), data.get("created")
        if not (isinstance(ident, str) and isinstance(seq, str) and _valid_path(path)
                and isinstance(created, int | float) and not isinstance(created, bool)):
            raise ValueError(f"malformed record: {raw[:200]!r}")
        sealed = data.get("sealed")
        if sealed is not None and not (type(sealed) is int and sealed >= 0):
            raise ValueError(f"malformed record: {raw[:200]!r}")
        return cls(id=_hex(ident), seq=_hex(seq), kind=data["kind"], path=path, created=float(created),
                   sealed=sealed)

    @property
    def slot(self) -> tuple[bool, str]:
        """What records compete for: (is a directory, path)."""
        return self.kind in (MKDIR, RMDIR), self.path


def _unique_mount_id(path: str) -> int | None:
    """statx's STATX_MNT_ID_UNIQUE (Linux 6.8+): never reused within a boot, unlike mountinfo's."""
    buf = ctypes.create_string_buffer(256)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statx(-100, os.fsencode(path), 0, _STATX_MNT_ID_UNIQUE, buf) != 0:
            return None
    except (AttributeError, OSError):
        return None
    mask, = struct.unpack_from("<I", buf, 0)
    return struct.unpack_from("<Q", buf, 144)[0] if mask & _STATX_MNT_ID_UNIQUE else None


def _hex(text: str) -> int:
    if not _HEX.fullmatch(text):
        raise ValueError(f"not 16 hex digits: {text!r}")
    return int(text, 16)


def _valid_path(path: object) -> bool:
    """An object key relative to the mount's prefix: a non-empty string, no empty, "." or ".."
    component, no NUL."""
    return (isinstance(path, str) and path != "" and "\0" not in path
            and all(part not in ("", ".", "..") for part in path.split("/")))


class Journal:
    """The staging directory. Every method but ``next_seq`` and ``data_path`` may block."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self.data_dir = os.path.join(root, "data")
        self.records_dir = os.path.join(root, "records")
        self.uploads_dir = os.path.join(root, "uploads")
        for path in (self.data_dir, self.records_dir, self.uploads_dir):
            os.makedirs(path, exist_ok=True)
        self._counter = 0
        self.lost_found = 0           # staging files kept aside by replay (not trusted)
        self.cut_back = 0             # staging files replay cut back to before a write never finished
        self._mark = self._open_mark()

    def next_seq(self) -> int:
        self._counter += 1
        return self._counter

    def data_path(self, ident: int) -> str:
        return os.path.join(self.data_dir, f"{ident:016x}")

    def _record_path(self, ident: int) -> str:
        return os.path.join(self.records_dir, f"{ident:016x}.json")

    # ---- data files --------------------------------------------------------------------------
    def create_data(self, ident: int) -> int:
        """A new, empty staging file opened read-write; returns its descriptor."""
        return os.open(self.data_path(ident), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def remove_data(self, ident: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.data_path(ident))

    def write_data(self, ident: int, fd: int, data: bytes, offset: int, size: int) -> None:
        """``pwrite_whole`` to staging file ``ident`` (``size`` bytes long); a write that grows it
        is marked as under way while it runs (step 2). One at a time: the engine's thread."""
        mark = self._mark if offset + len(data) > size else None
        if mark is not None:
            _MARK.pack_into(mark, 0, _MARK_MAGIC, ident, size)
            _ARMED.pack_into(mark, _MARK.size, 1)
        try:
            pwrite_whole(fd, data, offset, size)
        finally:
            if mark is not None:
                _ARMED.pack_into(mark, _MARK.size, 0)

    def _open_mark(self) -> mmap.mmap | None:
        path = os.path.join(self.root, "extending")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size < mmap.PAGESIZE:
                    os.ftruncate(fd, mmap.PAGESIZE)
                return mmap.mmap(fd, mmap.PAGESIZE)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            log.warning("journal: cannot map %s (%s): a daemon killed as it writes may leave part of "
                        "that write staged", path, exc)
            return None

    def _unfinished_write(self) -> tuple[int, int] | None:
        """(staging id, size before) of a write the last daemon marked and never finished; the
        mark is cleared."""
        mark = self._mark
        if mark is None:
            return None
        magic, ident, size = _MARK.unpack_from(mark, 0)
        armed = _ARMED.unpack_from(mark, _MARK.size)[0]
        _ARMED.pack_into(mark, _MARK.size, 0)
        return (ident, size) if magic == _MARK_MAGIC and armed else None

    def _cut_back(self, records: list[Record], unfinished: tuple[int, int]) -> None:
        ident, size = unfinished
        if not any(r.kind == FILE and r.id == ident for r in records):
            return
        path = self.data_path(ident)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            now = os.fstat(fd).st_size
            if now > size:
                log.info("journal: staging file %016x cut back from %d to %d bytes: the last daemon died as it "
                         "wrote there (the write was never answered)", ident, now, size)
                os.ftruncate(fd, size)
                self.cut_back += 1
        finally:
            os.close(fd)

    def sync_data(self, fd: int) -> None:
        os.fsync(fd)

    def seal(self, fd: int, record: Record) -> Record:
        """fsync a staging file and journal it sealed whole (a clean stop); returns the record."""
        self.sync_data(fd)
        size = os.fstat(fd).st_size
        if record.sealed != size:
            record = replace(record, sealed=size)
            self.write_record(record)
        return record

    # ---- records -----------------------------------------------------------------------------
    def write_record(self, record: Record) -> None:
        """Atomically create or replace ``record`` (temp, fsync, rename, directory fsync)."""
        self._write_atomic(self._record_path(record.id), f"{record.seq:x}", record.to_json())

    def _write_atomic(self, final: str, tag: str, data: bytes) -> None:
        temp = f"{final}.{tag}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, final)
        self._sync_dir(os.path.dirname(final))

    def remove_record(self, ident: int) -> None:
        self._remove(self._record_path(ident))

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self._sync_dir(os.path.dirname(path))

    # ---- open multipart uploads (step 7) ---------------------------------------------------------
    def _upload_path(self, ident: int) -> str:
        return os.path.join(self.uploads_dir, f"{ident:016x}.json")

    def note_upload(self, ident: int, path: str, upload_id: str) -> None:
        """Durably note that multipart upload ``upload_id`` of ``path`` is open."""
        data = json.dumps({"v": FORMAT_VERSION, "path": path, "upload_id": upload_id}).encode()
        self._write_atomic(self._upload_path(ident), "0", data)

    def clear_upload(self, ident: int) -> None:
        self._remove(self._upload_path(ident))

    def open_uploads(self) -> list[tuple[int, str, str]]:
        """(id, path, upload id) of every upload noted and never cleared (a crash left it open);
        sets the counter past their ids. Unreadable notes are kept aside like records."""
        found = []
        for name in sorted(os.listdir(self.uploads_dir)):
            full = os.path.join(self.uploads_dir, name)
            if name.endswith(".tmp"):
                os.unlink(full)           # never noted, so never sent a part: the upload id is unknown
                continue
            if not (name.endswith(".json") and _HEX.fullmatch(name[:-5])):
                continue
            try:
                with open(full, "rb") as fh:
                    data = json.loads(fh.read())
                if not (isinstance(data, dict) and data.get("v") == FORMAT_VERSION and _valid_path(data.get("path"))
                        and isinstance(data.get("upload_id"), str) and data["upload_id"]):
                    raise ValueError(f"malformed upload note: {data!r:.200}")
            except (OSError, ValueError) as exc:
                self._keep_aside(full, exc)
                continue
            ident = int(name[:-5], 16)
            self._counter = max(self._counter, ident)
            found.append((ident, data["path"], data["upload_id"]))
        return found

    def _sync_dir(self, path: str | None = None) -> None:
        if not self.fsync:
            return
        fd = os.open(path or self.records_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- start-up ------------------------------------------------------------------------------
    def replay(self, *, trusted: bool | None = None) -> list[Record]:
        """Repair the crash states listed in the module docstring; return the live records,
        oldest first. Sets the counter past every id and seq seen. ``trusted``: the page cache
        survived the last stop (else staging files are cut back to what was sealed, step 2);
        None: it did if the last daemon ran on this boot and mount (``same_run_identity``)."""
        if trusted is None:
            trusted = self.same_run_identity()
        unfinished = self._unfinished_write()
        records = self._read_records()
        winners: dict[tuple[bool, str], Record] = {}
        for record in sorted(records, key=lambda r: r.seq):
            loser = winners.get(record.slot)
            winners[record.slot] = record
            if loser is not None:
                log.info("journal: %s record of %r superseded by a newer %s record", loser.kind, loser.path,
                         record.kind)
                self._drop(loser)
        live = sorted(winners.values(), key=lambda r: r.seq)
        live = [r for r in live if r.kind != FILE or self._has_data(r)]
        if trusted and unfinished is not None:
            self._cut_back(live, unfinished)
        if not trusted:
            live = [r for r in live if r.kind != FILE or self._check_sealed(r)]
        self._remove_orphan_data({r.id for r in live if r.kind == FILE})
        return live

    def _read_records(self) -> list[Record]:
        records = []
        for name in os.listdir(self.records_dir):
            full = os.path.join(self.records_dir, name)
            if name.endswith(".tmp"):
                os.unlink(full)           # a record whose rename never happened: never acknowledged
                continue
            if not name.endswith(".json"):
                continue                  # e.g. a record kept aside (*.bad) by an earlier start
            try:
                with open(full, "rb") as fh:
                    record = Record.from_json(fh.read())
            except (OSError, ValueError) as exc:
                self._keep_aside(full, exc)
                continue
            self._counter = max(self._counter, record.id, record.seq)
            records.append(record)
        return records

    def _keep_aside(self, full: str, exc: Exception) -> None:
        """A record that cannot be read or makes no sense: renamed ``*.bad`` (not deleted: its
        data file is kept too, for a human), one warning line, never a traceback."""
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        log.warning("journal: unreadable file %s kept aside as %s.bad (%s)", full, os.path.basename(full), reason)
        try:
            os.rename(full, full + ".bad")
        except OSError as err:
            log.warning("journal: cannot rename %s aside: %s", full, err.strerror)

    def _has_data(self, record: Record) -> bool:
        if os.path.exists(self.data_path(record.id)):
            return True
        log.error("journal: record of %r has no staging file; dropped", record.path)
        self.remove_record(record.id)
        return False

    def _check_sealed(self, record: Record) -> bool:
        """After a stop that may have dropped unsynced pages: keep ``[0, sealed)`` of the staging
        file (what fsync made durable); anything else goes to ``lost+found/``. False: the record
        is dropped (its fsynced data is gone)."""
        if record.sealed is None:
            return True
        path = self.data_path(record.id)
        size = os.path.getsize(path)
        if size == record.sealed:
            return True
        self.lost_found += 1
        try:
            kept = self._keep_lost(path, record)
        except OSError as exc:      # the cut goes on: what is not sealed is never uploaded
            kept = f"nowhere (lost+found: {exc.strerror})"
        if size > record.sealed:
            log.warning("journal: %r was not fsynced since its last change (%d bytes, %d sealed) and the "
                        "staging filesystem lost its page cache since: the unsealed bytes are not uploaded; the "
                        "file is kept as %s", record.path, size, record.sealed, kept)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, record.sealed)
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        log.error("journal: %r holds %d bytes but %d were fsynced (the staging filesystem lost them); "
                  "not uploaded, kept as %s", record.path, size, record.sealed, kept)
        self.remove_record(record.id)
        return False

    def _keep_lost(self, path: str, record: Record) -> str:
        lost = os.path.join(self.root, "lost+found")
        os.makedirs(lost, exist_ok=True)
        kept = os.path.join(lost, f"{record.id:016x}-" + record.path.replace("/", "%2F")[-150:])
        with open(path, "rb") as src, open(kept, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)
            dst.flush()
            if self.fsync:
                os.fsync(dst.fileno())
        self._sync_dir(lost)
        return kept

    # ---- the run identity (is the page cache the last daemon wrote into still there?) -----------
    def run_identity(self) -> dict | None:
        """This boot and the mount instance of the staging filesystem (None: unknown)."""
        mount = _unique_mount_id(self.root)
        if mount is None:
            return None
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                boot = fh.read().strip()
        except OSError:
            return None
        return {"boot": boot, "mount": mount}

    def same_run_identity(self) -> bool:
        """Whether the last daemon ran on this boot and this mount of the staging filesystem (its
        unsynced pages are still in the page cache); then note this daemon's identity."""
        path = os.path.join(self.root, "run.json")
        now = self.run_identity()
        try:
            with open(path, "rb") as fh:
                before = json.loads(fh.read())
        except FileNotFoundError:
            before = None
        except (OSError, ValueError):
            before = {}
        if now is not None and before != now:
            try:
                self._write_atomic(path, "0", json.dumps(now).encode())
            except OSError as exc:
                log.warning("journal: cannot note this run in %s: %s", path, exc.strerror)
        return before is None or (now is not None and before == now)

    def _drop(self, record: Record) -> None:
        self.remove_record(record.id)
        if record.kind == FILE:
            self.remove_data(record.id)

    def _remove_orphan_data(self, live_ids: set[int]) -> None:
        kept_aside = self._kept_aside_ids()
        for name in os.listdir(self.data_dir):
            if not _HEX.fullmatch(name):
                continue
            full = os.path.join(self.data_dir, name)
            ident = int(name, 16)
            self._counter = max(self._counter, ident)
            if ident in live_ids or ident in kept_aside:
                continue
            if not os.path.isfile(full) or os.path.islink(full):
                log.warning("journal: %s is not a staging file; left alone", full)
                continue
            log.info("journal: removing unacknowledged staging file %s", name)
            os.unlink(full)

    def _kept_aside_ids(self) -> set[int]:
        """Ids of records kept aside (``*.json.bad``): their data files stay, like the records."""
        ids = set()
        for name in os.listdir(self.records_dir):
            if name.endswith(".json.bad") and _HEX.fullmatch(name[:16]):
                ids.add(int(name[:16], 16))
        return ids


def pwrite_whole(fd: int, data: bytes, offset: int, size: int) -> None:
    """All of ``data`` at ``offset`` or an error, never a short write: a failed write past ``size``
    (the file's length) is cut back to it, so no upload or replay sees part of one ``write()`` (a
    log record cut in two on a nearly full disk)."""
    try:
        pwrite_all(fd, data, offset)
    except OSError:
        if offset + len(data) > size:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        raise


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` (a nearly full disk writes short before it raises ENOSPC)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
