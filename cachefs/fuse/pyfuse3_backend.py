"""The fallback FUSE backend: pyfuse3 (libfuse 3) speaks the wire, ``fuse_ops`` answers.

``--fuse-backend pyfuse3`` serves a mount through pyfuse3's trio loop as cachefs did before it had
its own kernel-protocol layer. It cannot pass files through, clone request loops or hand a mount
to another process. Kept for one release; the FUSE tests run against both backends.
"""

import errno
import functools

import pyfuse3

from cachefs.fuse.types import Attr, Context, DirReply, FileInfo, FuseError, SetattrFields, StatFs


def _entry(attr: Attr) -> pyfuse3.EntryAttributes:
    out = pyfuse3.EntryAttributes()
    out.st_ino = attr.ino
    out.generation = attr.generation
    out.entry_timeout, out.attr_timeout = attr.entry_timeout, attr.attr_timeout
    if attr.ino:
        out.st_mode, out.st_nlink, out.st_size, out.st_blocks = attr.mode, attr.nlink, attr.size, attr.blocks
        out.st_blksize, out.st_uid, out.st_gid = attr.blksize, attr.uid, attr.gid
        out.st_atime_ns, out.st_mtime_ns, out.st_ctime_ns = attr.atime_ns, attr.mtime_ns, attr.ctime_ns
    return out


def _info(info: FileInfo) -> pyfuse3.FileInfo:
    return pyfuse3.FileInfo(fh=info.fh, keep_cache=info.keep_cache, direct_io=info.direct_io,
                            nonseekable=info.nonseekable)


def _statvfs(st: StatFs) -> pyfuse3.StatvfsData:
    out = pyfuse3.StatvfsData()
    out.f_bsize, out.f_frsize, out.f_blocks = st.bsize, st.frsize, st.blocks
    out.f_bfree, out.f_bavail, out.f_files = st.bfree, st.bavail, st.files
    out.f_ffree = out.f_favail = st.ffree
    out.f_namemax = st.namelen
    return out


def _ctx(ctx) -> Context:
    return Context(int(ctx.uid), int(ctx.gid), int(ctx.pid), int(getattr(ctx, "umask", 0o022)))


def _translated(handler):
    """Our FuseError as pyfuse3's FUSEError."""
    @functools.wraps(handler)
    async def run(*args):
        try:
            return await handler(*args)
        except FuseError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
    return run


class _Dir(DirReply):
    __slots__ = ("token",)

    def __init__(self, token) -> None:
        self.token = token

    def add(self, name: bytes, attr: Attr, next_offset: int) -> bool:
        return bool(pyfuse3.readdir_reply(self.token, name, _entry(attr), next_offset))


class Kernel:
    """The notifications ``fuse_ops`` sends, through pyfuse3 (which cannot pass files through)."""

    passthrough = False

    def notify_store(self, ino: int, offset: int, data: bytes) -> None:
        pyfuse3.notify_store(ino, offset, data)

    def notify_inval_inode(self, ino: int, offset: int = 0, length: int = 0) -> None:
        pyfuse3.invalidate_inode(ino, attr_only=False)

    def notify_inval_entry(self, parent: int, name: bytes) -> None:
        pyfuse3.invalidate_entry_async(parent, name)


