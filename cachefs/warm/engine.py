"""The daemon side of `cachefs warmup`: fill the disk tier with a dataset, below readers.

A warmup request names paths, globs or a manifest (``WarmSpec``). The ``Warmer`` lists them
with one recursive LIST per directory and hands the listing to the catalog (so the first epoch
issues no LIST), plans the blocks that are not on the disk tier, checks that they fit, then
runs ``concurrency`` workers that GET blocks (small objects whole, large ones as parallel
ranged GETs of one block each) and write them straight to the disk tier with back-pressure.

Concurrency and priority (docs/design.md, invariants 1, 3, 4, 6)
-------------------------------------------------------
* The engine reaches the cache only through ``Tiers`` (``cachefs/tiers/cache.py``: warm, check,
  evict, hold, pin, room) and the store through the ``ObjectStore`` it is given (HEAD, LIST).
* All state lives in the trio thread; GETs run in worker threads under the job's own
  ``CapacityLimiter`` and joins the block's single flight (a reader wanting that block waits
  for it instead of issuing a second GET). Disk writes run on the disk tier's warm writers.
* Priority: while readers are queued for a fetch slot a job drops to 1/8 of its workers; its
  GETs never take the readers' limiter, so a read is not queued behind a warmup.
* Every GET carries ``If-Match`` with the ETag the listing showed: a 412 re-HEADs the object
  and warms the new version (blocks are keyed by ETag, so two versions never mix).
* A job holds its blocks in the disk tier while it runs (never evicting its own beginning);
  ``--pin`` turns the hold into a persistent pin. A plan larger than the room the disk tier
  can give (capacity minus held bytes, within the free-space watermark) is refused unless
  forced; a forced job stops fetching at the first fill the tier cannot take.
* A second request for the same spec joins the running job. A job whose last client goes
  (Ctrl-C) is cancelled unless it was started detached; a rerun fetches only what is missing.
"""

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import trio

from cachefs.errors import NoSuchKey, StoreError, UsageError, VersionChanged
from cachefs.metrics import Metrics
from cachefs.namespace.catalog import Catalog
from cachefs.namespace.dirs import dir_prefix, split
from cachefs.packed.view import PackedView
from cachefs.ports import Port
from cachefs.store import ObjectInfo, ObjectStore
from cachefs.tiers.cache import FileVersion, Tiers
from cachefs.warm.globs import glob_regex, static_dir
from cachefs.warm.job import Bandwidth, FileWork, WarmJob, WarmSpec
from cachefs.warm.metrics import WarmupMetrics

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.25
MAX_UPLOAD_PATHS = 10_000_000


