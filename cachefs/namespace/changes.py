"""The namespace's changes: create, mkdir, rmdir, unlink and rename (docs/writeback.md).

Part of ``Vfs`` (a base class of it): each operation checks the parent's listing, asks the
write-back engine to stage the change, and then shows it in the cached listings, the listing
snapshot and the node table. Only a writable mount (``Vfs.wb``) gets here; the others answer
EROFS in ``Vfs._writeback``.
"""

import errno
import os
import time

import trio

from cachefs.namespace.dirs import DirState, join, split
from cachefs.namespace.handles import Handle
from cachefs.namespace.nodes import FsError, Node
from cachefs.writeback.overlay import staged_info

RENAME_NOREPLACE = 1


class NameChanges:
    async def create(self, parent_inode: int, name: str, flags: int) -> tuple[Handle, Node]:
        wb = self._writeback()
        parent, state = await self._parent_state(parent_inode)
        if name in state.dirs:
            raise FsError(errno.EISDIR)
        path = join(parent.path, name)
        staged = wb.staged(path)
        if staged is not None:
            entry = staged
            await wb.truncate(entry, 0)
        else:
            entry = await wb.create(path, remote=name in state.files)
        self.catalog.set_file(path, staged_info(entry))
        node = self._node_for(path, False, None)
        node.show(entry)
        self.remember(node)
        return self._new_handle(node, entry, writable=bool(flags & (os.O_WRONLY | os.O_RDWR))), node

    async def mkdir(self, parent_inode: int, name: str) -> Node:
        wb = self._writeback()
        parent, state = await self._parent_state(parent_inode)
        if name in state.dirs or name in state.files:
            raise FsError(errno.EEXIST)
        path = join(parent.path, name)
        await wb.make_dir(path)
        self.catalog.set_dir(path, True)
        self._saved.dir_changed(path, True)
        node = self._node_for(path, True, None)
        self.remember(node)
        return node

    async def _empty_dir(self, path: str) -> bool:
        state = await self.dir_state(path)
        return not state.files and not state.dirs

    async def rmdir(self, parent_inode: int, name: str) -> None:
        wb = self._writeback()
        parent, state = await self._parent_state(parent_inode)
        path = join(parent.path, name)
        if name not in state.dirs:
            raise FsError(errno.ENOTDIR if name in state.files else errno.ENOENT)
        if not await self._empty_dir(path):
            raise FsError(errno.ENOTEMPTY)
        await wb.remove_dir(path)
        self.catalog.set_dir(path, False)
        self._saved.dir_changed(path, False)
        self._nodes.unlink(path)

    async def unlink(self, parent_inode: int, name: str) -> None:
        wb = self._writeback()
        parent, state = await self._parent_state(parent_inode)
        path = join(parent.path, name)
        if name in state.dirs:
            raise FsError(errno.EISDIR)
        entry = wb.staged(path)
        if entry is not None:
            await wb.unlink(entry)
        elif name in state.files:
            await wb.delete(path)
        else:
            raise FsError(errno.ENOENT)
        self.catalog.set_file(path, None)
        self._saved.file_changed(path, None)
        self._nodes.unlink(path)

    # A resent request (its first daemon died before answering it) that finds its change already
    # made (staged in the journal) is answered as done; but a daemon can die between staging the
    # change and showing it in the node table, whose ids the next daemon took over from the id log.
    # These bring the node table to what the journal says, where it lags.
    async def unlinked_already(self, parent_inode: int, name: str) -> None:
        parent, _ = await self._parent_state(parent_inode)
        path = join(parent.path, name)
        if self._nodes.at(path) is not None:
            self._nodes.unlink(path)

    async def renamed_already(self, old_parent: int, old_name: str, new_parent: int, new_name: str) -> None:
        src_parent, _ = await self._parent_state(old_parent)
        dst_parent, _ = await self._parent_state(new_parent)
        old, new = join(src_parent.path, old_name), join(dst_parent.path, new_name)
        if old != new and self._nodes.at(old) is not None:
            self._nodes.move(old, new)

    async def rename(self, old_parent: int, old_name: str, new_parent: int, new_name: str, flags: int) -> None:
        self._writeback()
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL, "only RENAME_NOREPLACE is supported")
        src_parent, src = await self._parent_state(old_parent)
        dst_parent, dst = await self._parent_state(new_parent)
        old, new = join(src_parent.path, old_name), join(dst_parent.path, new_name)
        if old == new:
            return
        exists = new_name in dst.files or new_name in dst.dirs
        if flags & RENAME_NOREPLACE and exists:
            raise FsError(errno.EEXIST)
        if old_name in src.dirs:
            await self._rename_dir(old, new, dst, new_name)
        elif old_name in src.files:
            if new_name in dst.dirs:
                raise FsError(errno.EISDIR)
            await self._rename_file(old, new, replaces=new_name in dst.files)
        else:
            raise FsError(errno.ENOENT)
        self._nodes.move(old, new)

    async def _rename_file(self, old: str, new: str, *, replaces: bool) -> None:
        wb = self.wb
        entry = wb.staged(old)
        if entry is not None:
            await wb.move(entry, new, replaces_object=replaces and wb.staged(new) is None)
            self.catalog.set_file(old, None)
            self._saved.file_changed(old, None)        # the new name's row comes with its upload
            self.catalog.set_file(new, staged_info(entry))
            return
        # A file only in the store: a server-side copy now, the old name deleted by a tombstone.
        with self._saved.stale_while(split(new)[0]):       # no record covers the copy
            info = await trio.to_thread.run_sync(self.store.copy, old, new, limiter=self._limiter)
            self._saved.file_changed(new, info)
        other = wb.staged(new)
        if other is not None:
            await wb.unlink(other)
        wb.cancel_delete(new)
        await wb.delete(old)
        self.catalog.set_file(old, None)
        self._saved.file_changed(old, None)
        self.catalog.set_file(new, info)
        self._uploaded[new] = (info, time.time())

    async def _rename_dir(self, old: str, new: str, dst: DirState, new_name: str) -> None:
        """Only an empty directory moves: S3 has no directory objects to rename (EXDEV makes
        ``mv`` copy the tree and delete the original instead)."""
        if new_name in dst.files:
            raise FsError(errno.ENOTDIR)
        if not await self._empty_dir(old):
            raise FsError(errno.EXDEV, "renaming a non-empty directory is not supported on an object store")
        if new_name in dst.dirs and not await self._empty_dir(new):
            raise FsError(errno.ENOTEMPTY)
        await self.wb.make_dir(new)
        await self.wb.remove_dir(old)
        self.catalog.set_dir(old, False)
        self.catalog.set_dir(new, True)
        self._saved.dir_changed(old, False)
        self._saved.dir_changed(new, True)

