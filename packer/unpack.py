"""`cachefs unpack DST OUT`: the original tree back (names, bytes, modes, mtimes), every file's
crc32c checked; each shard is read front to back in large ranged GETs."""

import os
from concurrent.futures import ThreadPoolExecutor

from cachefs.errors import UsageError
from cachefs.packfmt import CorruptRecord, Entry, PackedIndex, shard_path
from cachefs.packfmt.store_index import open_index
from cachefs.packfmt.tfrecord import crc32c
from cachefs.store import ObjectStore

from .progress import Progress
from .reader import ShardReader
from .source import check_name


def unpack(dst: ObjectStore, out: ObjectStore, out_root: str | None, progress: Progress,
           concurrency: int = 8, overwrite: bool = False) -> dict:
    manifest, index = open_index(dst)
    paths = index.files.column("path").to_pylist()
    for path in paths:
        check_name(path)   # an index must never write outside OUT
    if not overwrite:
        taken = _taken(out, out_root, paths)
        if taken:
            raise UsageError(f"OUT already holds {len(taken)} of the dataset's files (e.g. {taken[0]!r}): nothing "
                             "was written; unpack into an empty place, or give --overwrite to replace them "
                             "(e.g. to finish an interrupted unpack)")
    progress.plan(len(index), manifest.bytes, index.shards.num_rows)
    groups = index.rows_by_shard()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        done = sum(pool.map(lambda s: _unpack_shard(dst, out, out_root, index, s, groups[s], progress),
                            range(len(groups))))
    return {"files": done, "bytes": manifest.bytes}


def _taken(out: ObjectStore, out_root: str | None, paths: list[str]) -> list[str]:
    """The dataset's paths that OUT already holds (a file, or anything else in a directory), sorted."""
    if out_root is not None:
        return [p for p in paths if os.path.lexists(os.path.join(out_root, p))]
    wanted = set(paths)
    return sorted(info.path for info in out.list_all("") if info.path in wanted)


def _unpack_shard(dst: ObjectStore, out: ObjectStore, out_root: str | None, index: PackedIndex, shard: int,
                  rows: list[int], progress: Progress) -> int:
    if not len(rows):
        return 0
    reader = ShardReader(dst, shard_path(shard))
    for entry in index.entries(rows):
        data = reader.read_at(entry.data_offset, entry.data_length)
        if len(data) != entry.data_length or crc32c(data) != entry.crc32c:
            raise CorruptRecord(f"shard {shard_path(shard)}: {entry.path!r} fails its crc32c")
        _write(out, out_root, entry, data)
        progress.file_done(len(data))
    progress.shard_done(len(rows), 0)
    return len(rows)


def _write(out: ObjectStore, out_root: str | None, entry: Entry, data: bytes) -> None:
    if out_root is None:
        out.put(entry.path, data)
        return
    target = os.path.join(out_root, entry.path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temp = f"{target}.cachefs-unpack.tmp"
    with open(temp, "wb") as f:
        f.write(data)
    os.chmod(temp, entry.mode & 0o7777)
    os.utime(temp, (entry.mtime, entry.mtime))
    os.replace(temp, target)
