"""The ids the kernel holds, kept where the next daemon of a live mount finds them.

A mount outlives its daemon (``cachefs/keeper.py``): the kernel keeps every node id it was
given and sends them again to whichever process serves the connection next. So each id is
written down as it is handed out, in one append-only file in the cache dir, mapped in memory: a
record is two stores into the mapping, no system call (the page cache keeps it through a SIGKILL;
a machine that loses power loses the mount too). The file is allocated ahead (``fallocate``, so a
full disk fails the allocation, never a store into the mapping) and zero past the last record;
each record's kind byte is stored last, so one the daemon died storing reads as the end. Only new
and retired ids cost a record: a hot epoch that reuses its nodes writes nothing. File handles need
no record: each names its inode (``handles.make_fh``).

Records, little-endian, each a kind byte then its fields::

    N inode:u64 is_dir:u8 size:u64 mtime:f64 checked:f64 etag_len:u8 path_len:u16 etag path   a new node
    V inode:u64 size:u64 mtime:f64 checked:f64 etag_len:u8 etag   a new version of its object
    M inode:u64 path_len:u16 path        renamed        U inode:u64   unlinked (no path names it)
    D inode:u64                          forgotten      B inode:u64 backing:u32   a backing id
    X inode:u64                          its backing id closed

A zero byte where a record would start, or a torn last record, ends the replay. The file is
rewritten from the live set (``_compact``: a temporary file renamed over it) once it is over
twice the live set's size, so it stays proportional to what the kernel holds.
"""

import logging
import mmap
import os
import struct
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_NODE = struct.Struct("<cQBQddBH")
_VERSION = struct.Struct("<cQQddB")
_MOVE = struct.Struct("<cQH")
_ONE = struct.Struct("<cQ")
_BACKING = struct.Struct("<cQI")
_MIN_COMPACT = 1 << 20
_ALLOCATE = 1 << 20         # the file grows this much (or doubles) at a time


@dataclass(slots=True)
class KnownNode:
    """A node the kernel held when the previous daemon stopped."""

    inode: int
    path: str
    is_dir: bool
    size: int
    mtime: float
    etag: str
    checked: float = 0.0       # when this version was last known current (0: unknown)
    linked: bool = True        # a path still names it (not unlinked)


@dataclass(slots=True)
class KnownIds:
    nodes: dict[int, KnownNode] = field(default_factory=dict)
    backings: dict[int, int] = field(default_factory=dict)      # inode -> backing id


class IdLog:
    """The append-only record of node ids and backing ids (see the module docstring)."""

    def __init__(self, path: str, *, fresh: bool) -> None:
        self.path = path
        self.known = KnownIds() if fresh else _read(path)
        self._records: dict[int, bytes] = {}       # inode -> its current N (+U) record
        self._backings: dict[int, int] = dict(self.known.backings)
        for node in self.known.nodes.values():
            self._records[node.inode] = _node_record(node.inode, node.path, node.is_dir, node.size, node.mtime,
                                                     node.checked, node.etag, node.linked)
        self._live_bytes = 0
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._size = 0                             # where the next record goes
        self._compact()

    # ---- records ---------------------------------------------------------------------------
    def node(self, inode: int, path: str, is_dir: bool, size: int, mtime: float, checked: float, etag: str) -> None:
        record = _node_record(inode, path, is_dir, size, mtime, checked, etag, True)
        self._records[inode] = record
        self._live_bytes += len(record)
        self._write(record)

    def version(self, inode: int, size: int, mtime: float, checked: float, etag: str) -> None:
        old = self._records.get(inode)
        if old is None:
            return
        known = _parse_node(old)
        self._replace(inode, _node_record(inode, known.path, known.is_dir, size, mtime, checked, etag, known.linked))
        raw = etag.encode()[:255]
        self._write(_VERSION.pack(b"V", inode, size, mtime, checked, len(raw)) + raw)

    def moved(self, inode: int, path: str) -> None:
        old = self._records.get(inode)
        if old is None:
            return
        known = _parse_node(old)
        self._replace(inode, _node_record(inode, path, known.is_dir, known.size, known.mtime, known.checked,
                                          known.etag, True))
        raw = path.encode()
        self._write(_MOVE.pack(b"M", inode, len(raw)) + raw)

    def _replace(self, inode: int, record: bytes) -> None:
        self._live_bytes += len(record) - len(self._records[inode])
        self._records[inode] = record

    def unlinked(self, inode: int) -> None:
        old = self._records.get(inode)
        if old is not None and not old.endswith(b"U" + inode.to_bytes(8, "little")):
            self._replace(inode, old + _ONE.pack(b"U", inode))
            self._write(_ONE.pack(b"U", inode))

    def dropped(self, inode: int) -> None:
        record = self._records.pop(inode, None)
        if record is not None:
            self._live_bytes -= len(record)
            self._write(_ONE.pack(b"D", inode))

    def backing(self, inode: int, backing_id: int) -> None:
        self._backings[inode] = backing_id
        self._write(_BACKING.pack(b"B", inode, backing_id))

    def backing_closed(self, inode: int) -> None:
        if self._backings.pop(inode, None) is not None:
            self._write(_ONE.pack(b"X", inode))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- the file --------------------------------------------------------------------------
    def _write(self, record: bytes) -> None:
        mapped = self._map
        if mapped is None:
            return
        end = self._size + len(record)
        if end > len(mapped):
            if not self._grow(end):
                return
            mapped = self._map
        mapped[self._size + 1:end] = record[1:]
        mapped[self._size] = record[0]           # last: the record is whole, or reads as the end
        self._size = end
        if end > max(_MIN_COMPACT, 2 * (self._live_bytes + 13 * len(self._backings))):
            self._compact()

    def _grow(self, end: int) -> bool:
        capacity = _round_up(max(end, 2 * len(self._map), _ALLOCATE))
        try:
            os.posix_fallocate(self._fd, 0, capacity)
            self._map.close()
            self._map = mmap.mmap(self._fd, capacity)
        except (OSError, ValueError) as exc:     # a full or failing cache disk: the mount goes on, unprotected
            log.warning("cannot record kernel ids in %s (%s): a daemon that dies now takes the mount with it",
                        self.path, exc)
            self.close()
            return False
        return True

    def _compact(self) -> None:
        """Rewrite the file as the live records only (write a temporary file, allocate it ahead,
        rename it over, map it)."""
        self.close()
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                live = b"".join([*self._records.values(),
                                 *(_BACKING.pack(b"B", inode, backing_id) for inode, backing_id in self._backings.items())])
                done = 0
                while done < len(live):
                    done += os.write(fd, live[done:])
                capacity = _round_up(max(2 * len(live), _ALLOCATE))
                os.posix_fallocate(fd, 0, capacity)
                os.replace(tmp, self.path)
                self._map = mmap.mmap(fd, capacity)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._size = fd, len(live)
        except OSError as exc:
            log.warning("cannot write %s (%s): a daemon that dies takes the mount with it", self.path, exc)
            self.close()
        self._live_bytes = sum(len(r) for r in self._records.values())


