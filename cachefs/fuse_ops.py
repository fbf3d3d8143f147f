"""The thin FUSE adapter: request -> vfs call -> answer. No logic lives here.

Handlers take and return the backend-neutral types of ``cachefs.fuse.types``; the FUSE layer
that speaks the wire (``cachefs.fuse.session``, or pyfuse3 through ``cachefs.fuse.pyfuse3_backend``)
encodes them. ``kernel`` is that layer's side for notifications (``notify_store``) and backing ids;
handing files to the kernel (passthrough) is the ``Passthrough`` half, in ``fuse_passthrough.py``.

``_operation`` is the one choke point where exceptions become ``FuseError``
(docs/design.md, invariant 7): each failure is logged once with its operation and
counted by errno; unexpected exceptions are logged with a traceback.
"""

import errno
import functools
import logging
import os
import stat
import struct
import time
from collections import OrderedDict, deque

from cachefs.control.protocol import CONTROL_NAME, IOCTL_RECEIVE, IOCTL_SEND
from cachefs.control.server import Control
from cachefs.errors import CachefsError, NeedsWait
from cachefs.fuse.backing import Backings
from cachefs.fuse.types import Attr, DirReply, FileInfo, FuseError, StatFs
from cachefs.fuse_metrics import FuseMetrics, TimingCache
from cachefs.fuse_passthrough import Passthrough
from cachefs.metrics import Metrics
from cachefs.namespace.vfs import CONTROL_INODE, ROOT_INODE, FsError, Node, Vfs
from cachefs.tiers.metrics import TierMetrics

log = logging.getLogger(__name__)

_IMMUTABLE_TIMEOUT = 24 * 3600.0
_QUIET_ERRNOS = {errno.ENOENT, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOSYS, errno.ENODATA,
                 errno.EEXIST, errno.ENOTEMPTY, errno.EXDEV, errno.EPERM, errno.EINVAL}


def _operation(name: str):
    """Count, time and map the errors of one FUSE handler."""

    def wrap(handler):
        @functools.wraps(handler)
        async def run(self: "Operations", *args):
            started = time.perf_counter()
            try:
                return await handler(self, *args)
            except FuseError as exc:
                self._failed(name, exc.errno)
                raise
            except (CachefsError, OSError) as exc:
                code = exc.errno or errno.EIO
                self._failed(name, code)
                level = logging.DEBUG if code in _QUIET_ERRNOS else logging.ERROR
                log.log(level, "%s%s: %s", name, _describe(self, args), exc)
                raise FuseError(code) from None
            except Exception:
                self._failed(name, errno.EIO)
                log.exception("%s%s: unexpected error", name, _describe(self, args))
                raise FuseError(errno.EIO) from None
            finally:
                self._timing[name].observe(time.perf_counter() - started)

        return run

    return wrap


def _fast_operation(name: str):
    """The synchronous fast path of one handler (``now_*``): counted and timed like the handler,
    errors mapped the same way; NeedsWait passes through (the session then runs the handler)."""

    def wrap(handler):
        @functools.wraps(handler)
        def run(self: "Operations", *args):
            started = time.perf_counter()
            try:
                result = handler(self, *args)
            except NeedsWait:
                raise
            except FuseError as exc:
                self._failed(name, exc.errno)
                self._timing[name].observe(time.perf_counter() - started)
                raise
            except (CachefsError, OSError) as exc:
                code = exc.errno or errno.EIO
                self._failed(name, code)
                log.log(logging.DEBUG if code in _QUIET_ERRNOS else logging.ERROR, "%s%s: %s", name,
                        _describe(self, args), exc)
                self._timing[name].observe(time.perf_counter() - started)
                raise FuseError(code) from None
            self._timing[name].observe(time.perf_counter() - started)
            return result

        return run

    return wrap


