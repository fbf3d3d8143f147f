"""`cachefs pack --verify DST`: every shard re-read; every record's framing crcs, its Example, its
path and its data crc32c checked against the index; every shard's size and checksum too."""

from concurrent.futures import ThreadPoolExecutor

from cachefs.packfmt import CorruptRecord, Entry, PackedIndex, shard_path
from cachefs.packfmt.store_index import open_index
from cachefs.packfmt.tfrecord import HEADER, crc32c, example_head, iter_records
from cachefs.store import ObjectStore

from .progress import Progress
from .reader import ShardReader


class _Checksummed:
    """Passes reads through and keeps the running crc32c of everything read."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader, self.crc = reader, 0

    def read(self, n: int) -> bytes:
        data = self.reader.read(n)
        self.crc = crc32c(data, self.crc)
        return data


def verify(dst: ObjectStore, progress: Progress, concurrency: int = 8) -> dict:
    manifest, index = open_index(dst)
    progress.plan(len(index), manifest.bytes, index.shards.num_rows)
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        groups = index.rows_by_shard()
        checked = sum(pool.map(lambda s: _verify_shard(dst, index, s, groups[s], progress), range(len(groups))))
    return {"files": checked, "shards": index.shards.num_rows}


def _verify_shard(dst: ObjectStore, index: PackedIndex, shard: int, rows, progress: Progress) -> int:
    name, expected = index.shards.column("name")[shard].as_py(), index.shards.slice(shard, 1).to_pylist()[0]
    reader = ShardReader(dst, shard_path(shard))
    if reader.size != expected["bytes"]:
        raise CorruptRecord(f"shard {name}: {reader.size} bytes, the index says {expected['bytes']}")
    wanted = {entry.record_offset: entry for entry in index.entries(rows)}
    stream, seen = _Checksummed(reader), 0
    for offset, payload in _records(stream, name):
        entry = wanted.get(offset)
        if entry is not None:
            _check_record(entry, payload, offset, name)
            seen += 1
            progress.file_done(entry.size)
    if seen != len(wanted):
        raise CorruptRecord(f"shard {name}: {len(wanted) - seen} indexed records are not record starts")
    if f"{stream.crc:08x}" != expected["checksum"]:
        raise CorruptRecord(f"shard {name}: checksum {stream.crc:08x}, the shards table says {expected['checksum']}")
    progress.shard_done(seen, 0)
    return seen


def _records(stream: _Checksummed, name: str):
    try:
        yield from iter_records(stream)
    except CorruptRecord as exc:
        raise CorruptRecord(f"shard {name}: {exc}") from exc


def _check_record(entry: Entry, payload: memoryview, offset: int, name: str) -> None:
    """The record is exactly the Example the packer writes for the index's path and size, with the
    data where the index says and matching its crc32c."""
    head = example_head(entry.path.encode(), entry.size)
    if (len(payload) != len(head) + entry.size or payload[:len(head)] != head
            or offset + HEADER + len(head) != entry.data_offset):
        raise CorruptRecord(f"shard {name}: the record at {offset} is not the index's {entry.path!r}")
    if crc32c(payload[len(head):]) != entry.crc32c:
        raise CorruptRecord(f"shard {name}: {entry.path!r} fails its crc32c")
