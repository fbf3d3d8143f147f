"""A FUSE session over ``/dev/fuse``: INIT, the request loop, replies and notifications.

One trio task reads requests (the descriptor is non-blocking; it waits for it with trio) and
dispatches each by its opcode through one table. A handler that has a synchronous fast path
(``Operations.now_<op>``: state that needs no await) is answered at once, in the reading task;
the others run as trio tasks. Every reply is one ``writev``. The kernel's requests carry a unique
id; INTERRUPT cancels a request still waiting (a READ on a GET, a LOOKUP on a listing) and the
kernel gets EINTR; a request that has already been answered ignores it.

Errors: a handler's ``FuseError`` is its answer; an exception the ``Operations`` layer let through
is a bug and answers EIO (logged with its traceback); an opcode nobody serves answers ENOSYS; a
malformed request answers EINVAL. The session never dies of a request.
"""

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from cachefs.errors import CachefsError, NeedsWait
from cachefs.fuse import abi, mount
from cachefs.fuse.mount import MountOptions
from cachefs.fuse.types import Attr, Context, DirReply, FileInfo, FuseError, SetattrFields, StatFs

log = logging.getLogger(__name__)

_BURST = 16                  # requests answered in a row before the loop lets other tasks run
_INTERRUPTIBLE = {abi.READ, abi.LOOKUP, abi.GETATTR, abi.OPEN, abi.OPENDIR, abi.READDIR, abi.READDIRPLUS}
_NO_REPLY = {abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT}


Later = NeedsWait       # a fast path that cannot answer without waiting: the request goes to a task


@dataclass(frozen=True, slots=True)
class SessionOptions:
    max_background: int = 64
    congestion_threshold: int = 48
    passthrough: bool = False           # ask for FUSE_PASSTHROUGH (where the kernel offers it)
    readdirplus: bool = True
    loops: int = 0                      # extra request loops: threads reading cloned descriptors


@dataclass(slots=True)
class Negotiated:
    """What INIT settled: the protocol minor and the flags both sides agreed on."""

    minor: int = 0
    flags: int = 0
    kernel_flags: int = 0
    max_readahead: int = 0
    max_write: int = abi.MAX_WRITE

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)


class Request:
    __slots__ = ("opcode", "unique", "nodeid", "uid", "gid", "pid", "body", "fd")

    def __init__(self, data: memoryview, fd: int) -> None:
        self.fd = fd                  # the descriptor it was read from: its answer goes there
        (length, self.opcode, self.unique, self.nodeid, self.uid, self.gid, self.pid,
         _ext, _pad) = abi.IN_HEADER.unpack_from(data)
        self.body = data[abi.IN_HEADER.size:length]

    def ctx(self) -> Context:
        return Context(self.uid, self.gid, self.pid)

    def name(self, start: int = 0) -> bytes:
        """The NUL-terminated name at ``start`` of the body."""
        raw = bytes(self.body[start:])
        return raw[:raw.index(b"\0")] if b"\0" in raw else raw