def _describe(ops: "Operations", args: tuple) -> str:
    """Name the object an operation was about, for the one log line of a failure."""
    target = args[0] if args else None
    if isinstance(target, int):
        handle = ops.vfs.handles.get(target)
        node = handle.node if handle else ops.vfs.find_node(target)
        if node is not None:
            return f" {node.path or '/'!r}"
    return ""


class Operations(Passthrough):
    @classmethod
    def from_config(cls, cfg, vfs: Vfs, control: Control, metrics: Metrics, kernel, *,
                    immutable: bool) -> "Operations":
        """The operations of a mount (``cfg``: its MountConfig; ``immutable``: the dataset never
        changes while mounted, by option or being packed). Files and directories belong to
        ``--uid``/``--gid``, else the user who mounts; idle backing files keep at most a quarter
        of the disk tier."""
        uid, gid = cfg.owner
        return cls(vfs, control, metrics, kernel, uid=uid, gid=gid, idle_backing_bytes=cfg.cache_size // 4,
                   idle_backings=cfg.fuse_idle_backings,
                   file_mode=cfg.file_mode, dir_mode=cfg.dir_mode, metadata_ttl=cfg.metadata_ttl,
                   immutable=immutable, open_ahead=cfg.fuse_open_ahead)

    def __init__(self, vfs: Vfs, control: Control, metrics: Metrics, kernel, *, uid: int, gid: int,
                 file_mode: int, dir_mode: int, metadata_ttl: float, immutable: bool,
                 idle_backing_bytes: int = 4 << 30, idle_backings: int = 262144, open_ahead: bool = True) -> None:
        self.kernel = kernel          # the FUSE layer: notify_store, and passthrough (backing_open/close)
        # backing files kept past their last release (a hot epoch reopens them): a quarter of the
        # disk tier at most, since they are held from eviction
        self.backings = Backings(self._close_backing, max_idle=idle_backings, max_idle_bytes=idle_backing_bytes)
        self.open_ahead = open_ahead      # a looked-up file's backing registered at LOOKUP (``_ahead``)
        self.vfs = vfs
        self.control = control
        self.metrics = metrics.group(FuseMetrics)
        self.served = metrics.group(TierMetrics)      # what passthrough serves is counted with the tiers'
        self.uid, self.gid = uid, gid
        self.file_mode, self.dir_mode = file_mode, dir_mode
        self.timeout = _IMMUTABLE_TIMEOUT if immutable else metadata_ttl
        self._implicit: dict[int, int] = {}          # inode -> the read handle of files opened with no OPEN
        self._implicit_control: OrderedDict[int, int] = OrderedDict()     # caller's thread -> control session
        self._timing = TimingCache(self.metrics)
        self._listed: deque[int] = deque()          # inodes a READDIRPLUS listed, registered ahead in ``idle``

    def _failed(self, name: str, code: int) -> None:
        self.metrics.fuse_errors.labels(name, errno.errorcode.get(code, str(code))).inc()

    # ---- attributes -------------------------------------------------------------------------
    def _attr(self, node: Node) -> Attr:
        mtime = int(node.mtime * 1e9)
        if node.is_dir:
            return Attr(node.inode, stat.S_IFDIR | self.dir_mode, 2, 0, 0, 128 * 1024, self.uid, self.gid,
                        mtime, mtime, mtime, self.timeout, self.timeout)
        mode = stat.S_IFREG | (stat.S_IMODE(node.mode) if node.mode is not None else self.file_mode)
        return Attr(node.inode, mode, 1, node.size, (node.size + 511) // 512, 128 * 1024, self.uid, self.gid,
                    mtime, mtime, mtime, self.timeout, self.timeout)

    def _control_attr(self) -> Attr:
        return Attr(ino=CONTROL_INODE, mode=stat.S_IFREG | 0o666, nlink=1, uid=self.uid, gid=self.gid,
                    entry_timeout=1.0, attr_timeout=1.0)

    @_operation("lookup")
    async def lookup(self, parent_inode, name, ctx=None):
        text = os.fsdecode(name)
        if parent_inode == ROOT_INODE and text == CONTROL_NAME:
            return self._control_attr()
        try:
            return self._attr(self._ahead(await self.vfs.lookup(parent_inode, text)))
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return Attr(ino=0, entry_timeout=self.timeout)     # ino 0: the kernel caches the miss

    @_fast_operation("lookup")
    def now_lookup(self, parent_inode, name):
        text = os.fsdecode(name)
        if parent_inode == ROOT_INODE and text == CONTROL_NAME:
            return self._control_attr()
        try:
            return self._attr(self._ahead(self.vfs.lookup_now(parent_inode, text)))
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return Attr(ino=0, entry_timeout=self.timeout)

    @_fast_operation("getattr")
    def now_getattr(self, inode):
        if inode == CONTROL_INODE:
            return self._control_attr()
        return self._attr(self.vfs.getattr_now(inode))

    @_fast_operation("open")
    def now_open(self, inode, flags, ctx):
        if inode == CONTROL_INODE:
            raise NeedsWait
        backing_id = self._hand_over_now(inode, flags)
        if backing_id:
            return self._handed_over(inode, flags, backing_id)
        handle, keep_cache = self.vfs.open_now(inode, flags)
        return FileInfo(fh=handle.fh, keep_cache=keep_cache)

    @_fast_operation("read")
    def now_read(self, fh, off, size):
        if self.control.owns(fh):
            raise NeedsWait
        return self.vfs.read_now(fh, off, size)

    @_fast_operation("release")
    def now_release(self, fh):
        if self.control.owns(fh):
            raise NeedsWait
        self.vfs.release_now(fh)
        self._unbind_backing(fh)

    @_operation("getattr")
    async def getattr(self, inode, ctx=None):
        if inode == CONTROL_INODE:
            return self._control_attr()
        return self._attr(await self.vfs.getattr(inode))

    def forget(self, inode_list):
        """FORGET and BATCH_FORGET (no answer): drop the kernel's references, and the idle backing
        file (or the read handle, ``implicit_fh``) of an inode the kernel no longer knows."""
        self._timing["forget"].observe(0.0)
        for inode, count in inode_list:
            self.vfs.forget(inode, count)
            if inode in self._implicit:
                node = self.vfs.find_node(inode)
                if node is None or node.lookups <= 0:
                    self.vfs.release_now(self._implicit.pop(inode))
            if inode in self.backings.by_inode and self.vfs.find_node(inode) is None:
                self.backings.forget(inode)

    # ---- files the kernel opens with no OPEN (zero-message opens: --fuse-no-open) ---------------
    def implicit_fh(self, inode: int, ctx, ioctl_cmd: int | None = None) -> int:
        """The handle of a request whose file the kernel opened without asking (its fh is 0): one
        read handle per inode (an --immutable mount: the version never changes), kept until the
        kernel forgets the inode; for the control file, one session per calling thread, a new one
        when a request begins after the last was answered (``ioctl_cmd``), at most 64 kept."""
        if inode == CONTROL_INODE:
            fh = self._implicit_control.get(ctx.pid)
            if fh is not None and self.control.owns(fh) and not (
                    ioctl_cmd == IOCTL_SEND and self.control.answering(fh)):
                return fh
            if fh is not None and self.control.owns(fh):
                self.control.release(fh)
            fh = self._implicit_control[ctx.pid] = self.control.open(ctx)
            self._implicit_control.move_to_end(ctx.pid)
            while len(self._implicit_control) > 64:
                self.control.release(self._implicit_control.popitem(last=False)[1])
            return fh
        fh = self._implicit.get(inode)
        if fh is None:
            try:
                handle, _ = self.vfs.open_now(inode, os.O_RDONLY, handed_over=True)   # nothing pushed at open
            except FsError as exc:                   # a node id the kernel should not have
                raise FuseError(exc.errno) from None
            except NeedsWait:                        # not on an --immutable mount: never
                raise FuseError(errno.EIO) from None
            fh = self._implicit[inode] = handle.fh
        return fh

    @_operation("statfs")
    async def statfs(self, ctx):
        data = StatFs(blocks=1 << 40, namelen=1024)
        stats = self.vfs.statfs()
        if stats.capacity is not None:      # writable: the room left in the staging area
            data.blocks = stats.capacity // data.frsize
            data.bfree = data.bavail = stats.free // data.frsize
        data.files = stats.inodes
        return data

    # ---- directories ------------------------------------------------------------------------
    @_operation("opendir")
    async def opendir(self, inode, ctx):
        return await self.vfs.opendir(inode)

    @_operation("readdir")
    async def readdir(self, fh, start_id, reply: DirReply):
        await self.vfs.dir_handle(fh)
        for name, node, next_id in self.vfs.readdir_entries(fh, start_id):
            if not reply.add(os.fsencode(name), self._attr(node), next_id):
                return
            if reply.plus:               # the kernel now holds the entry, as after a LOOKUP
                self.vfs.remember(node)
                if self._worth_ahead(node) and len(self._listed) < self.backings.max_idle:
                    self._listed.append(node.inode)      # its backing registered when idle (``idle``)
                    if len(self._listed) == 1:
                        self.kernel.idle_work()

    @_operation("releasedir")
    async def releasedir(self, fh):
        self.vfs.releasedir(fh)

    # ---- files ------------------------------------------------------------------------------
    @_operation("open")
    async def open(self, inode, flags, ctx):
        if inode == CONTROL_INODE:
            return FileInfo(fh=self.control.open(ctx), direct_io=True, nonseekable=True)
        backing_id = await self._hand_over(inode, flags)
        if backing_id:
            return self._handed_over(inode, flags, backing_id)
        handle, keep_cache = await self.vfs.open(inode, flags)
        if not keep_cache and not flags & (os.O_WRONLY | os.O_RDWR):
            data = await self.vfs.preload(handle)
            if data is not None and handle.node.opens == 1:
                # the pinned version's pages, stored before the open returns: the kernel keeps them
                # and serves the reads itself (one FUSE round trip less per small file). Only while
                # this is the inode's one handle (checked with no await before the store): a READ
                # of another handle holds its page locked until we answer it, and notify_store
                # blocks this thread on that lock, the whole mount with it (bug 7). With no other
                # handle no READ can be pending: the kernel sends RELEASE only after its last READ.
                self.kernel.notify_store(inode, 0, data)
                keep_cache = True
        return FileInfo(fh=handle.fh, keep_cache=keep_cache)

    @_operation("read")
    async def read(self, fh, off, size):
        if self.control.owns(fh):
            return await self.control.read(fh, size)
        return await self.vfs.read(fh, off, size)

    @_operation("write")
    async def write(self, fh, off, buf):
        if self.control.owns(fh):
            return self.control.write(fh, buf)
        return await self.vfs.write(fh, off, buf)

    def now_ioctl(self, fh, cmd):
        """Any ioctl but the control channel's is ENOTTY at once (CPython's ``open`` asks TCGETS
        of every file it opens: isatty)."""
        if self.control.owns(fh):
            raise NeedsWait
        raise FuseError(errno.ENOTTY)

    @_operation("ioctl")
    async def ioctl(self, fh, cmd, data, out_size):
        """The control channel of a read-only mount (``control.protocol``: IOCTL_SEND, IOCTL_RECEIVE);
        any other ioctl is ENOTTY."""
        if not self.control.owns(fh):
            raise FuseError(errno.ENOTTY)
        if cmd == IOCTL_SEND and len(data) >= 4:
            (length,) = struct.unpack_from("<I", data)
            self.control.write(fh, data[4:4 + length])
            return 0, b""
        if cmd == IOCTL_RECEIVE and out_size > 4:
            piece = await self.control.read(fh, out_size - 4)
            return 0, struct.pack("<I", len(piece)) + piece
        raise FuseError(errno.ENOTTY)

    @_operation("flush")
    async def flush(self, fh):
        raise FuseError(errno.ENOSYS)   # nothing to do at close: the kernel stops sending flush

    @_operation("fsync")
    async def fsync(self, fh, datasync):
        if not self.control.owns(fh):
            await self.vfs.fsync(fh)

    @_operation("release")
    async def release(self, fh):
        if self.control.owns(fh):
            self.control.release(fh)
        else:
            self._unbind_backing(fh)
            await self.vfs.release(fh)

    # ---- writes (docs/writeback.md) -------------------------------------------------------------
    @_operation("setattr")
    async def setattr(self, inode, attr, fields, fh, ctx):
        if inode == CONTROL_INODE:
            return self._control_attr()
        size = attr.size if fields.update_size else None
        mtime = attr.mtime_ns / 1e9 if fields.update_mtime else None
        return self._attr(await self.vfs.setattr(inode, size, mtime, fh))   # mode, owner: fixed by the mount

    @_operation("create")
    async def create(self, parent_inode, name, mode, flags, ctx):
        handle, node = await self.vfs.create(parent_inode, os.fsdecode(name), flags)
        return FileInfo(fh=handle.fh), self._attr(node)

    # A request the kernel sends again to a new daemon (``ctx.resent``: its first daemon died
    # answering it) may have been applied already: the error that only a second application
    # gives (EEXIST after mkdir, ENOENT after unlink, rmdir or rename) is its success, and the
    # node table is brought to what the journal says (the first daemon may have died between).
    @_operation("mkdir")
    async def mkdir(self, parent_inode, name, mode, ctx):
        try:
            return self._attr(await self.vfs.mkdir(parent_inode, os.fsdecode(name)))
        except FsError as exc:
            if not (ctx.resent and exc.errno == errno.EEXIST):
                raise
            node = await self.vfs.lookup(parent_inode, os.fsdecode(name))
            if not node.is_dir:
                raise
            return self._attr(node)

    @_operation("unlink")
    async def unlink(self, parent_inode, name, ctx):
        try:
            await self.vfs.unlink(parent_inode, os.fsdecode(name))
        except FsError as exc:
            if not (ctx.resent and exc.errno == errno.ENOENT):
                raise
            await self.vfs.unlinked_already(parent_inode, os.fsdecode(name))

    @_operation("rmdir")
    async def rmdir(self, parent_inode, name, ctx):
        try:
            await self.vfs.rmdir(parent_inode, os.fsdecode(name))
        except FsError as exc:
            if not (ctx.resent and exc.errno == errno.ENOENT):
                raise
            await self.vfs.unlinked_already(parent_inode, os.fsdecode(name))

    @_operation("rename")
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        try:
            await self.vfs.rename(parent_inode_old, os.fsdecode(name_old), parent_inode_new,
                                  os.fsdecode(name_new), flags)
        except FsError as exc:
            if not (ctx.resent and exc.errno == errno.ENOENT):
                raise
            await self.vfs.child(self.vfs.node(parent_inode_new), os.fsdecode(name_new))    # moved: there
            await self.vfs.renamed_already(parent_inode_old, os.fsdecode(name_old), parent_inode_new,
                                           os.fsdecode(name_new))

    # ---- what an object store cannot do ---------------------------------------------------------
    @_operation("mknod")
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise FsError(self._refusal(), "only regular files and directories")

    @_operation("symlink")
    async def symlink(self, parent_inode, name, target, ctx):
        raise FsError(self._refusal(), "symbolic links are not supported")

    @_operation("link")
    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise FsError(self._refusal(), "hard links are not supported")

    def _refusal(self) -> int:
        return errno.EPERM if self.vfs.writable else errno.EROFS
