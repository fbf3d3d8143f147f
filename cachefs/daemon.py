"""Daemon wiring: preflight checks, the tiers, the vfs, the FUSE session, metrics.

``serve(cfg, on_ready)`` runs one mount until it is unmounted or signalled.
``on_ready(None)`` is called once the kernel mount answers; a failure before
that raises a ``CachefsError`` and leaves nothing mounted. Start-up order is
torn down in reverse by the nursery and the ``finally`` clauses.

Under a keeper (``keeper.py``, ``link``) the daemon sends the keeper its FUSE descriptors once
mounted, writes down the kernel's ids (``namespace/ids.py``), and may be a successor: it then
adopts the live connection and its predecessor's ids instead of mounting. Asked to hand over
(``cachefs restart``), it stops reading requests, answers those in hand, and exits ``HANDOVER``.
"""

import logging
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import trio

from cachefs import __version__, fuse
from cachefs.config import FIXED_OPTIONS, MountConfig
from cachefs.control.commands import command_table
from cachefs.control.server import Control
from cachefs.errors import CacheDirError, CachefsError, ConfigError, MountpointError, NoSuchKey
from cachefs.fuse_metrics import FuseMetrics
from cachefs.fuse_ops import Operations
from cachefs.host import (
    CacheDirLock,
    check_cache_fs,
    check_fuse,
    check_mountpoint,
    find_mount,
    tune_kernel,
    tune_malloc,
)
from cachefs.keeper import HANDOVER, Link
from cachefs.metrics import Exporter, Metrics
from cachefs.namespace.catalog import Catalog
from cachefs.namespace.ids import IdLog
from cachefs.namespace.listahead import ListAhead
from cachefs.namespace.nodes import CONTROL_INODE
from cachefs.namespace.snapshot import ListingSnapshot
from cachefs.namespace.vfs import Vfs
from cachefs.packed.channel import LoaderChannel
from cachefs.packed.view import PackedMetrics, PackedView, open_packed
from cachefs.ports import Port
from cachefs.store import ObjectStore, store_of
from cachefs.store.metrics import StoreMetrics
from cachefs.tiers.cache import Tiers
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.metrics import TierMetrics
from cachefs.warm.engine import Warmer
from cachefs.warm.metrics import WarmupMetrics
from cachefs.writeback.engine import Writeback
from cachefs.writeback.journal import Journal
from cachefs.writeback.metrics import WritebackMetrics
from cachefs.writeback.policy import WritebackOptions

if TYPE_CHECKING:
    from cachefs.packfmt import Manifest, PackedIndex

log = logging.getLogger(__name__)


