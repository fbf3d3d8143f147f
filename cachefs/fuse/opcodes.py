"""The requests of the FUSE protocol, one method each, and the encoding of their answers.

``Opcodes`` is a part of ``Session`` (a base class of it): one dispatch table maps each opcode
to a method that decodes the request body (``abi``'s structs) and either answers at once or asks
the session to run the handler as a task (``_answer``: the ``now_*`` fast path first; ``_later``).
The encoders turn the handlers' types (``types``) into the kernel's structs.
"""

from __future__ import annotations

import errno
import logging
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.fuse import abi
from cachefs.fuse.looptable import LOOP_FH
from cachefs.fuse.types import Attr, DirReply, FileInfo, FuseError, SetattrFields, StatFs

if TYPE_CHECKING:
    from cachefs.fuse.session import Request

log = logging.getLogger("cachefs.fuse.session")


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


class Opcodes:
    """The per-opcode methods of ``Session`` (see the module docstring)."""

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
        if self.options.no_open:
            want |= abi.NO_OPEN_SUPPORT
        agreed = flags & want
        n = self.negotiated
        n.minor, n.flags, n.kernel_flags, n.max_readahead = min(minor, abi.KERNEL_MINOR), agreed, flags, max_readahead
        if self.options.no_open and not agreed & abi.NO_OPEN_SUPPORT:
            log.info("the kernel (FUSE 7.%d) does not offer zero-message opens: every open asks the daemon", minor)
        if self.options.passthrough and not agreed & abi.PASSTHROUGH:
            log.info("the kernel (FUSE 7.%d) does not offer passthrough: every read goes through the daemon", minor)
        out = abi.INIT_OUT.pack(abi.KERNEL_MAJOR, n.minor, max_readahead, agreed & 0xFFFFFFFF,
                                self.options.max_background, self.options.congestion_threshold, n.max_write,
                                1, abi.MAX_PAGES_VALUE, 0, agreed >> 32, 1 if agreed & abi.PASSTHROUGH else 0)
        self.reply(req, out)
        log.info("FUSE 7.%d (kernel 7.%d): %s", n.minor, minor, abi.flag_names(agreed))
        self.initialized()

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
        if self.negotiated.has(abi.NO_OPEN_SUPPORT):
            self.reply_error(req, errno.ENOSYS)     # the kernel opens every file itself from now on
            return
        flags, _ = abi.OPEN_IN.unpack_from(req.body)      # (a published backing's: the table answered it)
        ops = self.ops
        now = getattr(ops, "now_open", None)
        self._answer(req, now and (lambda: now(req.nodeid, flags, req.ctx())),
                     lambda: ops.open(req.nodeid, flags, req.ctx()), open_out)

    def _read(self, req: Request) -> None:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(req.body)
        if fh == 0:                      # opened with no OPEN (zero-message opens)
            fh = self.ops.implicit_fh(req.nodeid, req.ctx())
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
        if fh & LOOP_FH:                 # a table handle of an earlier daemon (ours: the table answered it)
            self.reply(req)
            return
        ops = self.ops
        now = getattr(ops, "now_release", None)
        self._answer(req, now and (lambda: now(fh)), lambda: ops.release(fh), _empty)

    def _fsync(self, req: Request) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(req.body)
        if fh & LOOP_FH:                 # a file opened from the loops' table: read-only, nothing to sync
            self.reply(req)
            return
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
        if fh & LOOP_FH:
            raise FuseError(errno.ENOTTY)
        data = bytes(req.body[abi.IOCTL_IN.size:abi.IOCTL_IN.size + in_size])
        if fh == 0 and hasattr(self.ops, "implicit_fh"):      # opened with no OPEN
            fh = self.ops.implicit_fh(req.nodeid, req.ctx(), cmd)
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
