"""Handle numbers, and the ids a previous daemon of a live mount handed out (``keeper.py``).

Part of ``Vfs`` (a base class of it). The kernel keeps every node id and handle number through a
daemon's death and sends them to the next one: nodes come back from the id log
(``ids.IdLog``, ``restore``); a handle is rebuilt from the inode its number names the first time
the kernel uses it (``handle``, ``dir_handle``, ``adopt_writer``). A first daemon of a mount
(generation 0) has no predecessor: an unknown handle is EBADF there.
"""

import errno
import logging

from cachefs.namespace.dirs import DirHandle
from cachefs.namespace.handles import Handle, fh_inode, make_fh
from cachefs.namespace.ids import KnownNode
from cachefs.namespace.nodes import CONTROL_INODE, FsError, Node

log = logging.getLogger("cachefs.namespace.vfs")


class Adoption:
    def new_fh(self, inode: int) -> int:
        """A handle number naming ``inode`` (``handles.make_fh``), unused in this process."""
        while True:
            fh = make_fh(inode, self.generation, next(self._next_fh))
            if fh not in self.handles and fh not in self.dir_handles:
                return fh

    def handle(self, fh: int) -> Handle:
        """The open file ``fh``; one a previous daemon of this mount opened is rebuilt from the
        inode its number names: the version the node shows, or its staged file."""
        handle = self.handles.get(fh)
        if handle is not None:
            return handle
        node = self._adoptable(fh)
        if node.is_dir:
            raise FsError(errno.EBADF)
        if not self.files.writable:
            handle = Handle(fh, node, self.files.file(node))
        else:
            entry = node.staged
            if entry is None and self.wb is not None:
                entry = self.wb.staged(node.path)
                if entry is not None:
                    node.show(entry)
            if entry is not None:       # a writer's or a reader's: taken as a writer's (its release uploads)
                handle = Handle(fh, node, None, entry, writable=True)
                self.wb.opened(entry, writable=True)
            else:
                handle = Handle(fh, node, self.files.file(node))
        self.handles[fh] = handle
        node.opens += 1
        log.debug("adopted handle %#x of %s (opened by a previous daemon)", fh, node.path)
        return handle

    def _adoptable(self, fh: int) -> Node:
        """The node of a handle a previous daemon gave out (EBADF in a new mount's first daemon)."""
        node = self._nodes.find(fh_inode(fh)) if self.generation else None
        if node is None or node.inode == CONTROL_INODE:
            raise FsError(errno.EBADF)
        return node

    def show_staged(self) -> None:
        """After the journal replay: restored nodes of staged files show them (size, reads)."""
        if self.wb is None:
            return
        for node in self._nodes:
            if not node.is_dir and node.staged is None:
                entry = self.wb.staged(node.path)
                if entry is not None:
                    node.show(entry)

    def ids_log_backing(self, inode: int, backing_id: int | None) -> None:
        """Write down a passthrough backing id registered for ``inode`` (None: closed)."""
        ids = self._nodes.ids
        if ids is not None:
            if backing_id is None:
                ids.backing_closed(inode)
            else:
                ids.backing(inode, backing_id)

    def restore(self, known: list[KnownNode]) -> None:
        """Take over the nodes a previous daemon of this mount handed out (``ids.KnownNode``)."""
        self._nodes.restore(known)
        if self.packed is not None:
            for item in known:
                node = self._nodes.find(item.inode)
                if node is not None and not node.is_dir and node.row < 0:
                    try:
                        node.row, node.mode = self.packed.locate(node.path, None)
                    except FsError:
                        pass            # gone from the index: its reads answer ENOENT

    async def adopt_writer(self, fh: int) -> Handle:
        """A WRITE on a handle a previous daemon opened: its staged file (staged anew, from the
        store's copy, when it was uploaded and retired meanwhile)."""
        node = self._adoptable(fh)
        if node.is_dir:
            raise FsError(errno.EBADF)
        entry = await self._stage(node, empty=False)
        node.show(entry)
        handle = self.handles.get(fh)
        if handle is None:
            handle = self.handles[fh] = Handle(fh, node, None, entry, writable=True)
            self.wb.opened(entry, writable=True)
            node.opens += 1
        return handle

    async def dir_handle(self, fh: int) -> DirHandle:
        """The open directory ``fh``; one a previous daemon opened is opened again (same listing,
        so the same offsets, unless the directory changed meanwhile)."""
        handle = self.dir_handles.get(fh)
        if handle is None:
            node = self._adoptable(fh)
            if not node.is_dir:
                raise FsError(errno.EBADF)
            handle = self.dir_handles[fh] = DirHandle(node, await self.dir_state(node.path))
        return handle

