"""Packing one worker's shards: list, plan, and for each shard not already finished stream its
records out (parallel GETs in order), then its ``.idx``, then its index fragment (the shard's
commit), and finally the worker's commit marker. Rerunning skips shards whose fragment matches
the plan, so Ctrl-C then a rerun resumes."""

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from cachefs.errors import NoSuchKey, UsageError
from cachefs.packfmt import Manifest, PackedIndex, read_manifest, shard_path
from cachefs.packfmt.shard import ShardBuilder
from cachefs.packfmt.store_index import open_index
from cachefs.store import ObjectStore

from .fetch import fetch_ranges, fetch_source, in_order
from .fragment import WorkerMarker, fragment_bytes, read_fragment
from .layout import PACK_DIRS, fragment_path, idx_path, marker_path
from .options import PackOptions
from .plan import Plan, ShardPlan, make_plan
from .progress import Progress
from .sink import ShardSink
from .source import SourceFile, list_source


def plan_pack(src: ObjectStore, dst: ObjectStore, src_root: str | None, options: PackOptions) -> Plan:
    """The plan of this run: everything (first pack) or what changed since the manifest (--append)."""
    manifest = read_manifest(dst)
    files = list_source(src, src_root)
    if not files:       # a mistyped SRC: publishing an empty dataset (or tombstoning all of one) helps no one
        raise NoSuchKey("SRC holds no files (check its path): nothing to pack" if manifest is None else
                        "SRC holds no files (check its path): --append would delete every packed file")
    if manifest is None:
        if options.append:
            raise UsageError("--append: the destination holds no packed dataset yet (pack it first)")
        foreign = _foreign_object(dst)
        if foreign is not None:
            raise UsageError(f"the destination already holds other objects (e.g. {foreign!r}): pack into an empty "
                             "place (a mount of it would show only the packed dataset, hiding them)")
        return make_plan(files, shard_size=options.shard_size)
    if not options.append:
        raise UsageError("the destination already holds a packed dataset: use --append to add changes, "
                         "or pack into another place")
    return _append_plan(files, manifest, open_index(dst)[1], options)


def _foreign_object(dst: ObjectStore) -> str | None:
    """The first object below DST that no pack writes; None when DST is empty or holds only the
    shards and work files of a pack not finished yet (a rerun resumes it; other workers' parts)."""
    for info in dst.list_all(""):
        if not info.path.startswith(PACK_DIRS):
            return info.path
    return None


def _append_plan(files: list[SourceFile], manifest: Manifest, index: PackedIndex, options: PackOptions) -> Plan:
    old = dict(zip(index.files.column("path").to_pylist(),
                   zip(index.files.column("etag").to_pylist(), index.files.column("size").to_pylist(),
                       strict=True), strict=True))
    changed = [f for f in files if old.get(f.path) != (f.etag, f.size)]
    present = {f.path for f in files}
    deleted = tuple(sorted(p for p in old if p not in present))
    return make_plan(changed, shard_size=options.shard_size, generation=manifest.generation + 1,
                     first_shard=manifest.shards, deleted=deleted)


class Worker:
    """Writes one worker's shards of a plan to ``dst``."""

    def __init__(self, src: ObjectStore, dst: ObjectStore, source_url: str, options: PackOptions,
                 progress: Progress) -> None:
        self.src, self.dst, self.source_url = src, dst, source_url
        self.options, self.progress = options, progress

    def run(self, plan: Plan) -> list[ShardPlan]:
        mine = plan.for_worker(self.options.worker_index, self.options.worker_count)
        self.progress.plan(sum(len(s.files) for s in mine), sum(f.size for s in mine for f in s.files), len(mine))
        with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="pack-get") as pool:
            for shard in mine:
                if self._finished(plan, shard):
                    self.progress.shard_done(len(shard.files), sum(f.size for f in shard.files), skipped=True)
                    continue
                self._pack_shard(pool, plan, shard)
                self.progress.shard_done(len(shard.files), 0)
        self._commit(plan)
        return list(mine)

    def _finished(self, plan: Plan, shard: ShardPlan) -> bool:
        found = read_fragment(self.dst, fragment_path(plan.generation, shard.number))
        return found is not None and found[2] == plan.fingerprint

    def _pack_shard(self, pool: ThreadPoolExecutor, plan: Plan, shard: ShardPlan) -> None:
        builder = ShardBuilder(shard.number, plan.generation)
        path = shard_path(shard.number)
        sink = ShardSink(self.dst, path, self.options.part_size)
        try:
            fetch = partial(fetch_source, self.src, self.options.stream_above)
            for f, data in in_order(pool, shard.files, fetch, self.options.concurrency * 2):
                self._add(pool, builder, sink, f, data)
                self.progress.file_done(f.size)
            info = sink.finish()
        except BaseException:
            sink.abort()
            raise
        self.dst.put(idx_path(path), builder.idx_bytes())
        self.dst.put(fragment_path(plan.generation, shard.number),
                     fragment_bytes(builder.rows, builder.shard_row(info.etag), plan.fingerprint))

    def _add(self, pool: ThreadPoolExecutor, builder: ShardBuilder, sink: ShardSink, f: SourceFile,
             data: bytes | None) -> None:
        meta = {"mtime": f.mtime, "mode": f.mode, "etag": f.etag}
        if data is not None:
            sink.write(builder.add(f.path, data, **meta))
            return
        chunks = fetch_ranges(pool, self.src, f, self.options.range_size, self.options.ranges_in_flight)
        for piece in builder.add_streamed(f.path, f.size, chunks, **meta):
            sink.write(piece)

    def _commit(self, plan: Plan) -> None:
        i, n = self.options.worker_index, self.options.worker_count
        marker = WorkerMarker(plan.fingerprint, self.source_url, plan.generation, i, n, plan.first_shard,
                              len(plan.shards), list(plan.deleted), time.time())
        self.dst.put(marker_path(plan.generation, i, n), marker.to_json())
