"""Reading files out of a local packed dataset (a directory or a cachefs mount of one): ``pread``
of a file's data range, or a whole shard mapped and read ahead; every file's crc32c is checked.
Open files and mappings belong to one process (DataLoader workers fork) and are never pickled.

A sample a DataLoader worker hands to the main process travels by reference (``SampleBytes``): the
worker has read and checked it, so its pages sit in this machine's page cache (of the daemon's
cache file, of the mount's shard file or of the local shard file), and the main process reads the
same range again from the same file and checks it again, where pickling the bytes would copy them
four times through a pipe. Unpickled, it is plain ``bytes``. "The same file" matters in a mount: a
sample the worker read through the mount (its block was not on the daemon's disk yet) is in the
page cache of the mount's shard file, not of the daemon's cache file the main process may hold a
descriptor of by then (a disk read there: measured, 3/4 of the main process's time in the first
shard of a cold epoch)."""

import mmap
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cachefs.packfmt import CorruptRecord, PackedIndex
from cachefs.packfmt.store_index import PACKED_DIR
from cachefs.packfmt.tfrecord import crc32c

from .direct import DirectShards


class ShardFiles:
    #: open shard files kept per process (least recently used closed first)
    max_open = 64

    def __init__(self, root: Path, index: PackedIndex | None) -> None:
        """``index`` None: only ``read_at`` works (the main process reading samples by reference)."""
        self.root = root
        self.names: list[str] = []
        self.sizes: list[int] = []
        if index is not None:
            self.names = index.shards.column("name").to_pylist()
            self.sizes = index.shards.column("bytes").to_pylist()
            columns = index.files
            self.shard = columns.column("shard").to_numpy()
            self.offset = columns.column("data_offset").to_numpy()
            self.length = columns.column("data_length").to_numpy()
            self.crc = columns.column("crc32c").to_numpy()
        self._fds: OrderedDict[str, int] = OrderedDict()    # by shard name
        self._pid = os.getpid()
        self._mapped: tuple[int, mmap.mmap] | None = None
        # (pid, its helper thread, the event close sets: a whole-shard read stops between reads)
        self._toucher: tuple[int, ThreadPoolExecutor, threading.Event] | None = None
        self.in_mount = root.name == PACKED_DIR
        # in a mount served by a daemon on this machine: its cache files, read directly (direct.py)
        self.direct = DirectShards(root.parent) if self.in_mount else None
        # A failed read of a mapped page is SIGBUS: the training process would die where a read
        # through a mount (whose store can fail) must be an OSError. Mount: pread; local: mmap.
        self._can_map = not self.in_mount     # also False where the file system refuses mmap
        self.last_direct = False       # the last read_at read the daemon's cache file (not the mount)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_fds=OrderedDict(), _mapped=None, _toucher=None)
        return state

    def _fd(self, name: str) -> int:
        if self._pid != os.getpid():          # a forked worker: the parent's descriptors are not ours to use
            self._fds, self._mapped, self._pid = OrderedDict(), None, os.getpid()
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[name] = os.open(self.root / "shards" / name, os.O_RDONLY)
        return fd

    def read(self, row: int) -> bytes:
        """The bytes of file ``row``: one pread, crc-checked (in a mount, from the daemon's cache
        file when it handed that over; a crc mismatch there is read again through the mount)."""
        shard = int(self.shard[row])
        return self.read_at(shard, self.names[shard], self.sizes[shard], int(self.offset[row]),
                            int(self.length[row]), int(self.crc[row]), row)

    def read_at(self, shard: int, name: str, size: int, offset: int, length: int, crc: int, row: int,
                direct: bool = True) -> bytes:
        """Bytes [offset, offset+length) of shard ``shard`` (file ``name``, ``size`` bytes), checked
        against ``crc``; ``row`` (the file's index row) names it in the error. ``direct`` False:
        through the mount even where the daemon handed over the cache file (``last_direct`` says
        which it was)."""
        self.last_direct = False
        if direct and self.direct is not None:
            data = self.direct.read(shard, name, size, offset, length)
            if data is not None:
                try:
                    data = _verified(data, length, crc, name, row)
                    self.last_direct = True
                    return data
                except CorruptRecord:
                    self.direct.drop(shard)
        return _verified(os.pread(self._fd(name), length, offset), length, crc, name, row)

    def reference(self, row: int, data: bytes) -> "SampleBytes":
        """``data``, the checked bytes of file ``row`` just read (``read``), as a sample that
        pickles as its place: the file it was read from, which holds it in the page cache."""
        shard = int(self.shard[row])
        sample = SampleBytes(data)
        sample.ref = (str(self.root), shard, self.names[shard], self.sizes[shard], int(self.offset[row]),
                      len(data), int(self.crc[row]), row, self.last_direct)
        return sample

    def touch(self, shard: int, *, whole: bool = False) -> None:
        """Start fetching shard ``shard`` without waiting, in a helper thread. In a local directory
        the kernel is asked to read it ahead. In a cachefs mount: ``whole`` reads all of it in
        order into the kernel page cache (the shard being read: its samples are then page-cache
        hits, as with a mapping, but a failed read is only a stop here, never a SIGBUS; the
        kernel's own WILLNEED advice reads just one readahead window ahead); otherwise the daemon
        is asked to warm the whole shard (``--shard-warm``): on the loader channel where there is
        one, else by reading one byte through the mount."""
        if whole and self.direct is not None and self.direct.complete(shard, self.names[shard], self.sizes[shard]):
            return                    # read from the daemon's cache files: nothing to warm through the mount
        if self._toucher is None or self._toucher[0] != os.getpid():   # none yet, or a forked worker
            self._toucher = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="cachefs-shard-touch"),
                             threading.Event())
        self._toucher[1].submit(self._touch, shard, whole, self._toucher[2])

    def _touch(self, shard: int, whole: bool, stop: threading.Event) -> None:
        if not whole and self.direct is not None and self.direct.warm(shard, self.names[shard]):
            return                    # asked on the loader channel: nothing read through the mount
        try:
            fd = os.open(self.root / "shards" / self.names[shard], os.O_RDONLY)
        except OSError:
            return                    # the read of its first sample reports the problem
        try:
            if not self.in_mount:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            elif whole:
                buffer = bytearray(1 << 20)
                offset = 0
                while not stop.is_set() and (got := os.preadv(fd, [buffer], offset)) > 0:   # releases the GIL
                    offset += got
            else:
                os.pread(fd, 1, 0)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_mapped(self, row: int) -> bytes:
        """The same from the whole shard mapped and read ahead (sequential whole-shard reads)."""
        shard = int(self.shard[row])
        view = self._map(shard) if self._can_map else None
        if view is None:
            return self.read(row)
        offset, length = int(self.offset[row]), int(self.length[row])
        return self._checked(row, view[offset:offset + length])

    def _map(self, shard: int) -> mmap.mmap | None:
        if self._mapped is not None and self._mapped[0] == shard and self._pid == os.getpid():
            return self._mapped[1]
        self.release()
        fd = self._fd(self.names[shard])
        try:
            mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):     # e.g. a FUSE file opened with direct_io
            self._can_map = False
            return None
        mapped.madvise(mmap.MADV_WILLNEED)
        self._mapped = (shard, mapped)
        return mapped

    def release(self) -> None:
        if self._mapped is not None:
            self._mapped[1].close()
            self._mapped = None

    def _checked(self, row: int, data: bytes) -> bytes:
        return _verified(data, int(self.length[row]), int(self.crc[row]), self.names[int(self.shard[row])], row)

    def close(self, *, wait: bool = True) -> None:
        """Close this process's mapping and files (a mount can then be unmounted): a helper read
        still running stops after its current 1 MiB and, with ``wait``, is waited for."""
        self.release()
        if self.direct is not None:
            self.direct.close()
        if self._toucher is not None and self._toucher[0] == os.getpid():
            self._toucher[2].set()
            self._toucher[1].shutdown(wait=wait, cancel_futures=True)
        self._toucher = None
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = OrderedDict()

    def __del__(self) -> None:
        try:
            self.close(wait=False)     # may run in the helper thread itself: it cannot join itself
        except (OSError, AttributeError, TypeError):
            pass   # interpreter shutdown or a half-built object: nothing left to close


