"""The packed-dataset view: a dataset packed by `cachefs pack` mounted as its original tree.

The index (``cachefs.packfmt``) is the listing: names, sizes and mtimes come from it, so the
mount never LISTs the shards. A packed file's bytes are a range of its shard, read through the
tiers as ``FileVersion(shard path, shard ETag from the shards table, shard size)``: the cache
holds shard blocks, one GET serves every file in a block, and readahead follows the shard (one
``Stream`` per shard, shared by the handles reading it). The raw layout (manifest, index/,
shards/) stays reachable below the hidden directory ``.cachefs-packed`` (not listed in the root,
found by name) for the native loader, ``cachefs.data``.

crc32c rule (docs/packer.md): when a shard block comes from the store, every record wholly in
it is checked against its index crc (``_check_block``, in the trio thread: ~1 ms per 8 MiB), and
a file whose record passed is served without a check of its own (the disk tier's chunk checksums
cover the copy it keeps). Any other file (a record across two blocks, or in a block the disk tier
held before this mount) of at most ``VERIFY_WHOLE_MAX`` bytes is read whole on a handle's first
read and checked before any byte is served; a larger one is checked as it is read in order from
offset 0 (a mismatch fails the read that completes it). A mismatch evicts the record's blocks,
counts ``cachefs_packed_crc_errors_total``, refetches once (small files), and is EIO if the bytes
are still wrong.
"""

import bisect
import errno
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from cachefs.errors import AccessDenied, CachefsError, ConfigError, NoSuchKey
from cachefs.metrics import Metrics
from cachefs.namespace.nodes import FsError
from cachefs.packfmt.errors import CorruptRecord
from cachefs.packfmt.manifest import FORMAT, MANIFEST, Manifest
from cachefs.packfmt.store_index import PACKED_DIR
from cachefs.ports import Port
from cachefs.store import Listing, ObjectInfo, ObjectStore
from cachefs.tiers.cache import PRELOAD_MAX, FileVersion, Stream, Tiers

if TYPE_CHECKING:
    from cachefs.packfmt.index import PackedIndex

log = logging.getLogger(__name__)

VERIFY_WHOLE_MAX = 8 << 20        # larger files are verified as they are read in order


def open_packed(store: ObjectStore) -> tuple[Manifest, "PackedIndex"] | None:
    """The manifest and index when the store's root is a packed dataset, else None (a dataset's
    own ``manifest.json`` that is not ours is just a file). Once the manifest says it is ours, an
    unknown version (UnknownVersion, exit 24) or a corrupt index (CorruptIndex, exit 23) raises."""
    try:
        info = store.head(MANIFEST)
    except (NoSuchKey, AccessDenied):      # S3 answers 403 for a missing key without s3:ListBucket
        return None
    if not _claims_pack(store.get(MANIFEST, 0, info.size, info.etag, info.size)):
        log.info("%s is not a cachefs pack manifest: mounting the prefix as it is", MANIFEST)
        return None
    try:       # the index needs pyarrow, numpy and crc32c: the `packer` extra, loaded only now
        from cachefs.packfmt.store_index import open_index
        from cachefs.packfmt.tfrecord import crc32c  # noqa: F401 (present, or the mount is refused here)
    except ImportError as exc:
        raise ConfigError(f"this prefix is a packed dataset ({MANIFEST}); mounting it needs the packer extra: "
                          f"pip install 'cachefs[packer]' ({exc})") from None
    return open_index(store)


def _crc32c(data, value: int = 0) -> int:
    from cachefs.packfmt.tfrecord import crc32c  # loaded by open_packed (the packer extra)
    return crc32c(data, value)


def _claims_pack(data: bytes) -> bool:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


@dataclass(slots=True)
class PackedRef:
    """Where one open file's bytes are: ``size`` bytes at ``offset`` of ``file``; ``crc`` is
    None for a raw object of the layout (its bytes are the object's, unchecked here)."""

    file: FileVersion
    offset: int
    size: int
    crc: int | None
    row: int = -1                 # the index row (-1: a raw object)
    verified: bool = False
    stream_crc: int = 0
    stream_end: int = 0           # bytes [0, stream_end) were read in order into stream_crc


@dataclass(frozen=True, slots=True)
class PackedInfo(ObjectInfo):
    """A packed file as its directory lists it, with its index row: lookup and open take the row
    from here and never search the index again (two binary searches of path strings per file)."""

    row: int = -1