class Warmer:
    """Runs warm jobs (``cachefs warmup``, and the ``--prefetch-dataset`` watch) over ``tiers``."""

    @classmethod
    def from_config(cls, cfg, catalog: Catalog, tiers: Tiers, store: ObjectStore, metrics: Metrics, *,
                    packed: PackedView | None = None, first_read: Port | None = None,
                    shard_read: Port | None = None) -> "Warmer":
        """The warm engine of a mount (``cfg``: its MountConfig): GETs at most the connection
        pool less 8 (left to readers)."""
        return cls(catalog, tiers, store, metrics, packed=packed, max_concurrency=max(1, cfg.max_connections - 8),
                   immutable=cfg.immutable, dataset_watch=cfg.prefetch_dataset, dataset_budget=cfg.prefetch_budget,
                   shard_warm=cfg.shard_warm, first_read=first_read, shard_read=shard_read)

    def __init__(self, catalog: Catalog, tiers: Tiers, store: ObjectStore, metrics: Metrics, *,
                 packed: PackedView | None = None, max_concurrency: int, immutable: bool = False,
                 dataset_watch: bool = False, dataset_budget: int = 0, shard_warm: bool = False,
                 first_read: Port | None = None, shard_read: Port | None = None) -> None:
        self.catalog = catalog      # listings: what a dataset spec names
        self.packed = packed        # a packed dataset: its index names the shards to warm
        self.tiers = tiers
        self.store = store
        self.max_concurrency = max(1, max_concurrency)
        self.jobs: dict[str, WarmJob] = {}
        self.last: WarmJob | None = None
        self._uploads: dict[str, tuple[float, list[str]]] = {}
        self._list_limiter = trio.CapacityLimiter(8)
        self._nursery: trio.Nursery | None = None
        self._metrics = metrics.group(WarmupMetrics, lambda: list(self.jobs.values()))
        self.watcher = None
        if dataset_watch and immutable:
            from cachefs.warm.dataset_watch import DatasetWatcher
            self.watcher = DatasetWatcher(self, dataset_budget or tiers.disk_capacity // 2)
            if first_read is not None:
                first_read.connect(self.watcher.on_first_read)
        self.shards = None
        if shard_warm and packed is not None:
            from cachefs.warm.dataset_watch import ShardWatcher
            self.shards = ShardWatcher(self, dataset_budget or tiers.disk_capacity // 2)
            if shard_read is not None:
                shard_read.connect(self.shards.on_shard)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def start_soon(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the engine's nursery (the dataset watch records its jobs so)."""
        self._nursery.start_soon(fn, *args)

    def commands(self) -> dict[str, Callable[[dict], AsyncIterator[dict]]]:
        return {"warmup": self._warmup_command, "warmup_paths": self._paths_command,
                "warmup_check": self._check_command, "warmup_evict": self._evict_command,
                "warmup_unpin": self._unpin_command}

    def status(self) -> dict:
        return {"running": [j.report() for j in self.jobs.values()],
                "last": self.last.report("done") | {"failures": []} if self.last else None,
                "pinned": self.tiers.pinned(),
                # "dataset_prefetch" names the --prefetch-dataset option: users and tests read this key
                "dataset_prefetch": self.watcher.status() if self.watcher else None,
                "shard_warm": self.shards.status() if self.shards else None}

    # ---- control commands ------------------------------------------------------------------
    async def _paths_command(self, args: dict) -> AsyncIterator[dict]:
        """Receive a manifest in parts (a control request is at most 1 MiB)."""
        upload = str(args.get("upload") or uuid.uuid4().hex)
        now = time.monotonic()
        self._uploads = {k: v for k, v in self._uploads.items() if now - v[0] < 3600}
        paths = self._uploads.setdefault(upload, (now, []))[1]
        if len(paths) + len(args.get("paths", [])) > MAX_UPLOAD_PATHS:
            raise UsageError(f"a manifest may hold at most {MAX_UPLOAD_PATHS} paths")
        paths.extend(str(p) for p in args.get("paths", []))
        yield {"upload": upload, "count": len(paths)}

    def spec_of(self, args: dict) -> WarmSpec:
        uploaded = self._uploads.pop(args["upload"], (0, []))[1] if args.get("upload") else None
        try:
            spec = WarmSpec.from_args(args, uploaded)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not spec.paths and not spec.globs:
            raise UsageError("warmup: nothing to warm (no paths, globs or manifest entries)")
        return spec

    async def _warmup_command(self, args: dict) -> AsyncIterator[dict]:
        spec = self.spec_of(args)
        joined = spec.name in self.jobs
        job = self.start(spec, concurrency=int(args.get("concurrency") or 32),
                         bandwidth=args.get("bandwidth_limit"), force=bool(args.get("force")),
                         pin=bool(args.get("pin")), detach=bool(args.get("detach")),
                         label=str(args.get("label") or ""))
        yield {"event": "started", "joined": joined, "dataset": job.label or job.name,
               "concurrency": job.concurrency}
        if args.get("detach"):
            job.detached = True
            return
        job.subscribers += 1
        try:
            async for reply in self.follow(job):
                yield reply
        finally:
            job.subscribers -= 1
            if job.subscribers == 0 and not job.detached and not job.done.is_set():
                log.info("warmup of %s: its last client left; stopping", job.label or job.name)
                job.scope.cancel()

    async def follow(self, job: WarmJob) -> AsyncIterator[dict]:
        while not job.done.is_set():
            with trio.move_on_after(PROGRESS_INTERVAL):
                await job.done.wait()
            if not job.done.is_set():
                yield job.report()
        yield job.report("done")

    async def _check_command(self, args: dict) -> AsyncIterator[dict]:
        spec = self.spec_of(args)
        files, missing = await self.resolve(spec)
        yield self.check(files, missing) | {"event": "check", "pinned": spec.name in self.tiers.pinned()}

    async def _evict_command(self, args: dict) -> AsyncIterator[dict]:
        spec = self.spec_of(args)
        running = self.jobs.get(spec.name)
        if running is not None:
            running.scope.cancel()
            await running.done.wait()
        unpinned = self.tiers.unpin(spec.name)
        files, _ = await self.resolve(spec)
        blocks = evicted = 0
        for info in files:
            n, size = self.tiers.evict(FileVersion(info.path, info.etag, info.size))
            blocks += n
            evicted += size
        yield {"event": "evicted", "files": len(files), "blocks": blocks, "bytes": evicted, "unpinned": unpinned}

    async def _unpin_command(self, args: dict) -> AsyncIterator[dict]:
        spec = self.spec_of(args)
        yield {"event": "unpinned", "unpinned": self.tiers.unpin(spec.name), "dataset": spec.name}

    # ---- jobs ------------------------------------------------------------------------------
    def start(self, spec: WarmSpec, *, concurrency: int = 32, bandwidth: float | None = None,
              force: bool = False, pin: bool = False, detach: bool = False, label: str = "",
              budget: int | None = None, keep: bool = False) -> WarmJob:
        """The running job for ``spec`` (joined), or a new one started in the background;
        ``keep``: the blocks it fetches go to the memory tier too (``Tiers.warm``)."""
        job = self.jobs.get(spec.name)
        if job is not None:
            job.pin = job.pin or pin
            return job
        if self._nursery is None:
            raise UsageError("the daemon is not ready for warmups yet")
        job = WarmJob(spec, min(max(1, concurrency), self.max_concurrency),
                      float(bandwidth) if bandwidth else None, force, pin, budget, label, keep=keep,
                      detached=detach)
        self.jobs[spec.name] = job
        self._nursery.start_soon(self._run, job)
        return job

    async def _run(self, job: WarmJob) -> None:
        log.info("warmup of %s started (concurrency %d)", job.label or job.name, job.concurrency)
        try:
            with job.scope:
                await self._warm(job)
            if job.scope.cancelled_caught:
                job.state = "cancelled"
        except StoreError as exc:
            job.state, job.error = "failed", str(exc)
        except Exception as exc:     # a bug must not take the daemon down
            log.exception("warmup of %s failed", job.label or job.name)
            job.state, job.error = "failed", f"internal error: {exc}"
        finally:
            if job.pin and job.state == "done":
                self.tiers.pin(job.name, job.held)
            self.tiers.release(job.held)
            for version in job.warmed:              # large objects, whole for FUSE passthrough
                self.tiers.write_whole_soon(version)
            job.finished = time.monotonic()
            self.jobs.pop(job.name, None)
            self.last = job
            job.done.set()
            log.info("warmup of %s %s: %d files fetched (%d bytes), %d already cached, %d failed, %.1f s",
                     job.label or job.name, job.state, job.fetched_files, job.fetched_bytes,
                     job.cached_files, len(job.failures), job.elapsed())

    async def _warm(self, job: WarmJob) -> None:
        files, missing = await self.resolve(job.spec)
        for path in missing:
            job.fail(path, "no such file or directory")
        works = self._plan(job, files)
        if not self._fits(job):
            job.state = "refused"
            return
        job.state = "warming"
        send, recv = trio.open_memory_channel(job.concurrency)
        pace = Bandwidth(job.bandwidth)
        async with trio.open_nursery() as nursery:
            for _ in range(job.concurrency):
                nursery.start_soon(self._worker, job, recv.clone(), pace)
            recv.close()
            async with send:
                for work, indices in works:
                    for index in indices:
                        await send.send((work, work.version, index))
        job.state = "done"

    def _plan(self, job: WarmJob, files: list[ObjectInfo]) -> list[tuple[FileWork, list[int]]]:
        """Hold every block of the dataset; count what is cached; list the blocks to fetch."""
        works = []
        job.files, job.bytes = len(files), sum(f.size for f in files)
        for info in files:
            work = FileWork(info)
            todo = []
            self.tiers.hold(work.version, job.held)
            for block in self.tiers.check(work.version):
                if block.disk:
                    job.done_bytes += block.length
                else:
                    todo.append(block.index)
                    job.need_bytes += block.cost
            if todo:
                work.pending = len(todo)
                works.append((work, todo))
            else:
                self._file_done(job, work)
        return works

    def _fits(self, job: WarmJob) -> bool:
        job.room = self.tiers.room()
        limit = job.room["room"] if job.budget is None else min(job.room["room"], job.budget)
        if job.need_bytes <= limit or (job.force and job.budget is None):
            return True
        job.error = (f"the dataset needs {job.need_bytes} more bytes in the cache but only {limit} fit "
                     f"(capacity {job.room['capacity']}, {job.room['held']} held by pins and warmups"
                     + (f", budget {job.budget}" if job.budget is not None else "") + ")")
        return False

    async def _worker(self, job: WarmJob, recv, pace: Bandwidth) -> None:
        async with recv:
            async for work, version, index in recv:
                if version != work.version:
                    continue                  # the object changed: its new version is warmed apart
                if work.failed or job.cache_full:
                    self._skip(job, work)
                    continue
                await self._gate(job)
                try:
                    await pace.take(self._block_len(version, index))
                    await self._warm_block(job, work, version, index)
                finally:
                    job.active -= 1

    async def _gate(self, job: WarmJob) -> None:
        """Take a worker slot: all of them while readers are not queued, 1/8 while they are."""
        while True:
            limit = job.concurrency if not self.tiers.foreground_waiting() else max(1, job.concurrency // 8)
            if job.active < limit:
                job.active += 1
                return
            await trio.sleep(0.005)

    async def _warm_block(self, job: WarmJob, work: FileWork, version: FileVersion, index: int) -> None:
        try:
            fetched, cached = await self.tiers.warm(version, index, job.limiter, keep=job.keep)
        except VersionChanged:
            if version == work.version:
                await self._restart(job, work)
            return
        except StoreError as exc:
            if version == work.version and not work.failed:
                work.failed = True
                job.fail(version.path, str(exc))
                self._count_failed(job)
            return
        if version != work.version or work.failed:
            return
        if not cached:
            job.cache_full = True
            work.failed = True
            job.fail(version.path, "not cached: the cache is full (or its disk is failing)")
            self._count_failed(job)
            return
        work.fetched += fetched
        job.fetched_bytes += fetched
        job.done_bytes += self._block_len(version, index)
        work.pending -= 1
        if work.pending == 0:
            self._file_done(job, work)

    async def _restart(self, job: WarmJob, work: FileWork) -> None:
        """The object changed since it was listed: warm its new version instead (never a mix)."""
        old = work.version
        work.restarts += 1
        try:
            info = await trio.to_thread.run_sync(self.store.head, old.path, limiter=self._list_limiter)
        except StoreError as exc:
            work.failed = True
            job.fail(old.path, f"changed during the warmup, then: {exc}")
            self._count_failed(job)
            return
        log.info("warmup: %s changed in the store (ETag %s -> %s); warming the new version",
                 old.path, old.etag, info.etag)
        self.catalog.adopt_file(info)
        work.version = FileVersion(info.path, info.etag, info.size)
        job.bytes += info.size - old.size
        indices = range(self.tiers.block_count(work.version))
        work.pending = len(indices)
        self.tiers.hold(work.version, job.held)
        if work.restarts > 3:
            work.failed = True
            job.fail(old.path, "kept changing during the warmup")
            self._count_failed(job)
            return
        for index in indices:
            await self._warm_block(job, work, work.version, index)

    def _file_done(self, job: WarmJob, work: FileWork) -> None:
        job.done_files += 1
        if work.version.size >= self.tiers.block_size:
            job.warmed.append(work.version)
        if work.fetched or work.restarts:
            job.fetched_files += 1
            self._metrics.files.labels("fetched").inc()
            self._metrics.bytes.labels("fetched").inc(work.fetched)
        else:
            job.cached_files += 1
            job.cached_bytes += work.version.size
            self._metrics.files.labels("cached").inc()
            self._metrics.bytes.labels("cached").inc(work.version.size)

    def _count_failed(self, job: WarmJob) -> None:
        job.done_files += 1
        self._metrics.files.labels("failed").inc()

    def _skip(self, job: WarmJob, work: FileWork) -> None:
        if not work.failed:
            work.failed = True
            job.fail(work.version.path, "not cached: the cache is full")
            self._count_failed(job)

    # ---- datasets --------------------------------------------------------------------------
    async def resolve(self, spec: WarmSpec) -> tuple[list[ObjectInfo], list[str]]:
        """The objects a spec names (each once, in path order), and the paths that name nothing.
        On a packed dataset: the whole shards holding the files it names (fetched at link speed,
        one block GET after another, instead of file by file), with no LIST."""
        if self.packed is not None:
            return await trio.to_thread.run_sync(self.packed.resolve, spec.paths, spec.globs,
                                                 lambda g: (glob_regex(g), static_dir(g)),
                                                 limiter=self._list_limiter)
        found: dict[str, ObjectInfo] = {}
        missing = []
        for path in spec.paths:
            infos = await self._resolve_path(path)
            if not infos:
                missing.append(path or "/")
            found.update((i.path, i) for i in infos)
        for pattern in spec.globs:
            regex = glob_regex(pattern)
            infos = [i for i in await self._list_tree(static_dir(pattern)) if regex.match(i.path)]
            if not infos:
                missing.append(pattern)
            found.update((i.path, i) for i in infos)
        return [found[p] for p in sorted(found)], missing

    async def _resolve_path(self, path: str) -> list[ObjectInfo]:
        if not path:
            return await self._list_tree("")
        parent, name = split(path)
        try:
            state = await self.catalog.state(parent)
        except NoSuchKey:
            return []
        if name in state.dirs:
            return await self._list_tree(path)
        info = state.files.get(name)
        return [info] if info is not None else []

    async def _list_tree(self, path: str) -> list[ObjectInfo]:
        """One recursive (paginated) LIST of directory ``path``, adopted by the catalog."""
        started = time.time()
        infos = await trio.to_thread.run_sync(lambda: list(self.store.list_all(dir_prefix(path))),
                                              limiter=self._list_limiter)
        if infos:
            self.catalog.adopt_tree(path, infos, started)
        return infos

    def check(self, files: list[ObjectInfo], missing: list[str]) -> dict:
        """Files and bytes of a dataset cached per tier (no fetching)."""
        out = {"files": len(files), "bytes": sum(f.size for f in files), "cached_files": 0, "cached_bytes": 0,
               "memory": {"files": 0, "blocks": 0, "bytes": 0}, "disk": {"files": 0, "blocks": 0, "bytes": 0},
               "missing": missing}
        for info in files:
            version = FileVersion(info.path, info.etag, info.size)
            whole = {"memory": True, "disk": True, "any": True}
            for block in self.tiers.check(version):
                length, in_memory, on_disk = block.length, block.memory, block.disk
                for tier, there in (("memory", in_memory), ("disk", on_disk)):
                    out[tier]["blocks"] += there
                    out[tier]["bytes"] += length if there else 0
                    whole[tier] = whole[tier] and there
                whole["any"] = whole["any"] and (in_memory or on_disk)
                out["cached_bytes"] += length if in_memory or on_disk else 0
            out["cached_files"] += whole["any"]
            out["memory"]["files"] += whole["memory"]
            out["disk"]["files"] += whole["disk"]
        return out

    def _block_len(self, version: FileVersion, index: int) -> int:
        return self.tiers.block_len(version, index)
