"""Passthrough for ``Operations`` (``fuse_ops.py``): the kernel reads a verified cache file itself.

The operations hand an open file to the kernel with a backing id (``cachefs/fuse/backing.py`` keeps
them, one per inode): at OPEN (``_hand_over_now``, ``_hand_over``), ahead of the OPEN where the
loops' table answers it (``_ahead`` at a LOOKUP; ``idle`` for files a READDIRPLUS listed), and a
previous daemon's ids taken over (``restore_backings``). What is handed over is counted as served
(``_passed_through``). A mixin: ``Operations`` holds the state it reads (``vfs``, ``kernel``,
``backings``, ``served``, ``metrics``, ``open_ahead``, ``_listed``).
"""

import errno
import logging
import os

from cachefs.errors import CachefsError, NeedsWait
from cachefs.fuse.backing import Backing
from cachefs.fuse.types import FileInfo
from cachefs.namespace.vfs import Node

log = logging.getLogger("cachefs.fuse_ops")

_REFUSED = {errno.EPERM: "no_cap_sys_admin", errno.ELOOP: "stacking"}    # BACKING_OPEN's errno -> fallback reason
_IDLE_SLICE = 8          # listed files registered per idle turn (~0.5 ms: a request that comes waits no longer)


class Passthrough:
    """The passthrough half of ``Operations`` (see the module docstring)."""

    def _hand_over_now(self, inode: int, flags: int) -> int:
        """A backing id for this open (the inode's, or a new one for its verified exact cache
        file), or 0: the open goes the usual way. NeedsWait when verifying needs a disk read."""
        version = self._handover_version(inode, flags)
        if version is None:
            return 0
        reused = self.backings.reuse(inode)
        if reused:
            return reused
        node = self.vfs.node(inode)
        if node.opens or node.restored or self.backings.blocked(inode):
            # other handles read through us (of this daemon, or maybe of a previous one)
            self.served.passthrough_fallbacks.labels("busy").inc()
            return 0
        return self._register_backing(inode, self.vfs.blocks.exact_file_now(version))

    def _worth_ahead(self, node: Node) -> bool:
        """Whether ``node``'s backing is to be registered before any open of it (a small file with
        no backing and no handle, where opens are answered from the loops' table)."""
        return (self.open_ahead and self.backings.ahead and not node.is_dir and node.size < self.vfs.blocks.block_size
                and not node.opens and not node.restored and node.inode not in self.backings.by_inode)

    def _ahead(self, node: Node) -> Node:
        """Where opens are answered from the loops' table, register the backing of a looked-up
        file whose verified cache file is at hand (no disk read) before the LOOKUP is answered: its
        OPEN, which follows at once, is then answered from the table (fuse/backing.py)."""
        if self._worth_ahead(node):   # (a large file's whole-object file is not assembled for a lookup)
            self._register_ahead(node)
        return node

    def _register_ahead(self, node: Node) -> None:
        """Register ``node``'s backing, with no open, if its verified cache file is at hand."""
        try:
            version = self._handover_version(node.inode, os.O_RDONLY)
            exact = self.vfs.blocks.exact_file_now(version) if version is not None else None
        except NeedsWait:
            return
        if exact is not None:
            self._register_backing(node.inode, exact, opens=0)

    def idle(self) -> bool:
        """No request is waiting (the session's loop found none): register the backings of a few
        files a READDIRPLUS listed, queued as it listed them. The kernel keeps such an entry as if
        looked up and opens it later with no LOOKUP; registered now, the open is answered from the
        table, and no READDIRPLUS waits for more than a slice of them. Only while idle backings
        have room: a listing larger than they may hold pushes none out. True while some are left
        (never raises: the session's loop calls it)."""
        for _ in range(_IDLE_SLICE):
            if not self._listed:
                return False
            node = self.vfs.find_node(self._listed.popleft())
            if node is None or node.lookups <= 0 or not self._worth_ahead(node):
                continue                      # forgotten, opened or registered since it was listed
            if not self.backings.room(node.size):
                self._listed.clear()
                return False
            try:
                self._register_ahead(node)         # (``_worth_ahead`` checked above)
            except (CachefsError, OSError) as exc:     # its open goes the usual way (and says why)
                log.debug("registering %s ahead of its open: %s", node.path, exc)
            except Exception:
                log.exception("registering %s ahead of its open", node.path)
                self._listed.clear()
                return False
        return bool(self._listed)

    async def _hand_over(self, inode: int, flags: int) -> int:
        version = self._handover_version(inode, flags, wait=True)
        if version is None:
            return 0
        reused = self.backings.reuse(inode)              # (counted once: this open holds it)
        node = self.vfs.node(inode)
        if reused or node.opens or node.restored or self.backings.blocked(inode):
            return reused
        exact = await self.vfs.blocks.exact_file(version)
        reused = self.backings.reuse(inode)              # another open may have handed it over meanwhile
        if reused or node.opens or self.backings.blocked(inode):
            if exact is not None:
                os.close(exact.fd)
                self.vfs.blocks.release_exact(exact)
            return reused
        return self._register_backing(inode, exact)

    def _handover_version(self, inode: int, flags: int, wait: bool = False):
        if not self.kernel.passthrough:
            return None
        try:
            return self.vfs.handover_version(inode, flags)
        except NeedsWait:
            if wait:
                return None          # revalidated by the open itself: not handed over this time
            raise

    def _register_backing(self, inode: int, exact, opens: int = 1) -> int:
        if exact is None:
            self.served.passthrough_fallbacks.labels("not_cached").inc()
            return 0
        try:
            backing_id = self.kernel.backing_open(exact.fd)
        except OSError as exc:
            self.vfs.blocks.release_exact(exact)
            self.served.passthrough_fallbacks.labels(_REFUSED.get(exc.errno, "backing_open")).inc()
            if not self.kernel.passthrough:          # refused for good (the session turned it off)
                self.vfs.blocks.passthrough_off()
            return 0
        finally:
            os.close(exact.fd)            # the kernel holds the file from here on
        self.backings.add(inode, backing_id, exact, opens=opens)
        self.vfs.ids_log_backing(inode, backing_id)
        return backing_id

    def _handed_over(self, inode: int, flags: int, backing_id: int) -> FileInfo:
        handle, _ = self.vfs.open_now(inode, flags, handed_over=True)
        self.backings.bind(handle.fh, inode)
        self._passed_through(handle.node)
        return FileInfo(fh=handle.fh, backing_id=backing_id)

    def _passed_through(self, node: Node | None) -> None:
        """One open handed to the kernel: counted, and the file's bytes as served (the kernel
        serves them from the cache file)."""
        self.served.passthrough_opens.inc()
        if node is not None:
            self.served.read_bytes.inc(node.size)

    def _unbind_backing(self, fh: int) -> None:
        self.backings.unbind(fh)

    def _close_backing(self, backing) -> None:
        self.kernel.backing_close(backing.id)
        self.vfs.ids_log_backing(backing.inode, None)
        if backing.exact is not None:
            self.vfs.blocks.release_exact(backing.exact)

    def cache_file_corrupt(self, digest: str) -> None:
        """The scrub found the cache file ``digest`` corrupt (tiers/handover.py): its backing is
        handed out no more (fuse/backing.py, ``corrupt``)."""
        if self.backings.corrupt(digest):
            log.warning("a handed-over cache file (%s) failed its scrub: its backing answers no more opens; the "
                        "object is fetched again", digest[:16])

    def table_opened(self, inodes: list[int]) -> None:
        """The session answered opens of ``inodes`` from the loops' table (their published
        backings, no handle here), told in batches: counted as the passthrough opens they are."""
        find = self.vfs.find_node
        size = 0
        for inode in inodes:
            node = find(inode)
            if node is not None:
                size += node.size
        self.served.passthrough_opens.inc(len(inodes))
        if size:
            self.served.read_bytes.inc(size)

    def loops_started(self, loops) -> None:
        """The loops' table is kept (cachefs/fuse/loop_procs.py): the opens of every inode with a
        backing are answered from it from now on (by the loop processes, if any, and the session)."""
        self.backings.attach(loops)
        self.metrics.loop_requests.source = loops

    def restore_backings(self, backings: dict[int, int]) -> None:
        """Backing ids a previous daemon of this mount registered (inode -> id)."""
        for inode, backing_id in backings.items():
            if self.vfs.find_node(inode) is not None:
                self.backings.restore(inode, backing_id)
            else:
                self._close_backing(Backing(backing_id, None, opens=0, inode=inode))