def _verified(data: bytes, length: int, crc: int, name: str, row: int) -> bytes:
    if len(data) != length or crc32c(data) != crc:
        raise CorruptRecord(f"shard {name}: file row {row} fails its crc32c (corrupt or truncated shard)")
    return data


class SampleBytes(bytes):
    """A sample's bytes in a DataLoader worker: ``bytes`` in every way, except that pickling it (the
    worker's result queue) sends where it lives, ``ref``, and ``load_reference`` reads it back in
    the receiving process: plain ``bytes`` again, crc-checked again."""

    ref: tuple

    def __reduce_ex__(self, protocol):
        return load_reference, self.ref


# The readers ``load_reference`` uses, by root: the ShardFiles of a dataset built in this process (so
# the dataset's close() also closes what reading by reference opened: a mount can then be
# unmounted), else one of its own, kept for the life of the process.
_REF_READERS: weakref.WeakValueDictionary[str, ShardFiles] = weakref.WeakValueDictionary()
_OWN_READERS: dict[str, ShardFiles] = {}
_REF_LOCK = threading.Lock()
REFERENCE_KEEP = 4        # shards of cache files held by a process reading by reference
#: samples this process read back by reference (tests and benchmarks look at it)
reference_loads = 0


def register_reader(files: ShardFiles) -> None:
    """``files`` serves the samples of its root that arrive by reference in this process (the first
    dataset of a root that is still alive does)."""
    if _REF_READERS.get(str(files.root)) is None:
        _REF_READERS[str(files.root)] = files


def load_reference(root: str, shard: int, name: str, size: int, offset: int, length: int, crc: int,
                   row: int, direct: bool = True) -> bytes:
    """A ``SampleBytes`` unpickled: its range read again here, from the same place the worker read
    it (the daemon's cache file if ``direct``, else the mount; or the local shard), and checked."""
    global reference_loads
    with _REF_LOCK:       # DataLoader may unpickle in its pin-memory thread
        files = _REF_READERS.get(root)
        if files is None:
            files = _OWN_READERS.get(root)
            if files is None:
                files = _OWN_READERS[root] = ShardFiles(Path(root), None)
        if files.direct is not None:
            files.direct.keep = max(files.direct.keep, REFERENCE_KEEP)
        data = files.read_at(shard, name, size, offset, length, crc, row, direct)
        reference_loads += 1
    return data