def is_raw(path: str) -> bool:
    return path == PACKED_DIR or path.startswith(PACKED_DIR + "/")


def _store_path(path: str) -> str:
    return path[len(PACKED_DIR) + 1:]


class PackedMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.packed_crc_errors = Counter("cachefs_packed_crc_errors", "Packed records whose crc32c failed",
                                         registry=r)


class PackedView:
    """The namespace (a ``DirSource``) and the read path of one packed dataset."""

    def __init__(self, store: ObjectStore, manifest: Manifest, index: "PackedIndex", tiers: Tiers,
                 metrics: Metrics, *, fetched: Port | None = None, shard_read: Port | None = None) -> None:
        self.store = store
        self.manifest = manifest
        self.index = index
        self.tiers = tiers
        self.crc_errors = metrics.group(PackedMetrics).packed_crc_errors
        from cachefs.packfmt.index import shard_path
        shards = index.shards.select(["shard", "etag", "bytes"]).to_pylist()
        self._shards = [FileVersion(shard_path(s["shard"]), s["etag"], s["bytes"]) for s in shards]
        self._streams: dict[str, Stream] = {}
        self._shard_paths = {f.path for f in self._shards}
        # a shard entered: the shard warm (warm/dataset_watch.py) answers
        self.shard_read = shard_read if shard_read is not None else Port("shard_read")
        self._asked: dict[str, set[int]] = {}      # per shard: blocks readahead was asked for
        files = index.files     # one chunk each (validated on load): numpy views, no copies
        self._col = {name: files.column(name).to_numpy() for name in
                     ("shard", "data_offset", "data_length", "crc32c", "mtime", "generation", "mode")}
        # records checked when their block came from the store (_check_block): per index row
        self._shard_of = {f.path: number for number, f in enumerate(self._shards)}
        import numpy  # the packer extra, as the index
        # one sort of every row, here at start, before the mount serves (0.3 s for 10M rows packed in
        # path order, 5 s shuffled): never in the trio thread
        self._by_shard = index.rows_by_shard()
        self._checked = numpy.zeros(len(index), dtype=bool)
        if fetched is not None:
            fetched.connect(self._check_block)      # every block from the store: its records checked

    def shard_version(self, number: int) -> FileVersion:
        """The store object of shard ``number`` (its row in the shards table); IndexError if none."""
        if not 0 <= number < len(self._shards):
            raise IndexError(f"no shard {number}")
        return self._shards[number]

    # ---- the namespace ------------------------------------------------------------------------
    def list_dir(self, prefix: str) -> Listing:
        path = prefix.rstrip("/")
        if is_raw(path):
            raw = self.store.list_dir(_store_path(prefix) if path != PACKED_DIR else "")
            return Listing([ObjectInfo(f"{PACKED_DIR}/{i.path}", i.size, i.mtime, i.etag) for i in raw.files],
                           raw.dirs)
        rows, dirs = self.index.list_dir(path)
        c = self._col
        return Listing([PackedInfo(self.index.path(r), int(c["data_length"][r]), float(c["mtime"][r]),
                                   f"g{c['generation'][r]}", r) for r in rows], dirs)

    def locate(self, path: str, info: ObjectInfo | None) -> tuple[int, int | None]:
        """The index row of the file at ``path`` (listed as ``info``) and the st_mode the index
        records for it; (-1, None) for an object of the raw layout."""
        if is_raw(path):
            return -1, None
        row = info.row if isinstance(info, PackedInfo) and info.row >= 0 else self._find(path)
        return row, int(self._col["mode"][row])

    def ref(self, path: str, size: int, etag: str, row: int = -1) -> PackedRef:
        """Where the bytes of the file at ``path`` (as the node shows it; ``row`` its index row if
        known) are."""
        if is_raw(path):
            return PackedRef(FileVersion(_store_path(path), etag, size), 0, size, None)
        if row < 0:
            row = self._find(path)
        c = self._col
        return PackedRef(self._shards[c["shard"][row]], int(c["data_offset"][row]), int(c["data_length"][row]),
                         int(c["crc32c"][row]), row)

    def _find(self, path: str) -> int:
        row = self.index.find(path)
        if row is None:
            raise FsError(errno.ENOENT, f"{path}: not in the packed index")
        return row

    # ---- reads --------------------------------------------------------------------------------
    async def read(self, ref: PackedRef, stream: Stream, offset: int, size: int) -> bytes:
        end = min(offset + size, ref.size)
        if offset >= end:
            return b""
        if ref.crc is None:
            if self.shard_read and ref.file.path in self._shard_paths:
                self.shard_read(ref.file)       # the native loader reading the shard file itself
            return await self.tiers.read(ref.file, offset, end - offset, stream)
        if ref.verified:
            return await self._range(ref, offset, end, stream)
        if ref.size <= VERIFY_WHOLE_MAX:
            data = await self._whole(ref)
            ref.verified = True
            return data if (offset, end) == (0, ref.size) else data[offset:end]
        data = await self._range(ref, offset, end, stream)
        self._stream_check(ref, offset, end, data)
        return data

    async def preload(self, ref: PackedRef, stream: Stream) -> bytes | None:
        """A small packed file's whole checked content at open, for the kernel page cache: the READ
        that would follow never comes (one FUSE round trip less per file, cold or warm)."""
        if ref.crc is None or not 0 < ref.size <= PRELOAD_MAX:
            return None
        try:
            return await self.read(ref, stream, 0, ref.size)
        except (CachefsError, OSError):
            return None         # the open succeeds; the READ fails with the error's errno

    async def _range(self, ref: PackedRef, offset: int, end: int, stream: Stream | None = None) -> bytes:
        """Bytes [offset, end) of a packed file. A file of more than two blocks (a checkpoint, a
        video packed into a shard of its own) is read with its handle's ``stream``, as an
        unpacked file is: its readahead follows that reader, and the blocks it has read all of
        leave the memory tier (its first and last blocks, which hold other files' bytes too, are
        never read whole by it and stay). Smaller files share the shard's stream."""
        if stream is None or ref.size <= 2 * self.tiers.block_size:
            stream = self._stream(ref, offset, end)
        return await self.tiers.read(ref.file, ref.offset + offset, end - offset, stream)

    def _stream(self, ref: PackedRef, offset: int, end: int) -> Stream | None:
        """The shard's readahead stream, shared by every handle reading the shard. Any read of a
        shard after its first continues the stream, in path order or shuffled: an epoch reads
        every block of a shard sooner or later, so each read fetches ahead a window after itself
        (doubling up to --readahead-size; cached and in-flight blocks skipped, dropped when busy).
        Blocks already asked for once are not asked for again (None: no readahead for this read),
        so a warm epoch does not pay a readahead per file."""
        path = ref.file.path
        stream = self._streams.get(path)
        if stream is None:
            if self.shard_read:
                self.shard_read(ref.file)
            self._streams[path] = Stream(drop_behind=False)     # shared by every member's reader
            self._asked[path] = set()
            return self._streams[path]
        start, stop = ref.offset + offset, min(ref.offset + end, ref.file.size)
        if start == 0:
            return stream
        asked = self._asked[path]
        if len(asked) * self.tiers.block_size >= ref.file.size:
            return None                  # every block asked for once: an epoch's usual case, decided at once
        ahead = self.tiers.blocks_ahead(stream, ref.file, stop)
        if all(i in asked for i in ahead):
            return None
        asked.update(ahead)
        self.tiers.continue_stream(stream, start)
        return stream

    async def _whole(self, ref: PackedRef) -> bytes:
        """The whole file, checked against its crc (unless its block's arrival checked it); refetched
        once from the store on a mismatch."""
        data = await self._range(ref, 0, ref.size)
        if (ref.row >= 0 and self._checked[ref.row]) or _crc32c(data) == ref.crc:
            return data
        self._corrupt(ref)
        data = await self._range(ref, 0, ref.size)
        if _crc32c(data) == ref.crc:
            log.info("%s: crc32c mismatch at offset %d; the refetched bytes are right", ref.file.path, ref.offset)
            return data
        self.evict(ref)
        raise CorruptRecord(f"{ref.file.path}: the record at data offset {ref.offset} fails its crc32c "
                            f"(refetched once): the shard is corrupt")

    def _check_block(self, f: FileVersion, offset: int, data: bytes) -> None:
        """The ``fetched`` port: ``data``, at ``offset`` of ``f``, came from the store. If ``f`` is one of
        our shards, check every record wholly inside it and record which passed (a record that fails
        is checked again when read, and handled there)."""
        shard = self._shard_of.get(f.path)
        if shard is None or f.etag != self._shards[shard].etag:
            return
        rows = self._by_shard[shard]                     # the shard's records, in shard order
        starts, lengths, crcs = self._col["data_offset"], self._col["data_length"], self._col["crc32c"]
        # binary searches through the rows, so a block costs its own records, not its shard's (a
        # shard of 1 KiB files has ~260k: gathering all their offsets took 1.6 ms per block)
        lo = bisect.bisect_left(rows, offset, key=lambda r: starts[r])
        hi = bisect.bisect_right(rows, offset + len(data), lo, key=lambda r: starts[r] + lengths[r])
        view = memoryview(data)
        for row in rows[lo:hi]:
            start = int(starts[row]) - offset
            self._checked[row] = _crc32c(view[start:start + int(lengths[row])]) == crcs[row]

    def _stream_check(self, ref: PackedRef, offset: int, end: int, data: bytes) -> None:
        if not offset <= ref.stream_end < end:
            return
        ref.stream_crc = _crc32c(memoryview(data)[ref.stream_end - offset:], ref.stream_crc)
        ref.stream_end = end
        if end < ref.size:
            return
        if ref.stream_crc == ref.crc:
            ref.verified = True
            return
        ref.stream_crc = ref.stream_end = 0
        self._corrupt(ref)
        raise CorruptRecord(f"{ref.file.path}: the record at data offset {ref.offset} fails its crc32c: "
                            f"its blocks are evicted, a reread fetches them again")

    def _corrupt(self, ref: PackedRef) -> None:
        self.crc_errors.inc()
        log.error("%s: crc32c mismatch of the %d-byte record at data offset %d; evicting its blocks",
                  ref.file.path, ref.size, ref.offset)
        self.evict(ref)

    def evict(self, ref: PackedRef) -> None:
        """Drop the blocks holding the record from the memory and disk tiers."""
        self.tiers.evict_range(ref.file, ref.offset, ref.size)

    # ---- warmup (cachefs/warm/engine.py) -------------------------------------------------------
    def resolve(self, paths: tuple[str, ...], globs: tuple[str, ...], regex_of) -> tuple[list[ObjectInfo], list[str]]:
        """The shards holding the files that ``paths`` and ``globs`` name (raw objects of the layout
        as themselves), as store objects for the warm engine, and the paths that name nothing.
        Blocking (store calls for the raw layout)."""
        shards: set[int] = set()
        raw: dict[str, ObjectInfo] = {}
        missing = []
        for path in paths:
            if is_raw(path):
                found = self._raw_objects(path)
                raw.update((i.path, i) for i in found)
            else:
                lo, hi = self._rows(path)
                found = hi > lo
                shards.update(self._shards_of(lo, hi))
            if not found:
                missing.append(path or "/")
        for pattern in globs:
            regex, static = regex_of(pattern)
            lo, hi = self._rows(static)
            rows = [lo + i for i, p in enumerate(self.index.files.column("path")[lo:hi].to_pylist())
                    if regex.match(p)]
            if not rows:
                missing.append(pattern)
            shards.update(int(self.index.files.column("shard")[r].as_py()) for r in rows)
        infos = [ObjectInfo(self._shards[s].path, self._shards[s].size, 0.0, self._shards[s].etag)
                 for s in sorted(shards)]
        return infos + [raw[p] for p in sorted(raw) if p not in {i.path for i in infos}], missing

    def _rows(self, path: str) -> tuple[int, int]:
        """The rows [lo, hi) of the file ``path`` or of every file below directory ``path``."""
        row = self.index.find(path) if path else None
        return (row, row + 1) if row is not None else self.index.rows_below(path)

    def _shards_of(self, lo: int, hi: int) -> set[int]:
        return set(self.index.files.column("shard")[lo:hi].to_numpy().tolist()) if hi > lo else set()

    def _raw_objects(self, path: str) -> list[ObjectInfo]:
        key = _store_path(path) if path != PACKED_DIR else ""
        shard = next((f for f in self._shards if f.path == key), None) if key in self._shard_paths else None
        if shard is not None:         # a shard: its ETag and size are in the shards table, no HEAD
            return [ObjectInfo(shard.path, shard.size, 0.0, shard.etag)]
        if key:
            try:
                return [self.store.head(key)]
            except NoSuchKey:
                pass
        return list(self.store.list_all(f"{key}/" if key else ""))