# ---- the daemon ---------------------------------------------------------------------------------
class Daemon:
    """The parts of one mount, built in order; ``status()`` feeds the control file."""

    def __init__(self, cfg: MountConfig, store: ObjectStore, metrics: Metrics,
                 packed: tuple["Manifest", "PackedIndex"] | None = None, link: Link | None = None) -> None:
        self.cfg = cfg
        self.link = link
        self.handing_over = False
        self.start_s = 0.0           # seconds from the keeper's word to a built daemon (a takeover's pause)
        no_passthrough = cfg.passthrough_wanted(packed is not None)
        if no_passthrough is not None:
            metrics.group(TierMetrics).passthrough_fallbacks.labels(no_passthrough).inc()
        cloned = Port("cloned")             # FUSE session -> the keeper (each request loop's descriptor)
        if link is not None:
            cloned.connect(link.clone)
        self.fuse = fuse.backend(cfg.fuse_backend, fuse.SessionOptions.from_config(
            cfg, passthrough=no_passthrough is None, kept=link is not None), cloned)
        self.store = store
        self.metrics = metrics
        self.started = time.time()
        self.exporter: Exporter | None = None
        self.disk = DiskTier.from_config(cfg, metrics, exact_files=no_passthrough is None)
        self.memory = MemoryTier(cfg.mem_cache_size, metrics)
        # The calls upward (cachefs/ports.py), wired here and nowhere else: who makes each, who answers.
        first_read = Port("first_read")     # Tiers -> Warmer's dataset watch (--prefetch-dataset)
        fetched = Port("fetched")           # Tiers -> PackedView's record check
        shard_read = Port("shard_read")     # PackedView -> Warmer's shard warm (--shard-warm)
        retired = Port("retired")           # Writeback -> Vfs (a staged file reached the store)
        barrier = Port("barrier")           # Writeback -> Vfs's listing snapshot (rows durable first)
        listed = Port("listed")             # Catalog -> Vfs (a listing taken: lay the staged changes over it)
        versioned = Port("versioned")       # Catalog -> Vfs (a warmup saw a newer version of a file)
        corrupted = Port("corrupted")       # Tiers' scrub -> Operations (a handed-over cache file is corrupt)
        self.tiers = Tiers.from_config(cfg, store, self.memory, self.disk, metrics, packed=packed is not None,
                                       first_read=first_read, fetched=fetched, corrupted=corrupted)
        # a packed dataset (cachefs pack): its index is the listing; read-only, immutable while mounted
        self.packed = (PackedView(store, *packed, self.tiers, metrics, fetched=fetched, shard_read=shard_read)
                       if packed is not None else None)
        self.immutable = immutable = cfg.immutable or self.packed is not None
        try:
            snapshot = ListingSnapshot(cfg.cache_dir, store.identity) if self.packed is None else None
        except (OSError, sqlite3.Error) as exc:
            raise CacheDirError(f"cache dir {cfg.cache_dir}: cannot write the listing snapshot ({exc})") from None
        self.writeback: Writeback | None = (_writeback(cfg, store, metrics, retired, barrier)
                                            if cfg.writable and self.packed is None else None)
        # the kernel's ids, written down for a successor (only where a keeper can start one)
        self.ids = (IdLog(os.path.join(cfg.cache_dir, "kernel-ids"), fresh=not link.takeover)
                    if link is not None else None)
        # every directory's listing: from the store, or from a packed dataset's index
        self.catalog = Catalog(self.packed if self.packed is not None else store, snapshot,
                               metadata_ttl=cfg.metadata_ttl, immutable=immutable,
                               replayed=self.writeback.replayed_dirs if self.writeback is not None else None,
                               listed=listed, versioned=versioned)
        self.vfs = Vfs(store, self.tiers, self.catalog, writeback=self.writeback, fsync_remote=cfg.fsync == "remote",
                       packed=self.packed, listed=listed, versioned=versioned, retired=retired, barrier=barrier,
                       ids=self.ids, generation=link.go.get("generation", 0) if link is not None else 0,
                       versioned_inodes=no_passthrough is None and not immutable)
        self.warmer = Warmer.from_config(cfg, self.catalog, self.tiers, store, metrics, packed=self.packed,
                                         first_read=first_read, shard_read=shard_read)
        commands = command_table(self.status, self.warmer.commands(),
                                 self._sync_command if self.writeback is not None else None,
                                 self._restart if link is not None else None)
        # packed mounts: local loaders read the cache files (cachefs.data), named in the handshake
        self.loader_channel = (LoaderChannel(cfg.cache_dir, self.packed, self.tiers, shard_read=shard_read)
                               if self.packed is not None else None)
        self.control = Control(lambda: self.vfs.new_fh(CONTROL_INODE), commands, owner_uid=cfg.owner[0],
                               advertised=self._advertised)
        self.lister = (ListAhead(self.catalog, store, cfg.list_ahead)      # folders listed at mount
                       if cfg.list_ahead and self.packed is None else None)
        self.ops = Operations.from_config(cfg, self.vfs, self.control, metrics, self.fuse.kernel, immutable=immutable)
        corrupted.connect(self.ops.cache_file_corrupt)
        if link is not None:
            metrics.takeovers.set(link.go.get("generation", 0))
        if link is not None and link.takeover:
            self.vfs.restore(list(self.ids.known.nodes.values()))
            self.ops.restore_backings(self.ids.known.backings)
            log.info("taking over %s: %d node id(s) and %d backing id(s) of the previous daemon", cfg.mountpoint,
                     len(self.ids.known.nodes), len(self.ids.known.backings))

    def _advertised(self) -> dict:
        """What the control handshake tells a client beyond the protocol: the loader channel, and
        whether the kernel keeps this mount's entries (immutable: `cachefs warmup` then lists what
        it warmed through the mount, so a first epoch opens it with no LOOKUP)."""
        return {"loader_channel": self.loader_channel.advertised() if self.loader_channel is not None else None,
                "immutable": self.immutable}

    def status(self) -> dict:
        m = self.metrics
        tiers = self.tiers.stats()
        requests = {}
        for metric in m.group(StoreMetrics).store_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['op']} {sample.labels['status']}"
                    requests[key] = int(sample.value)
        fuse = self.fuse.status()
        table = fuse.get("loop_processes") or {}      # files opened from the loops' table hold no handle here
        return {"version": __version__, "pid": os.getpid(), "url": self.cfg.url,
                "mountpoint": self.cfg.mountpoint, "cache_dir": self.cfg.cache_dir,
                "options": {name: getattr(self.cfg, name) for name in FIXED_OPTIONS},
                "log_level": self.cfg.log_level,
                "uptime_s": round(time.time() - self.started, 1),
                "metrics": self.exporter.address if self.exporter else None,
                "immutable": self.cfg.immutable, "block_size": self.tiers.block_size, "tiers": tiers,
                "store_requests": requests,
                "store_read_bytes": int(m.counter_value("cachefs_store_read_bytes_total")),
                "read_bytes": int(m.counter_value("cachefs_read_bytes_total")),
                "corrupt_blocks": int(m.counter_value("cachefs_corrupt_blocks_total")),
                "packed_crc_errors": int(m.counter_value("cachefs_packed_crc_errors_total")),
                "listing": self.lister.status() if self.lister else None,
                "open_files": len(self.vfs.handles) + table.get("open_files", 0),
                "fuse": fuse,
                "loader_fds": ({"socket": str(self.loader_channel.path), "served": self.loader_channel.served,
                                "warms": self.loader_channel.warms}
                               if self.loader_channel is not None and self.loader_channel.listening else None),
                "writeback": self.writeback.status() if self.writeback else None,
                "keeper": self.link.status() if self.link is not None else None,
                "warmup": self.warmer.status()}

    async def _restart(self, args: dict) -> AsyncIterator[dict]:
        """``cachefs restart``: the keeper starts a new daemon (with ``config``, if given), which
        takes the mount over once this one has handed it over."""
        self.link.restart(args.get("config"))
        yield {"pid": os.getpid(), "restarting": True}

    async def _sync_command(self, args: dict) -> AsyncIterator[dict]:
        from cachefs.writeback.commands import sync_command
        async for reply in sync_command(self.writeback, args):
            yield reply


