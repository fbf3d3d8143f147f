"""One block file of the disk tier: its header, its checksums, and the blocking reads and writes of it.

Plain functions of paths, fds and bytes; they touch no shared structure, so the worker threads
(and the trio thread, for inline reads) may call them. The tier decides which thread runs them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from cachefs.errors import CorruptBlock

if TYPE_CHECKING:
    from cachefs.tiers.disk.direct import DirectWrites

log = logging.getLogger(__name__)

HEADER_ALIGN = 4096
_MAX_CHUNKS = 1 << 20
#: an *exact* block file holds only the data, from offset 0 (so the kernel can read it as the
#: file itself: FUSE passthrough); its header lives in this extended attribute, written on the
#: temporary file before the one rename that publishes both
XATTR = "user.cachefs.block"
_xxh = xxhash.xxh3_64_intdigest

Pread = Callable[[int, int, int], bytes]


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header of a block file (format version 1); all integers little-endian.

    ========  ======  =========================================================
    offset    size    field
    ========  ======  =========================================================
    0         4       magic ``b"CFSB"``
    4         2       format version (1)
    6         2       reserved, 0
    8         8       data length in bytes
    16        4       chunk size (every chunk but the last is this long)
    20        4       number of chunks n = ceil(data length / chunk size)
    24        8*n     xxh3_64 of each chunk of data
    24+8n     8       xxh3_64 of header bytes [0, 24+8n)
    32+8n     pad     zeros up to ``length``, the next multiple of 4 KiB
    length    data    the block's bytes
    ========  ======  =========================================================

    A file is valid only if its size is exactly ``length + data_len``.

    An *exact* file (``XATTR`` set) holds the same header, unpadded, in that extended attribute
    and only the data in the file, from offset 0: ``length`` is then 0.
    """

    data_len: int
    chunk_size: int
    digests: tuple[int, ...]
    length: int

    MAGIC = b"CFSB"
    VERSION = 1
    _FIXED = struct.Struct("<4sHHQII")

    @classmethod
    def length_for(cls, data_len: int, chunk_size: int) -> int:
        chunks = -(-data_len // chunk_size)
        return round_up(cls._FIXED.size + 8 * chunks + 8, HEADER_ALIGN)

    @classmethod
    def file_size(cls, data_len: int, chunk_size: int) -> int:
        return cls.length_for(data_len, chunk_size) + data_len

    @classmethod
    def encode(cls, data: bytes, chunk_size: int) -> bytes:
        view = memoryview(data)
        digests = [_xxh(view[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]
        return cls.encode_digests(len(data), chunk_size, digests).ljust(
            cls.length_for(len(data), chunk_size), b"\0")

    @classmethod
    def encode_exact(cls, data: bytes, chunk_size: int) -> bytes:
        """The header of an exact file (its extended attribute): ``encode`` without the padding."""
        header = cls.encode(data, chunk_size)
        return header[:cls._FIXED.size + 8 * -(-len(data) // chunk_size) + 8]

    @classmethod
    def encode_digests(cls, data_len: int, chunk_size: int, digests: list[int]) -> bytes:
        """The header, unpadded, of ``data_len`` bytes whose chunks hash to ``digests``."""
        body = cls._FIXED.pack(cls.MAGIC, cls.VERSION, 0, data_len, chunk_size, len(digests))
        body += struct.pack(f"<{len(digests)}Q", *digests)
        return body + struct.pack("<Q", _xxh(body))

    @classmethod
    def peek_length(cls, buf: bytes) -> int:
        """The header length announced by the fixed fields at the start of ``buf``."""
        if len(buf) < cls._FIXED.size:
            raise CorruptBlock(f"truncated header ({len(buf)} bytes)")
        magic, version, _, data_len, chunk_size, chunks = cls._FIXED.unpack_from(buf)
        if magic != cls.MAGIC or version != cls.VERSION:
            raise CorruptBlock(f"bad magic or version {magic!r} {version}")
        if chunk_size == 0 or chunks > _MAX_CHUNKS or chunks != -(-data_len // chunk_size):
            raise CorruptBlock(f"inconsistent header: {data_len} bytes, {chunks} x {chunk_size}")
        return cls.length_for(data_len, chunk_size)

    @classmethod
    def parse(cls, buf: bytes) -> BlockHeader:
        """Parse and verify the header at the start of ``buf`` (which may hold more bytes)."""
        length = cls.peek_length(buf)
        _, _, _, data_len, chunk_size, chunks = cls._FIXED.unpack_from(buf)
        end = cls._FIXED.size + 8 * chunks
        if len(buf) < end + 8:
            raise CorruptBlock(f"truncated header ({len(buf)} bytes)")
        (stored,) = struct.unpack_from("<Q", buf, end)
        if _xxh(memoryview(buf)[:end]) != stored:
            raise CorruptBlock("header checksum mismatch")
        digests = struct.unpack_from(f"<{chunks}Q", buf, cls._FIXED.size)
        return cls(data_len, chunk_size, digests, length)

    def verify(self, first_chunk: int, data: memoryview) -> None:
        """Check ``data``, which holds whole chunks starting at ``first_chunk``."""
        size = self.chunk_size
        for i in range(0, len(data), size):
            index = first_chunk + i // size
            if _xxh(data[i:i + size]) != self.digests[index]:
                raise CorruptBlock(f"chunk {index} checksum mismatch")


class OpenBlock(NamedTuple):
    """An open block file and its verified header (the tier caches these for hot blocks)."""
    fd: int
    header: BlockHeader


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --- reads ---------------------------------------------------------------------------------

_scratch = bytearray(0)     # reused by pread_nowait: only the trio thread calls it


def pread_nowait(fd: int, size: int, offset: int) -> bytes:
    """pread that raises BlockingIOError unless every byte is in the page cache.

    Reads into a reused buffer (a fresh bytearray costs a zero-fill and page faults per call)
    and returns one copy."""
    global _scratch
    if len(_scratch) < size:
        _scratch = bytearray(size)
    view = memoryview(_scratch)[:size]
    if os.preadv(fd, [view], offset, os.RWF_NOWAIT) != size:
        raise BlockingIOError(errno.EAGAIN, "partly resident")   # or truncated: the thread decides
    return bytes(view)


def pread_willneed(fd: int, size: int, offset: int) -> bytes:
    """pread for a first open: also asks the kernel to read the whole file ahead, so the rest
    of the block is resident (and served inline) when the reader gets there."""
    if offset == 0:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return os.pread(fd, size, offset)


def open_block(path: str, want: int, pread: Pread) -> tuple[int, BlockHeader, bytes]:
    """Open a block file and parse its header (reading ``want`` data bytes along with it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)     # FileNotFoundError: the caller decides
    try:
        header, buf = parse_block(fd, want, pread)
    except BaseException:
        os.close(fd)
        raise
    return fd, header, buf


def exact_header(fd: int) -> BlockHeader | None:
    """The header of an exact block file (``XATTR``), or None for a file with its header inside."""
    try:
        raw = os.getxattr(fd, XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    header = BlockHeader.parse(raw)
    return BlockHeader(header.data_len, header.chunk_size, header.digests, 0)


def parse_block(fd: int, want: int, pread: Pread) -> tuple[BlockHeader, bytes]:
    """The header of an open block file (and ``want`` data bytes read along with it)."""
    file_size = os.fstat(fd).st_size
    exact = exact_header(fd)
    if exact is not None:
        if file_size != exact.data_len:
            raise CorruptBlock(f"file has {file_size} bytes, header says {exact.data_len}")
        return exact, pread(fd, want, 0) if want else b""
    buf = pread(fd, HEADER_ALIGN + want, 0)
    length = BlockHeader.peek_length(buf)
    if length > HEADER_ALIGN:
        buf = pread(fd, length + want, 0)
    header = BlockHeader.parse(buf)
    if file_size != header.length + header.data_len:
        raise CorruptBlock(f"file has {file_size} bytes, header says {header.length + header.data_len}")
    return header, buf


def read_range(fd: int, header: BlockHeader, offset: int, size: int, prefix: bytes | None,
               pread: Pread) -> bytes:
    """Bytes [offset, offset+size) of the block's data, every chunk they touch verified."""
    end = min(offset + size, header.data_len)
    if offset >= end:
        return b""
    first, cs = offset // header.chunk_size, header.chunk_size
    lo, hi = first * cs, min(round_up(end, cs), header.data_len)
    if prefix is not None and len(prefix) >= header.length + hi:
        raw = memoryview(prefix)[header.length + lo:header.length + hi]
    else:
        raw = pread(fd, hi - lo, header.length + lo)
        if len(raw) != hi - lo:
            raise CorruptBlock(f"truncated: read {len(raw)} of {hi - lo} bytes at {lo}")
    header.verify(first, memoryview(raw))
    if lo == offset and hi == end and isinstance(raw, bytes):
        return raw
    return bytes(memoryview(raw)[offset - lo:end - lo])


def read_resident(opened: OpenBlock, offset: int, size: int) -> bytes:
    """A range of an open block read inline, only if all its pages are in the page cache."""
    return read_range(opened.fd, opened.header, offset, size, None, pread_nowait)


def read_dup(fd: int, header: BlockHeader, offset: int, size: int) -> bytes:
    """Worker thread: read a range through a dup of a cached fd, then close the dup."""
    try:
        return read_range(fd, header, offset, size, None, os.pread)
    finally:
        os.close(fd)


def open_and_read(path: str, want: int, offset: int, size: int) -> tuple[int, BlockHeader, bytes]:
    """Worker thread: open, parse and read a range of one block file (FileNotFoundError if gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    return read_opened(fd, want, offset, size)


def read_opened(fd: int, want: int, offset: int, size: int) -> tuple[int, BlockHeader, bytes]:
    """Parse a just-opened block file and read a range of it; ``fd`` is closed on failure."""
    try:
        header, prefix = parse_block(fd, want, os.pread)
        return fd, header, read_range(fd, header, offset, size, prefix, os.pread)
    except BaseException:
        os.close(fd)
        raise


# --- writes --------------------------------------------------------------------------------

class NoXattrs(OSError):
    """The cache filesystem keeps no user extended attributes: no exact files on it."""


def write_block_file(doomed: list[Path], tmp: Path, final: Path, data: bytes, chunk_size: int,
                     fsync: bool, direct: DirectWrites | None = None, exact: bool = False,
                     sealed: Sealed | None = None) -> list[OSError]:
    """Unlink the evicted files, then write ``data`` crash-safely as ``final`` (``exact``: the data
    alone, its header in ``XATTR``; NoXattrs when the filesystem cannot keep one, nothing written;
    ``sealed``: an exact file is read back and checked, see ``check_written``).

    Returns the unlink errors (missing files are not errors); raises OSError if the write fails.
    """
    errors = unlink_paths(doomed)
    header = b"" if exact else BlockHeader.encode(data, chunk_size)
    xattr = BlockHeader.encode_exact(data, chunk_size) if exact else None

    def write() -> None:
        if direct is None or not direct.write(tmp, header, data, fsync, xattr):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                written = os.writev(fd, [header, data])
                if written < len(header) + len(data):    # a short writev (rare): finish the rest
                    write_all(fd, (header + data)[written:])
                finish(fd, fsync, xattr)
            finally:
                os.close(fd)
    _publish(tmp, final, write)
    if exact and sealed is not None:
        check_written(final, sealed, direct)
    return errors


Sealed = Callable[[os.stat_result], None]


def verify_range(fd: int, header: BlockHeader, first: int, buf: bytearray) -> None:
    """Check the chunks of the ``len(buf)`` bytes at ``first`` of an exact file (``first`` on a
    chunk boundary), read into ``buf`` (reused: no allocation per step; read, not mapped, so a
    file cut short under us is an error, never a SIGBUS)."""
    with memoryview(buf) as view:
        got = os.preadv(fd, [view], first)
        if got != len(buf):
            raise CorruptBlock(f"truncated: {first + got} of {header.data_len} bytes")
        header.verify(first // header.chunk_size, view)


VERIFY_STEP = 8 << 20       # bytes checked per read


def verify_step(header: BlockHeader) -> int:
    """Bytes checked per read of an exact file: whole chunks, about ``VERIFY_STEP``."""
    return max(header.chunk_size, VERIFY_STEP // header.chunk_size * header.chunk_size)


def verify_steps(header: BlockHeader) -> Iterator[tuple[int, int]]:
    """(offset, length) of each read that checks an exact file whole, in order."""
    step = verify_step(header)
    for first in range(0, header.data_len, step):
        yield first, min(step, header.data_len - first)


def check_written(final: Path, sealed: Sealed, direct: DirectWrites | None) -> None:
    """Read the exact file just published as ``final`` back, every chunk checked against its
    header, and hand its ``fstat`` to ``sealed`` (a file read back right is as good as one
    verified before its first hand-over). Written around the page cache (``direct``), it is read
    back around it too (O_DIRECT into a pooled buffer: a buffered read would cost what the
    direct write saved). A file that fails is unlinked, and the error raised (CorruptBlock: the
    fill is dropped)."""
    try:
        fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = exact_header(fd)
            st = os.fstat(fd)
            if header is None or st.st_size != header.data_len:
                raise CorruptBlock(f"written {st.st_size} bytes, header says "
                                   f"{header.data_len if header else 'nothing'}")
            if direct is None or not _check_direct(final, header, direct):
                buf = bytearray(min(verify_step(header), st.st_size))
                for first, length in verify_steps(header):
                    if length < len(buf):
                        buf = bytearray(length)
                    verify_range(fd, header, first, buf)
        finally:
            os.close(fd)
    except (OSError, CorruptBlock):
        with suppress(OSError):
            os.unlink(final)
        raise
    sealed(st)


def _check_direct(path: Path, header: BlockHeader, direct: DirectWrites) -> bool:
    """``check_written``'s reads with O_DIRECT; False where the file system refuses them."""
    size = header.data_len
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    buf = direct.take(round_up(min(verify_step(header), size), HEADER_ALIGN))
    try:
        with memoryview(buf) as view:
            for first, want in verify_steps(header):
                try:
                    got = os.preadv(fd, [view[:round_up(want, HEADER_ALIGN)]], first)
                except OSError as exc:
                    if exc.errno == errno.EINVAL and first == 0:
                        return False
                    raise
                if got < want:
                    raise CorruptBlock(f"truncated: {first + got} of {size} bytes")
                header.verify(first // header.chunk_size, view[:want])
        return True
    finally:
        os.close(fd)
        direct.give(buf)


def _publish(tmp: Path, final: Path, write: Callable[[], None]) -> None:
    """``write()`` makes ``tmp``, durable; one rename then publishes it as ``final``. On any
    failure ``tmp`` is removed. No directory fsync: a rename lost in a crash is only a cache
    miss, and a file that exists never holds unwritten bytes."""
    try:
        write()
        os.rename(tmp, final)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


#: most chunk digests in a whole-object file's header: 32 + 8 x 448 bytes fit in one extended
#: attribute on ext4 (a 4 KiB block; XFS and btrfs take more)
WHOLE_MAX_CHUNKS = 448
_CHUNK_SIZE_MAX = (1 << 32) - 1     # the header's chunk size field


def whole_chunk_size(data_len: int, block_size: int) -> int | None:
    """The chunk size of a whole-object exact file of ``data_len`` bytes: the block size, doubled
    until the header fits in its extended attribute; None when the object is too large for one."""
    chunk = block_size
    while -(-data_len // chunk) > WHOLE_MAX_CHUNKS:
        chunk *= 2
    return chunk if chunk <= _CHUNK_SIZE_MAX else None


def write_whole_file(doomed: list[Path], tmp: Path, final: Path, blocks: list[tuple[str, int]], chunk_size: int,
                     fsync: bool, direct: DirectWrites | None = None, sealed: Sealed | None = None) -> list[OSError]:
    """Unlink the evicted files, then write the object whose block files are ``blocks`` (path,
    data length; every block but the last is one ``chunk_size`` divisor long) as one exact file
    ``final``: every block read verified, its bytes copied to their offset, chunk digests of the
    whole computed on the way, the header in ``XATTR``, one rename. CorruptBlock names a block
    file that failed its check (or vanished); NoXattrs as ``write_block_file``."""
    errors = unlink_paths(doomed)
    data_len = sum(length for _, length in blocks)

    def write() -> None:
        fd, buf = _open_whole(tmp, direct, max(length for _, length in blocks))
        try:
            digests = _copy_blocks(fd, buf, blocks, chunk_size)
            os.ftruncate(fd, data_len)
            finish(fd, fsync, BlockHeader.encode_digests(data_len, chunk_size, digests))
        except OSError as exc:
            if buf is None or exc.errno != errno.EINVAL or isinstance(exc, NoXattrs):
                raise
        else:
            return
        finally:
            os.close(fd)
            if buf is not None:
                direct.give(buf)
        os.unlink(tmp)                      # an alignment this device refuses: buffered it is
        direct.refuse(tmp.parent)
        write()
    _publish(tmp, final, write)
    if sealed is not None:
        check_written(final, sealed, direct)
    return errors


def _open_whole(tmp: Path, direct: DirectWrites | None, block: int) -> tuple[int, mmap.mmap | None]:
    """The new file, O_DIRECT with an aligned buffer of one block where the file system takes it."""
    fd = direct.open(tmp) if direct is not None else None
    if fd is not None:
        return fd, direct.take(round_up(block, HEADER_ALIGN))
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), None


def _copy_blocks(fd: int, buf: mmap.mmap | None, blocks: list[tuple[str, int]], chunk_size: int) -> list[int]:
    digests: list[int] = []
    hasher, in_chunk, offset = xxhash.xxh3_64(), 0, 0
    for path, length in blocks:
        try:
            bfd, _, data = open_and_read(path, 0, 0, length)
            os.close(bfd)
        except (OSError, CorruptBlock) as exc:
            raise CorruptBlock(f"block file {path}: {exc}") from exc
        if len(data) != length:
            raise CorruptBlock(f"block file {path}: {len(data)} bytes, expected {length}")
        hasher.update(data)
        in_chunk += length
        if in_chunk == chunk_size:
            digests.append(hasher.intdigest())
            hasher.reset()
            in_chunk = 0
        _write_at(fd, buf, data, offset)
        offset += length
    if in_chunk:
        digests.append(hasher.intdigest())
    return digests


def _write_at(fd: int, buf: mmap.mmap | None, data: bytes, offset: int) -> None:
    """pwrite all of ``data`` at ``offset``: through the aligned buffer (zero-padded to a 4 KiB
    multiple; the caller truncates) when the file is O_DIRECT."""
    if buf is None:
        view = memoryview(data)
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
        return
    pwrite_padded(fd, buf, (data,), offset)


def pwrite_padded(fd: int, buf: mmap.mmap, parts: tuple[bytes, ...], offset: int) -> int:
    """Copy ``parts`` one after another into the aligned ``buf``, zero-pad to a ``HEADER_ALIGN``
    multiple and pwrite that at ``offset`` (an O_DIRECT write); the bytes of ``parts``."""
    at = 0
    for part in parts:
        buf[at:at + len(part)] = part
        at += len(part)
    padded = round_up(at, HEADER_ALIGN)
    buf[at:padded] = bytes(padded - at)
    with memoryview(buf) as view:
        done = 0
        while done < padded:
            done += os.pwritev(fd, [view[done:padded]], offset + done)
    return at


def finish(fd: int, fsync: bool, xattr: bytes | None) -> None:
    """Set an exact file's header attribute, then make the file durable (a full fsync then:
    the attribute is metadata)."""
    if xattr is not None:
        try:
            os.setxattr(fd, XATTR, xattr)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                raise NoXattrs(exc.errno, exc.strerror) from None
            raise
    if fsync:
        (os.fsync if xattr is not None else os.fdatasync)(fd)


def keeps_xattrs(directory: Path) -> bool:
    """Whether files in ``directory`` keep a user extended attribute (an exact file's header):
    False where the filesystem has none (ramfs, vfat, some network filesystems)."""
    path = os.path.join(directory, f"xattr-probe.{os.getpid()}.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        finish(fd, False, b"probe")
        return True
    except NoXattrs:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def unlink_paths(paths: list[Path]) -> list[OSError]:
    errors = []
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(exc)
    return errors


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
