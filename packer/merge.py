"""The final step: check every worker committed the same plan, concatenate the shard fragments
(and the previous generation's rows, for --append) into the index, write it, then the manifest
last, then drop the work files."""

import time

import pyarrow as pa
import pyarrow.compute as pc

import cachefs
from cachefs.packfmt import (
    FILES_SCHEMA,
    SHARDS_SCHEMA,
    CorruptIndex,
    Incomplete,
    Manifest,
    PackedIndex,
    read_manifest,
    write_manifest,
)
from cachefs.packfmt.index import TOMBSTONES_SCHEMA, concat, parquet_bytes, sort_by_path
from cachefs.packfmt.store_index import open_index, read_object
from cachefs.store import ObjectStore

from .fragment import WorkerMarker, read_fragment
from .layout import (
    WORK,
    fragment_path,
    index_files_path,
    index_shards_path,
    tombstones_path,
    work_dir,
)


def merge(dst: ObjectStore) -> Manifest:
    previous = read_manifest(dst)
    generation = 0 if previous is None else previous.generation + 1
    marker = _committed_plan(dst, generation)
    files, shards = _new_tables(dst, marker)
    if previous is not None:
        files, shards = _with_previous(dst, files, shards, marker)
    PackedIndex(files, shards)   # validates: sorted, unique, inside the shards
    manifest = _publish(dst, previous, marker, files, shards)
    _drop_work(dst, generation)
    _drop_orphan_shards(dst, manifest.shards)
    return manifest


def _committed_plan(dst: ObjectStore, generation: int) -> WorkerMarker:
    markers = sorted((WorkerMarker.from_json(read_object(dst, o.path), o.path)
                      for o in dst.list_all(f"{work_dir(generation)}/")
                      if o.path.rsplit("/", 1)[-1].startswith("worker-")), key=lambda m: m.written)
    if not markers:
        raise Incomplete(f"no worker has committed generation {generation} yet: nothing to merge")
    newest = markers[-1]     # the latest run decides the plan and the worker count; older runs' markers wait
    agreeing = {m.worker_index for m in markers
                if m.fingerprint == newest.fingerprint and m.worker_count == newest.worker_count}
    missing = sorted(set(range(newest.worker_count)) - agreeing)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise Incomplete(f"workers {shown} of {newest.worker_count} have not committed this plan (a worker "
                         "still running, failed, or saw another listing): run them, then --merge again")
    return newest


def _new_tables(dst: ObjectStore, marker: WorkerMarker) -> tuple[pa.Table, pa.Table]:
    tables, shard_rows = [], []
    for number in range(marker.first_shard, marker.first_shard + marker.total_shards):
        found = read_fragment(dst, fragment_path(marker.generation, number))
        if found is None or found[2] != marker.fingerprint:
            raise Incomplete(f"shard {number} has no committed fragment for this plan: rerun its worker")
        tables.append(found[0])
        shard_rows.append(found[1])
    return concat(tables, FILES_SCHEMA), pa.Table.from_pylist(shard_rows, schema=SHARDS_SCHEMA)


def _with_previous(dst: ObjectStore, files: pa.Table, shards: pa.Table,
                   marker: WorkerMarker) -> tuple[pa.Table, pa.Table]:
    _, old = open_index(dst)
    if old.shards.num_rows != marker.first_shard:
        raise CorruptIndex("the previous generation's shards do not end where this append begins")
    gone = pa.array(sorted(set(marker.deleted) | set(files.column("path").to_pylist())), pa.string())
    kept = old.files.filter(pc.invert(pc.is_in(old.files.column("path"), value_set=gone)))
    return sort_by_path(pa.concat_tables([kept, files])).combine_chunks(), pa.concat_tables([old.shards, shards])


def _publish(dst: ObjectStore, previous: Manifest | None, marker: WorkerMarker, files: pa.Table,
             shards: pa.Table) -> Manifest:
    g = marker.generation
    dst.put(index_files_path(g), parquet_bytes(files))
    dst.put(index_shards_path(g), parquet_bytes(shards))
    tombstones = list(previous.tombstones) if previous else []
    if marker.deleted:
        dst.put(tombstones_path(g), parquet_bytes(pa.Table.from_pylist(
            [{"path": p, "generation": g} for p in marker.deleted], schema=TOMBSTONES_SCHEMA)))
        tombstones.append(tombstones_path(g))
    now = time.time()
    generations = (list(previous.generations) if previous else []) + [{
        "generation": g, "created": now, "first_shard": marker.first_shard, "shards": marker.total_shards,
        "added": sum(r for r in shards.column("records").to_pylist()[marker.first_shard:]),
        "deleted": len(marker.deleted), "workers": marker.worker_count}]
    manifest = Manifest(source=marker.source, tool_version=cachefs.__version__, created=now, generation=g,
                        files=files.num_rows, bytes=int(pc.sum(files.column("size")).as_py() or 0),
                        shards=shards.num_rows, shard_bytes=int(pc.sum(shards.column("bytes")).as_py() or 0),
                        index_files=index_files_path(g), index_shards=index_shards_path(g),
                        tombstones=tombstones, generations=generations)
    write_manifest(dst, manifest)
    return manifest


def _drop_orphan_shards(dst: ObjectStore, shards: int) -> None:
    """Shards an interrupted run wrote beyond what was published (its plan had more shards)."""
    for info in list(dst.list_all("shards/")):
        number = info.path.removeprefix("shards/").split(".", 1)[0]
        if number.isdigit() and int(number) >= shards:
            dst.delete(info.path)


def _drop_work(dst: ObjectStore, generation: int) -> None:
    for info in list(dst.list_all(f"{work_dir(generation)}/")):
        dst.delete(info.path)
    dst.remove_dir(work_dir(generation))
    dst.remove_dir(WORK)