def daemon_registry():
    """A registry holding every metric a daemon can export (the core's and each component's):
    docs/metrics.md is rendered from it (``python -m cachefs.metrics``)."""
    metrics = Metrics()
    for group in (TierMetrics, StoreMetrics, FuseMetrics, PackedMetrics, WritebackMetrics):
        metrics.group(group)
    metrics.group(WarmupMetrics, lambda: [])
    return metrics.registry


def serve(cfg: MountConfig, on_ready: Callable[[], None], link: Link | None = None) -> int:
    """Preflight, mount (or take over, ``link``), serve until unmounted. Raises CachefsError
    before ``on_ready``. Returns 0, or ``HANDOVER`` when the mount went to a successor.
    Under a keeper, what needs no lock and no network (the store and its credentials) is built
    before waiting for the keeper's word, so a standby takes over at once."""
    # Worker threads (disk reads, HTTP) hand results back to the busy trio thread: with the
    # default 5 ms GIL switch interval each waits up to 5 ms for it (a convoy); 0.2 ms keeps
    # a cold disk-tier read near its I/O time.
    sys.setswitchinterval(0.0002)
    tune_malloc()
    metrics = Metrics()
    metrics.describe_mount(cfg.mountpoint, cfg.url, cfg.volume_id)
    store = store_of(cfg, metrics=metrics)
    if link is not None:
        link.wait_go()          # a standby waits here
    started = time.monotonic()
    takeover = link is not None and link.takeover
    try:
        check_fuse()
        if not takeover:
            check_mountpoint(cfg.mountpoint)
        warning = check_cache_fs(cfg.cache_dir, cfg.cache_size, cfg.staging_path, cfg.disk_path)
        if warning:
            log.warning("%s", warning)
        lock = CacheDirLock(cfg.cache_dir)
    except BaseException:
        store.close()
        raise
    try:
        if not takeover:        # a live mount is served on whatever the store answers now
            check_store(store, cfg)
        packed = open_packed(store)
        if packed is not None:
            log.info("%s is a packed dataset (%d files in %d shards, generation %d): mounting its original tree "
                     "read-only (writes get EROFS)", cfg.url, packed[0].files, packed[0].shards, packed[0].generation)
        daemon = Daemon(cfg, store, metrics, packed, link)
        daemon.start_s = time.monotonic() - started
        try:
            trio.run(_serve, daemon, on_ready)
        except BaseExceptionGroup as group:
            raise _startup_error(group) from None
        if daemon.ids is not None:
            daemon.ids.close()
        return HANDOVER if daemon.handing_over else 0
    finally:
        store.close()
        lock.close()