def _ns(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def pack_attr(attr: Attr) -> tuple:
    return (attr.ino, attr.size, attr.blocks, attr.atime_ns // 1_000_000_000, attr.mtime_ns // 1_000_000_000,
            attr.ctime_ns // 1_000_000_000, attr.atime_ns % 1_000_000_000, attr.mtime_ns % 1_000_000_000,
            attr.ctime_ns % 1_000_000_000, attr.mode, attr.nlink, attr.uid, attr.gid, 0, attr.blksize, 0)


def entry_out(attr: Attr) -> bytes:
    entry_s, entry_ns = _ns(attr.entry_timeout)
    attr_s, attr_ns = _ns(attr.attr_timeout)
    return abi.ENTRY_OUT.pack(attr.ino, attr.generation, entry_s, attr_s, entry_ns, attr_ns, *pack_attr(attr))


def attr_out(attr: Attr) -> bytes:
    attr_s, attr_ns = _ns(attr.attr_timeout)
    return abi.ATTR_OUT.pack(attr_s, attr_ns, 0, *pack_attr(attr))


def open_out(info: FileInfo) -> bytes:
    if info.backing_id > 0:           # the kernel reads the backing file: no cache or direct-I/O flags beside it
        return abi.OPEN_OUT.pack(info.fh, abi.FOPEN_PASSTHROUGH | (abi.FOPEN_NOFLUSH if info.noflush else 0),
                                 info.backing_id)
    flags = ((abi.FOPEN_KEEP_CACHE if info.keep_cache else 0) | (abi.FOPEN_DIRECT_IO if info.direct_io else 0)
             | (abi.FOPEN_NONSEEKABLE if info.nonseekable else 0) | (abi.FOPEN_NOFLUSH if info.noflush else 0))
    return abi.OPEN_OUT.pack(info.fh, flags, 0)


class _DirBuffer(DirReply):
    """A READDIR(PLUS) answer under construction, at most ``size`` bytes."""

    __slots__ = ("parts", "used", "size", "plus")

    def __init__(self, size: int, plus: bool) -> None:
        self.parts: list[bytes] = []
        self.used, self.size, self.plus = 0, size, plus

    def add(self, name: bytes, attr: Attr, next_offset: int) -> bool:
        need = abi.dirent_size(len(name), self.plus)
        if self.used + need > self.size:
            return False
        dirent = abi.DIRENT.pack(attr.ino, next_offset, len(name), stat.S_IFMT(attr.mode) >> 12) + name
        dirent += b"\0" * (-len(dirent) % 8)
        self.parts.append(entry_out(attr) + dirent if self.plus else dirent)
        self.used += need
        return True


class Session:
    """One mount's connection. ``kernel`` side API for handlers: ``notify_store``,
    ``notify_inval_inode``, ``notify_inval_entry``; lifecycle: ``serve`` until the filesystem
    is unmounted or ``terminate`` is called."""

    def __init__(self, options: SessionOptions | None = None, fd: int = -1) -> None:
        self.fd = fd                  # set by ``mount`` (or given: a descriptor mounted elsewhere)
        self.options = options or SessionOptions()
        self.negotiated = Negotiated()
        self.ops = None
        self.requests = 0
        self.opcodes: dict[int, int] = {}       # requests read, by opcode
        self._running: dict[int, trio.CancelScope] = {}     # unique -> scope of an interruptible task
        self._nursery: trio.Nursery | None = None
        self._stop = False
        self._initialized = trio.Event()
        self._passthrough_refused = 0
        self._clones: list[int] = []
        self._inbox: list[tuple[bytes, int]] = []
        self._inbox_lock = threading.Lock()
        self._token = None
        self._table = self._build_table()

    def mount(self, mountpoint: str, options: MountOptions) -> None:
        self.fd = mount.mount(mountpoint, options)
        self.mountpoint = mountpoint

    def close(self, unmount: bool) -> None:
        """Detach the filesystem (when ``unmount``) and close the session's descriptor; with no
        other holder of it, the kernel ends the connection and no reader waits on it."""
        if unmount and getattr(self, "mountpoint", None):
            try:
                mount.unmount(self.mountpoint, lazy=True)
            except CachefsError as exc:
                log.warning("%s", exc)
        for fd in self._clones:
            os.close(fd)
        self._clones.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- the loop ------------------------------------------------------------------------------
    async def serve(self, ops, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until the filesystem is unmounted (the kernel ends the session) or
        ``terminate`` is called."""
        self.ops = ops
        os.set_blocking(self.fd, False)
        buf = bytearray(abi.BUFFER_SIZE)
        view = memoryview(buf)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            task_status.started()
            try:
                nursery.start_soon(self._start_loops)
                await self._loop(buf, view)
            finally:
                nursery.cancel_scope.cancel()
                self._nursery = None

    # ---- extra request loops: threads on cloned descriptors -----------------------------------------
    async def _start_loops(self) -> None:
        """After INIT, ``options.loops`` threads that each read requests from a clone of the
        session's descriptor (FUSE_DEV_IOC_CLONE) and hand them to the trio thread in batches:
        the reads (the kernel's copy of each request) leave the trio thread; one owner answers."""
        if self.options.loops <= 0:
            return
        await self._initialized.wait()
        for i in range(self.options.loops):
            try:
                fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
                fcntl.ioctl(fd, abi.DEV_IOC_CLONE, bytearray(struct.pack("<I", self.fd)))
            except OSError as exc:
                log.info("cannot clone the FUSE descriptor (%s): %d request loop(s) only", exc, i + 1)
                return
            self._clones.append(fd)
            threading.Thread(target=self._clone_loop, args=(fd,), name=f"fuse-loop-{i + 1}", daemon=True).start()
        log.info("%d extra FUSE request loop(s) on cloned descriptors", self.options.loops)

    def _clone_loop(self, fd: int) -> None:
        buf = bytearray(abi.BUFFER_SIZE)
        while not self._stop:
            try:
                length = os.readv(fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EINTR):
                    continue
                return                       # ENODEV: unmounted; EBADF: closed
            with self._inbox_lock:
                self._inbox.append((bytes(buf[:length]), fd))
                wake = len(self._inbox) == 1
            if wake:
                try:
                    self._token.run_sync_soon(self._drain_inbox)
                except trio.RunFinishedError:
                    return

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            batch, self._inbox = self._inbox, []
        for data, fd in batch:
            self.requests += 1
            self._dispatch(memoryview(data), fd)

    async def _loop(self, buf: bytearray, view: memoryview) -> None:
        burst = 0
        while not self._stop:
            try:
                length = os.readv(self.fd, [buf])
            except BlockingIOError:
                burst = 0
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except OSError as exc:
                if exc.errno == errno.ENODEV:         # unmounted: the session is over
                    return
                if exc.errno in (errno.ENOENT, errno.EINTR):   # a request interrupted before we read it
                    continue
                raise
            self.requests += 1
            self._dispatch(view[:length], self.fd)
            burst += 1
            if burst >= _BURST:
                burst = 0
                await trio.lowlevel.checkpoint()

    def terminate(self) -> None:
        """End ``serve`` (the filesystem stays mounted until unmounted)."""
        self._stop = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def wait_initialized(self) -> None:
        await self._initialized.wait()

    # ---- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, data: memoryview, fd: int) -> None:
        try:
            req = Request(data, fd)
        except struct.error:
            log.error("a malformed FUSE request (%d bytes) was dropped", len(data))
            return
        self.opcodes[req.opcode] = self.opcodes.get(req.opcode, 0) + 1
        entry = self._table.get(req.opcode)
        if entry is None:
            if req.opcode not in _NO_REPLY:
                self.reply_error(req, errno.ENOSYS)
            return
        try:
            entry(req)
        except FuseError as exc:
            self.reply_error(req, exc.errno)
        except (struct.error, ValueError, IndexError):
            log.error("malformed %s request: answered EINVAL", abi.OPCODE_NAMES.get(req.opcode), exc_info=True)
            self.reply_error(req, errno.EINVAL)
        except Exception:
            log.exception("FUSE %s failed: answered EIO", abi.OPCODE_NAMES.get(req.opcode))
            self.reply_error(req, errno.EIO)

    def _later(self, req: Request, work: Callable, encode: Callable) -> None:
        """Run ``await work()`` in a task and answer with ``encode(result)`` (bytes or None)."""
        self._nursery.start_soon(self._run, req, req.opcode in _INTERRUPTIBLE, work, encode,
                                 name=abi.OPCODE_NAMES.get(req.opcode, "fuse"))

    async def _run(self, req: Request, interruptible: bool, work: Callable, encode: Callable) -> None:
        scope = trio.CancelScope()
        if interruptible:
            self._running[req.unique] = scope
        try:
            with scope:
                result = await work()
            if scope.cancelled_caught:
                self.reply_error(req, errno.EINTR)
                return
            self.reply(req, encode(result))
        except FuseError as exc:
            self.reply_error(req, exc.errno)
        except Exception:
            log.exception("a FUSE request failed: answered EIO")
            self.reply_error(req, errno.EIO)
        finally:
            self._running.pop(req.unique, None)

    def _answer(self, req: Request, now: Callable | None, later: Callable, encode: Callable) -> None:
        """The fast path ``now()`` if there is one and it needs no wait, else ``later()`` in a task."""
        if now is not None:
            try:
                result = now()
            except Later:
                pass
            else:
                self.reply(req, encode(result))
                return
        self._later(req, later, encode)

    # ---- replies -------------------------------------------------------------------------------
    def reply(self, req: "Request", payload=None) -> None:
        """Answer ``req`` on the descriptor it was read from (each has its own queue of requests
        in flight: an answer on another one finds no request)."""
        unique = req.unique
        if payload is None:
            self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, 0, unique)])
        elif isinstance(payload, list):
            size = abi.OUT_HEADER.size + sum(len(p) for p in payload)
            self._send(req.fd, [abi.OUT_HEADER.pack(size, 0, unique), *payload])
        else:
            self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), 0, unique), payload])

    def reply_error(self, req: "Request", code: int) -> None:
        self._send(req.fd, [abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -code, req.unique)])

    def _send(self, fd: int, parts: list) -> None:
        try:
            os.writev(fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted or the connection aborted meanwhile: nobody waits
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED):
                log.error("cannot answer a FUSE request: %s", exc)

    # ---- passthrough (the kernel side API for handlers) ---------------------------------------------
    @property
    def passthrough(self) -> bool:
        """The kernel agreed to FUSE passthrough and no hand-over has been refused for good."""
        return self.negotiated.has(abi.PASSTHROUGH) and not self._passthrough_refused

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` as a backing file; the id to answer an OPEN with. OSError when the
        kernel refuses; EPERM (no CAP_SYS_ADMIN) turns passthrough off for the session."""
        arg = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        try:
            return fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, arg)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                self._passthrough_refused = exc.errno
                log.info("FUSE passthrough refused by the kernel (%s): every read goes through the daemon",
                         os.strerror(exc.errno))
            raise

    def backing_close(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.ENOENT, errno.ENOTCONN):
                log.warning("closing FUSE backing id %d: %s", backing_id, exc)

    # ---- notifications (the kernel side API for handlers) -----------------------------------------
    def notify_store(self, ino: int, offset: int, data: bytes) -> None:
        """Put ``data`` into the kernel page cache of ``ino`` at ``offset``."""
        body = abi.NOTIFY_STORE_OUT.pack(ino, offset, len(data), 0)
        self._notify(abi.NOTIFY_STORE, [body, data])

    def notify_inval_inode(self, ino: int, offset: int = 0, length: int = 0) -> None:
        """Drop ``ino``'s cached attributes and pages (``length`` 0: to the end)."""
        self._notify(abi.NOTIFY_INVAL_INODE, [abi.NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)])

    def notify_inval_entry(self, parent: int, name: bytes) -> None:
        """Drop the kernel's cached entry ``name`` in directory ``parent``."""
        self._notify(abi.NOTIFY_INVAL_ENTRY, [abi.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0), name + b"\0"])

    def _notify(self, code: int, parts: list) -> None:
        size = abi.OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [abi.OUT_HEADER.pack(size, code, 0), *parts])
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.ENOTCONN):
                raise FuseError(exc.errno) from None

    # ---- the opcodes -----------------------------------------------------------------------------
    def _build_table(self) -> dict[int, Callable[[Request], None]]:
        return {abi.INIT: self._init, abi.DESTROY: self._destroy, abi.LOOKUP: self._lookup,
                abi.FORGET: self._forget, abi.BATCH_FORGET: self._batch_forget, abi.GETATTR: self._getattr,
                abi.SETATTR: self._setattr, abi.OPEN: self._open, abi.READ: self._read, abi.WRITE: self._write,
                abi.FLUSH: self._flush, abi.RELEASE: self._release, abi.FSYNC: self._fsync,
                abi.OPENDIR: self._opendir, abi.READDIR: self._readdir, abi.READDIRPLUS: self._readdirplus,
                abi.RELEASEDIR: self._releasedir, abi.FSYNCDIR: self._fsyncdir, abi.STATFS: self._statfs,
                abi.CREATE: self._create, abi.MKDIR: self._mkdir, abi.MKNOD: self._mknod, abi.UNLINK: self._unlink,
                abi.RMDIR: self._rmdir, abi.RENAME: self._rename, abi.RENAME2: self._rename2, abi.LINK: self._link,
                abi.SYMLINK: self._symlink, abi.INTERRUPT: self._interrupt, abi.IOCTL: self._ioctl}

    def _init(self, req: Request) -> None:
        major, minor, max_readahead, flags = abi.INIT_IN_OLD.unpack_from(req.body)
        if major != abi.KERNEL_MAJOR or minor < abi.MIN_KERNEL_MINOR:
            log.error("the kernel speaks FUSE %d.%d; cachefs needs 7.%d or newer", major, minor, abi.MIN_KERNEL_MINOR)
            self.reply_error(req, errno.EPROTO)
            return
        if flags & abi.INIT_EXT and len(req.body) >= abi.INIT_IN.size:
            flags |= abi.INIT_IN.unpack_from(req.body)[4] << 32
        want = (abi.ASYNC_READ | abi.PARALLEL_DIROPS | abi.AUTO_INVAL_DATA | abi.ASYNC_DIO | abi.ATOMIC_O_TRUNC
                | abi.BIG_WRITES | abi.MAX_PAGES | abi.INIT_EXT)
        if self.options.readdirplus:
            want |= abi.DO_READDIRPLUS | abi.READDIRPLUS_AUTO
        if self.options.passthrough:
            want |= abi.PASSTHROUGH
        agreed = flags & want
        n = self.negotiated
        n.minor, n.flags, n.kernel_flags, n.max_readahead = min(minor, abi.KERNEL_MINOR), agreed, flags, max_readahead
        if self.options.passthrough and not agreed & abi.PASSTHROUGH:
            log.info("the kernel (FUSE 7.%d) does not offer passthrough: every read goes through the daemon", minor)
        out = abi.INIT_OUT.pack(abi.KERNEL_MAJOR, n.minor, max_readahead, agreed & 0xFFFFFFFF,
                                self.options.max_background, self.options.congestion_threshold, n.max_write,
                                1, abi.MAX_PAGES_VALUE, 0, agreed >> 32, 1 if agreed & abi.PASSTHROUGH else 0)
        if n.minor < 23:
            out = out[:24]                    # the 7.22 layout: no time_gran, max_pages or flags2
        self.reply(req, out)
        log.info("FUSE 7.%d (kernel 7.%d): %s", n.minor, minor, abi.flag_names(agreed))
        self._initialized.set()

    def _destroy(self, req: Request) -> None:
        self.reply(req)
        self._stop = True

    def _lookup(self, req: Request) -> None:
        name, ops = req.name(), self.ops
        now = getattr(ops, "now_lookup", None)
        self._answer(req, now and (lambda: now(req.nodeid, name)), lambda: ops.lookup(req.nodeid, name, req.ctx()),
                     entry_out)

    def _forget(self, req: Request) -> None:
        self.ops.forget([(req.nodeid, abi.FORGET_IN.unpack_from(req.body)[0])])

    def _batch_forget(self, req: Request) -> None:
        count, _ = abi.BATCH_FORGET_IN.unpack_from(req.body)
        base = abi.BATCH_FORGET_IN.size
        self.ops.forget([abi.FORGET_ONE.unpack_from(req.body, base + i * abi.FORGET_ONE.size) for i in range(count)])

    def _getattr(self, req: Request) -> None:
        ops = self.ops
        now = getattr(ops, "now_getattr", None)
        self._answer(req, now and (lambda: now(req.nodeid)), lambda: ops.getattr(req.nodeid, req.ctx()), attr_out)

    def _setattr(self, req: Request) -> None:
        (valid, _, fh, size, _owner, atime, mtime, ctime, atime_ns, mtime_ns, ctime_ns, mode, _, uid, gid,
         _) = abi.SETATTR_IN.unpack_from(req.body)
        attr = Attr(mode=mode, size=size, uid=uid, gid=gid, atime_ns=atime * 1_000_000_000 + atime_ns,
                    mtime_ns=mtime * 1_000_000_000 + mtime_ns, ctime_ns=ctime * 1_000_000_000 + ctime_ns)
        if valid & abi.FATTR_MTIME_NOW:
            attr.mtime_ns = time.time_ns()
        fields = SetattrFields(update_size=bool(valid & abi.FATTR_SIZE),
                               update_mtime=bool(valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW)),
                               update_mode=bool(valid & abi.FATTR_MODE), update_uid=bool(valid & abi.FATTR_UID),
                               update_gid=bool(valid & abi.FATTR_GID),
                               update_atime=bool(valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW)))
        handle = fh if valid & abi.FATTR_FH else None
        self._later(req, lambda: self.ops.setattr(req.nodeid, attr, fields, handle, req.ctx()), attr_out)

    def _open(self, req: Request) -> None:
        flags, _ = abi.OPEN_IN.unpack_from(req.body)
        ops = self.ops
        now = getattr(ops, "now_open", None)
        self._answer(req, now and (lambda: now(req.nodeid, flags, req.ctx())),
                     lambda: ops.open(req.nodeid, flags, req.ctx()), open_out)

    def _read(self, req: Request) -> None:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(req.body)
        ops = self.ops
        now = getattr(ops, "now_read", None)
        self._answer(req, now and (lambda: now(fh, offset, size)), lambda: ops.read(fh, offset, size), _data)

    def _write(self, req: Request) -> None:
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(req.body)
        data = bytes(req.body[abi.WRITE_IN.size:abi.WRITE_IN.size + size])
        self._later(req, lambda: self.ops.write(fh, offset, data), lambda n: abi.WRITE_OUT.pack(n, 0))

    def _flush(self, req: Request) -> None:
        fh = abi.FLUSH_IN.unpack_from(req.body)[0]
        self._later(req, lambda: self.ops.flush(fh), _empty)

    def _release(self, req: Request) -> None:
        fh = abi.RELEASE_IN.unpack_from(req.body)[0]
        ops = self.ops
        now = getattr(ops, "now_release", None)
        self._answer(req, now and (lambda: now(fh)), lambda: ops.release(fh), _empty)

    def _fsync(self, req: Request) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        self._later(req, lambda: self.ops.fsync(fh, bool(flags & 1)), _empty)

    def _opendir(self, req: Request) -> None:
        self._later(req, lambda: self.ops.opendir(req.nodeid, req.ctx()), lambda fh: open_out(FileInfo(fh)))

    def _readdir(self, req: Request, plus: bool = False) -> None:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(req.body)
        buffer = _DirBuffer(size, plus)

        async def work():
            await self.ops.readdir(fh, offset, buffer)
            return buffer.parts
        self._later(req, work, lambda parts: parts)

    def _readdirplus(self, req: Request) -> None:
        self._readdir(req, plus=True)

    def _releasedir(self, req: Request) -> None:
        fh = abi.RELEASE_IN.unpack_from(req.body)[0]
        self._later(req, lambda: self.ops.releasedir(fh), _empty)

    def _fsyncdir(self, req: Request) -> None:
        self.reply(req)

    def _statfs(self, req: Request) -> None:
        self._later(req, lambda: self.ops.statfs(req.ctx()), _statfs_out)

    def _create(self, req: Request) -> None:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(req.body)
        name = req.name(abi.CREATE_IN.size)
        self._later(req, lambda: self.ops.create(req.nodeid, name, mode, flags, req.ctx()),
                    lambda result: entry_out(result[1]) + open_out(result[0]))

    def _mkdir(self, req: Request) -> None:
        mode, _umask = abi.MKDIR_IN.unpack_from(req.body)
        name = req.name(abi.MKDIR_IN.size)
        self._later(req, lambda: self.ops.mkdir(req.nodeid, name, mode, req.ctx()), entry_out)

    def _mknod(self, req: Request) -> None:
        mode, rdev, _umask, _ = abi.MKNOD_IN.unpack_from(req.body)
        name = req.name(abi.MKNOD_IN.size)
        self._later(req, lambda: self.ops.mknod(req.nodeid, name, mode, rdev, req.ctx()), entry_out)

    def _unlink(self, req: Request) -> None:
        name = req.name()
        self._later(req, lambda: self.ops.unlink(req.nodeid, name, req.ctx()), _empty)

    def _rmdir(self, req: Request) -> None:
        name = req.name()
        self._later(req, lambda: self.ops.rmdir(req.nodeid, name, req.ctx()), _empty)

    def _rename(self, req: Request) -> None:
        newdir = abi.RENAME_IN.unpack_from(req.body)[0]
        self._do_rename(req, newdir, 0, abi.RENAME_IN.size)

    def _rename2(self, req: Request) -> None:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(req.body)
        self._do_rename(req, newdir, flags, abi.RENAME2_IN.size)

    def _do_rename(self, req: Request, newdir: int, flags: int, start: int) -> None:
        old, new = bytes(req.body[start:]).split(b"\0")[:2]
        self._later(req, lambda: self.ops.rename(req.nodeid, old, newdir, new, flags, req.ctx()), _empty)

    def _link(self, req: Request) -> None:
        old = abi.LINK_IN.unpack_from(req.body)[0]
        name = req.name(abi.LINK_IN.size)
        self._later(req, lambda: self.ops.link(old, req.nodeid, name, req.ctx()), entry_out)

    def _symlink(self, req: Request) -> None:
        name, target = bytes(req.body).split(b"\0")[:2]
        self._later(req, lambda: self.ops.symlink(req.nodeid, name, target, req.ctx()), entry_out)

    def _ioctl(self, req: Request) -> None:
        fh, _flags, cmd, _arg, in_size, out_size = abi.IOCTL_IN.unpack_from(req.body)
        data = bytes(req.body[abi.IOCTL_IN.size:abi.IOCTL_IN.size + in_size])
        ioctl, now = getattr(self.ops, "ioctl", None), getattr(self.ops, "now_ioctl", None)
        if ioctl is None:
            raise FuseError(errno.ENOTTY)
        self._answer(req, now and (lambda: now(fh, cmd)), lambda: ioctl(fh, cmd, data, out_size),
                     lambda answer: [abi.IOCTL_OUT.pack(answer[0], 0, 0, 0), answer[1][:out_size]])

    def _interrupt(self, req: Request) -> None:
        target = abi.INTERRUPT_IN.unpack_from(req.body)[0]
        scope = self._running.get(target)
        if scope is not None:
            scope.cancel()            # its task answers EINTR; an unknown unique was answered already


def _empty(_result) -> None:
    return None


def _data(result):
    return result if result else None


def _statfs_out(st: StatFs) -> bytes:
    return abi.STATFS_OUT.pack(st.blocks, st.bfree, st.bavail, st.files, st.ffree, st.bsize, st.namelen,
                               st.frsize, 0)