class Adapter(pyfuse3.Operations):
    """pyfuse3's Operations in front of ours."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, ops) -> None:
        super().__init__()
        self.ops = ops

    @_translated
    async def lookup(self, parent_inode, name, ctx=None):
        return _entry(await self.ops.lookup(parent_inode, name, _ctx(ctx) if ctx else None))

    @_translated
    async def getattr(self, inode, ctx=None):
        return _entry(await self.ops.getattr(inode, _ctx(ctx) if ctx else None))

    async def forget(self, inode_list):
        self.ops.forget(list(inode_list))

    @_translated
    async def statfs(self, ctx):
        return _statvfs(await self.ops.statfs(_ctx(ctx)))

    @_translated
    async def opendir(self, inode, ctx):
        return await self.ops.opendir(inode, _ctx(ctx))

    @_translated
    async def readdir(self, fh, start_id, token):
        await self.ops.readdir(fh, start_id, _Dir(token))

    @_translated
    async def releasedir(self, fh):
        await self.ops.releasedir(fh)

    @_translated
    async def open(self, inode, flags, ctx):
        return _info(await self.ops.open(inode, flags, _ctx(ctx)))

    @_translated
    async def read(self, fh, off, size):
        return await self.ops.read(fh, off, size)

    @_translated
    async def write(self, fh, off, buf):
        return await self.ops.write(fh, off, buf)

    @_translated
    async def flush(self, fh):
        await self.ops.flush(fh)

    @_translated
    async def fsync(self, fh, datasync):
        await self.ops.fsync(fh, datasync)

    @_translated
    async def release(self, fh):
        await self.ops.release(fh)

    @_translated
    async def setattr(self, inode, attr, fields, fh, ctx):
        ours = Attr(mode=attr.st_mode or 0, size=attr.st_size or 0, mtime_ns=attr.st_mtime_ns or 0)
        wanted = SetattrFields(update_size=fields.update_size, update_mtime=fields.update_mtime,
                               update_mode=fields.update_mode, update_uid=fields.update_uid,
                               update_gid=fields.update_gid, update_atime=fields.update_atime)
        return _entry(await self.ops.setattr(inode, ours, wanted, fh, _ctx(ctx)))

    @_translated
    async def create(self, parent_inode, name, mode, flags, ctx):
        info, attr = await self.ops.create(parent_inode, name, mode, flags, _ctx(ctx))
        return _info(info), _entry(attr)

    @_translated
    async def mkdir(self, parent_inode, name, mode, ctx):
        return _entry(await self.ops.mkdir(parent_inode, name, mode, _ctx(ctx)))

    @_translated
    async def unlink(self, parent_inode, name, ctx):
        await self.ops.unlink(parent_inode, name, _ctx(ctx))

    @_translated
    async def rmdir(self, parent_inode, name, ctx):
        await self.ops.rmdir(parent_inode, name, _ctx(ctx))

    @_translated
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.ops.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, _ctx(ctx))

    @_translated
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return _entry(await self.ops.mknod(parent_inode, name, mode, rdev, _ctx(ctx)))

    @_translated
    async def symlink(self, parent_inode, name, target, ctx):
        return _entry(await self.ops.symlink(parent_inode, name, target, _ctx(ctx)))

    @_translated
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return _entry(await self.ops.link(inode, new_parent_inode, new_name, _ctx(ctx)))


class Pyfuse3Backend:
    """Mount, serve and close with pyfuse3 (what the daemon did before ``cachefs.fuse``)."""

    name = "pyfuse3"

    def __init__(self) -> None:
        self.kernel = Kernel()

    def mount(self, ops, mountpoint: str, *, allow_other: bool, read_only: bool) -> None:
        """``read_only`` is not applied: without ioctl the control file needs a writable mount."""
        options = set(pyfuse3.default_options) | {"fsname=cachefs", "subtype=cachefs", "noatime"}
        if allow_other:
            options.add("allow_other")
        try:
            pyfuse3.init(Adapter(ops), mountpoint, options)
        except RuntimeError as exc:
            raise OSError(errno.EIO, str(exc)) from None

    async def serve(self) -> None:
        await pyfuse3.main(min_tasks=32, max_tasks=256)

    def settled(self) -> None:
        """Every answer is counted as it is given: nothing to wait for before a scrape."""

    def terminate(self) -> None:
        pyfuse3.terminate()

    def status(self) -> dict:
        return {"backend": self.name, "passthrough": False}

    def close(self, unmount: bool) -> None:
        pyfuse3.close(unmount=unmount)