def _writeback(cfg: MountConfig, store: ObjectStore, metrics: Metrics, retired: Port, barrier: Port) -> Writeback:
    """The write-back engine of a writable mount (its journal under ``cfg.staging_path``)."""
    try:
        journal = Journal(cfg.staging_path)
    except OSError as exc:
        raise CacheDirError(f"staging dir {cfg.staging_path}: {exc.strerror}") from None
    return Writeback(store, journal, WritebackOptions.from_config(cfg), metrics, retired=retired, barrier=barrier)


def check_store(store: ObjectStore, cfg: MountConfig) -> None:
    """The bucket must exist and answer. An empty prefix is a new output prefix for a writable mount
    (a training job's logs and checkpoints); for a read-only one it is most likely a typo."""
    try:
        store.check()
    except NoSuchKey as exc:
        if not cfg.writable and not cfg.allow_empty_prefix:
            raise NoSuchKey(f"{exc}; a read-only mount of an empty prefix is refused as a likely typo "
                            f"(--allow-empty-prefix mounts it anyway)") from None
        log.info("%s: mounting an empty prefix", exc)


def _startup_error(group: BaseExceptionGroup) -> BaseException:
    """A start-up failure raised inside the daemon's nursery arrives wrapped in an exception
    group: surface its CachefsError (for the one-line message and exit code), else the group."""
    matched, _ = group.split(CachefsError)
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched if matched is not None else group


async def _serve(daemon: Daemon, on_ready: Callable[[], None]) -> None:
    cfg = daemon.cfg
    begun = time.monotonic()
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.tiers.run)          # the memory and disk tiers, and readahead
        await nursery.start(daemon.warmer.run)
        if daemon.writeback is not None:
            await nursery.start(daemon.writeback.run)
        link = daemon.link
        if link is not None and link.takeover:
            daemon.vfs.show_staged()         # restored nodes of files the journal replay staged
            daemon.fuse.adopt(daemon.ops, link.fds, link.go["negotiated"], cfg.mountpoint)
        else:
            try:
                # read-only where nothing can be written (mountinfo shows it; the kernel refuses writes and
                # keeps atime out of passthrough); the control file then speaks by ioctl
                daemon.fuse.mount(daemon.ops, cfg.mountpoint, allow_other=cfg.allow_other,
                                  read_only=not daemon.vfs.writable)
            except OSError as exc:
                raise MountpointError(f"cannot mount at {cfg.mountpoint}: {exc.strerror or exc}") from None
        if link is not None:
            nursery.start_soon(_keeper_messages, daemon)
        stop = _Stop(daemon.fuse)
        unmount = True
        try:
            if cfg.metrics_port:
                try:
                    daemon.exporter = Exporter(daemon.metrics, cfg.metrics_host, cfg.metrics_port,
                                               before=daemon.fuse.settled)
                except OSError as exc:
                    raise ConfigError(f"metrics: {exc}") from None
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                nursery.start_soon(stop.on_signal, signals)
                if link is not None and link.takeover:
                    log.info("cachefs %s took over %s at %s (cache %s) in %.0f ms", __version__, cfg.url,
                             cfg.mountpoint, cfg.cache_dir, (daemon.start_s + time.monotonic() - begun) * 1000)
                else:
                    log.info("cachefs %s mounted %s at %s (cache %s)", __version__, cfg.url, cfg.mountpoint,
                             cfg.cache_dir)
                nursery.start_soon(_tune_then_ready, daemon, on_ready)
                if daemon.lister is not None:
                    nursery.start_soon(daemon.lister.run)
                if daemon.loader_channel is not None:
                    await nursery.start(daemon.loader_channel.run)
                await daemon.fuse.serve()
            unmount = stop.signalled and not daemon.handing_over    # otherwise the kernel side already unmounted
        finally:
            if daemon.exporter is not None:
                daemon.exporter.close()
            daemon.fuse.close(unmount=unmount)
            with trio.move_on_after(2 if daemon.handing_over else 30, shield=True):
                await daemon.tiers.wait_idle()    # queued cache fills reach the disk tier
            if daemon.writeback is not None and not daemon.handing_over:    # a successor replays the journal
                await _drain(daemon.writeback, cfg.drain_timeout)
            daemon.vfs.close()
            log.info("%s %s", "handed over" if daemon.handing_over else "unmounted", cfg.mountpoint)
            nursery.cancel_scope.cancel()