def _round_up(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _node_record(inode: int, path: str, is_dir: bool, size: int, mtime: float, checked: float, etag: str,
                 linked: bool) -> bytes:
    raw_etag, raw_path = etag.encode()[:255], path.encode()
    record = _NODE.pack(b"N", inode, is_dir, size, mtime, checked, len(raw_etag), len(raw_path)) + raw_etag + raw_path
    return record if linked else record + _ONE.pack(b"U", inode)


def _parse_node(record: bytes) -> KnownNode:
    _, inode, is_dir, size, mtime, checked, etag_len, path_len = _NODE.unpack_from(record)
    start = _NODE.size
    etag = record[start:start + etag_len].decode()
    path = record[start + etag_len:start + etag_len + path_len].decode()
    return KnownNode(inode, path, bool(is_dir), size, mtime, etag, checked,
                     linked=len(record) == start + etag_len + path_len)


def _read(path: str) -> KnownIds:
    """Replay the file: the nodes and backing ids live at its end (a torn last record is dropped)."""
    known = KnownIds()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return known
    pos, end = 0, len(data)
    try:
        while pos < end:
            kind = data[pos:pos + 1]
            if kind == b"N":
                _, inode, is_dir, size, mtime, checked, etag_len, path_len = _NODE.unpack_from(data, pos)
                start = pos + _NODE.size
                if start + etag_len + path_len > end:
                    break
                etag = data[start:start + etag_len].decode()
                node_path = data[start + etag_len:start + etag_len + path_len].decode()
                known.nodes[inode] = KnownNode(inode, node_path, bool(is_dir), size, mtime, etag, checked)
                pos = start + etag_len + path_len
            elif kind == b"V":
                _, inode, size, mtime, checked, etag_len = _VERSION.unpack_from(data, pos)
                start = pos + _VERSION.size
                if start + etag_len > end:
                    break
                node = known.nodes.get(inode)
                if node is not None:
                    node.size, node.mtime, node.checked = size, mtime, checked
                    node.etag = data[start:start + etag_len].decode()
                pos = start + etag_len
            elif kind == b"M":
                _, inode, path_len = _MOVE.unpack_from(data, pos)
                start = pos + _MOVE.size
                if start + path_len > end:
                    break
                if inode in known.nodes:
                    known.nodes[inode].path = data[start:start + path_len].decode()
                    known.nodes[inode].linked = True
                pos = start + path_len
            elif kind in (b"U", b"D", b"X"):
                _, inode = _ONE.unpack_from(data, pos)
                pos += _ONE.size
                if kind == b"U" and inode in known.nodes:
                    known.nodes[inode].linked = False
                elif kind == b"D":
                    known.nodes.pop(inode, None)
                elif kind == b"X":
                    known.backings.pop(inode, None)
            elif kind == b"B":
                _, inode, backing_id = _BACKING.unpack_from(data, pos)
                known.backings[inode] = backing_id
                pos += _BACKING.size
            elif kind == b"\0":
                break                    # the end: the file is allocated ahead, zero past it
            else:
                log.warning("%s: an unknown record at byte %d; the rest is ignored", path, pos)
                break
    except (struct.error, UnicodeDecodeError):
        log.warning("%s: a torn record at byte %d (the previous daemon died writing it); ignored", path, pos)
    return known