async def _drain(writeback: Writeback, timeout: float) -> None:
    """Upload what is staged before exiting; what is left stays in the journal for the next mount."""
    with trio.CancelScope(shield=True):
        writeback.request_sync()
        if not await writeback.wait_synced(None, timeout):
            left = writeback.pending()
            log.warning("stopping with %d file(s) (%d bytes) and %d operation(s) not yet uploaded; they stay "
                        "staged in the journal and upload at the next mount", left["files"], left["bytes"],
                        left["operations"])


async def _tune_then_ready(daemon: Daemon, on_ready: Callable[[], None]) -> None:
    """Once the kernel's INIT is answered (a stat through the mount returns), tune the
    connection (INIT would clamp an earlier readahead setting), give the keeper the connection's
    descriptors, and report ready. A successor has nothing to tune or give."""
    cfg, link = daemon.cfg, daemon.link
    if link is not None and link.takeover:
        _passthrough_settled(daemon)
        on_ready()
        return
    await trio.to_thread.run_sync(os.stat, cfg.mountpoint)
    _passthrough_settled(daemon)
    await trio.to_thread.run_sync(tune_kernel, cfg.mountpoint, cfg.fuse_read_ahead_kb, cfg.fuse_max_background)
    if link is not None:
        entry = find_mount(cfg.mountpoint)
        session = daemon.fuse.session
        if entry is not None:
            link.mounted(session.descriptors(), dict(session.negotiated.export(), inflight=session.inflight is not None),
                         entry[0])
    on_ready()


def _passthrough_settled(daemon: Daemon) -> None:
    """INIT settled whether the kernel takes cache files: without FUSE passthrough (a kernel
    that does not offer it: counted, reason ``kernel``), the tiers write no exact files (nor
    large objects whole) for nothing."""
    if daemon.tiers.handover.enabled and not daemon.fuse.kernel.passthrough:
        daemon.metrics.group(TierMetrics).passthrough_fallbacks.labels("kernel").inc()
        daemon.tiers.passthrough_off()


async def _keeper_messages(daemon: Daemon) -> None:
    """The keeper's word: ``stop`` (a successor stands ready: hand the mount over now)."""
    from cachefs.keeper import receive
    sock = daemon.link.sock
    while True:
        await trio.lowlevel.wait_readable(sock)
        message, fds = receive(sock)
        for fd in fds:
            os.close(fd)
        if message is None:
            log.warning("the keeper is gone: if this daemon dies now, the mount dies with it")
            return
        if message.get("kind") == "stop":
            log.info("handing %s over to a new daemon", daemon.cfg.mountpoint)
            daemon.handing_over = True
            daemon.fuse.stop_reading()
        elif message.get("kind") == "restart_failed":
            log.warning("the new daemon failed to start; this one keeps serving")


class _Stop:
    signalled = False

    def __init__(self, backend) -> None:
        self.backend = backend

    async def on_signal(self, signals) -> None:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            self.signalled = True
            self.backend.terminate()
            return
