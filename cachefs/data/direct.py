"""Reading a mounted packed dataset's shards from the daemon's cache files, not through FUSE.

In a cachefs mount, every read of a sample is a FUSE request (or a page-cache hit the daemon
filled through FUSE). When the daemon runs on this machine, it hands the loader read-only
descriptors of the disk-tier files that hold a shard's blocks (``cachefs.control.cachefds``, a
unix socket in its cache dir that only its user and root can open), and the loader ``pread``s
them directly: the short-circuit local read of HDFS and Alluxio.

Only blocks the disk tier holds when a process first reads a shard are handed over; a sample in
any other block is read through the mount as before (which fetches it). The caller checks every
record's crc32c; a mismatch drops the shard's descriptors and the sample is read through the
mount, which verifies and refetches. Descriptors belong to one process (DataLoader workers fork),
and at most ``keep`` shards' worth are held (``KEEP``; more in a process reading samples by
reference, which may see the shards of several workers at once). The socket is found once, when
the dataset is built; anything unexpected there (no daemon, an older one, a socket we may not
open) turns the channel off for that dataset, silently: the mount still works.
"""

import json
import os
import socket
from collections import OrderedDict
from pathlib import Path

from cachefs.control.protocol import CACHE_FILES_PER_ANSWER
from cachefs.errors import CorruptBlock
from cachefs.tiers.disk.format import parse_block

KEEP = 2
_TIMEOUT_S = 30.0


class _Blocks:
    __slots__ = ("block_size", "fds", "offsets")

    def __init__(self, block_size: int, count: int) -> None:
        self.block_size = block_size
        self.fds: list[int | None] = [None] * count
        self.offsets: list[int] = [0] * count      # where each file's data starts (its header length)

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.fds = []

    def complete(self) -> bool:
        return bool(self.fds) and all(fd is not None for fd in self.fds)

    def read(self, offset: int, length: int) -> bytes | None:
        """Bytes [offset, offset+length) of the shard, or None if a block of them was not handed over."""
        bs, parts, pos, end = self.block_size, [], offset, offset + length
        while pos < end:
            index = pos // bs
            if index >= len(self.fds) or self.fds[index] is None:
                return None
            take = min(end, (index + 1) * bs) - pos
            part = os.pread(self.fds[index], take, self.offsets[index] + pos - index * bs)
            if len(part) != take:
                return None
            parts.append(part)
            pos += take
        return parts[0] if len(parts) == 1 else b"".join(parts)


class DirectShards:
    def __init__(self, mount_root: Path) -> None:
        self.mount_root = mount_root
        self._pid = os.getpid()
        # Looked up here, once, in the process that builds the dataset: DataLoader workers inherit
        # (or unpickle) the answer instead of each asking the daemon for its status as it starts.
        self._socket = _find_socket(mount_root)     # None: the channel is off
        self._shards: OrderedDict[int, _Blocks | None] = OrderedDict()
        self.keep = KEEP

    def __getstate__(self) -> dict:
        return {"mount_root": self.mount_root, "_pid": -1, "_socket": self._socket, "_shards": OrderedDict(),
                "keep": self.keep}

    def _own(self) -> None:
        if self._pid != os.getpid():        # a forked worker: the parent's descriptors stay the parent's
            self._pid, self._shards = os.getpid(), OrderedDict()

    def read(self, shard: int, name: str, size: int, offset: int, length: int) -> bytes | None:
        blocks = self._blocks(shard, name, size)
        return blocks.read(offset, length) if blocks is not None else None

    def complete(self, shard: int, name: str, size: int) -> bool:
        """Every block of the shard is read directly (the caller need not warm it through the mount)."""
        blocks = self._blocks(shard, name, size)
        return blocks is not None and blocks.complete()

    def drop(self, shard: int) -> None:
        """Stop reading ``shard`` directly (a record failed its crc): the mount serves it from now on."""
        blocks = self._shards.pop(shard, None)
        if blocks is not None:
            blocks.close()
        self._shards[shard] = None

    def close(self) -> None:
        if self._pid == os.getpid():
            for blocks in self._shards.values():
                if blocks is not None:
                    blocks.close()
        self._shards = OrderedDict()

    # ---- the channel ------------------------------------------------------------------------
    def _blocks(self, shard: int, name: str, size: int) -> _Blocks | None:
        self._own()
        if shard in self._shards:
            self._shards.move_to_end(shard)
            return self._shards[shard]
        blocks = None
        if self._socket is not None:
            try:
                blocks = self._open(self._socket, shard, name, size)
            except (OSError, ValueError, KeyError, TypeError):
                blocks = None
        while len(self._shards) >= self.keep:
            old = self._shards.popitem(last=False)[1]
            if old is not None:
                old.close()
        self._shards[shard] = blocks
        return blocks

    def _open(self, path: str, shard: int, name: str, size: int) -> _Blocks | None:
        blocks: _Blocks | None = None
        first = 0
        try:
            while blocks is None or first < len(blocks.fds):
                reply, fds = _ask(path, {"shard": shard, "name": name, "first": first, "count": CACHE_FILES_PER_ANSWER})
                try:
                    if not reply.get("ok"):
                        return None
                    if blocks is None:
                        blocks = _Blocks(int(reply["block_size"]), -(-size // int(reply["block_size"])))
                    listed = reply["blocks"]
                    if len(listed) != len(fds):
                        raise ValueError("descriptors and blocks differ in number")
                    for i, ((index, length), fd) in enumerate(zip(listed, fds, strict=True)):
                        if 0 <= index < len(blocks.fds) and blocks.fds[index] is None:
                            blocks.offsets[index] = _data_offset(fd, int(length))
                            blocks.fds[index], fds[i] = fd, None
                finally:
                    for fd in fds:
                        if fd is not None:
                            os.close(fd)
                first += CACHE_FILES_PER_ANSWER
            return blocks
        except BaseException:
            if blocks is not None:
                blocks.close()
            raise


def _find_socket(mount_root: Path) -> str | None:
    """The channel's socket, from the daemon's status, if this process may connect to it."""
    try:
        from cachefs.control import client
        events = list(client.request(str(mount_root), "status"))
        found = (events[-1] if events else {}).get("loader_fds") or {}
        if found.get("socket") and os.access(found["socket"], os.R_OK | os.W_OK):
            return found["socket"]
    except Exception:       # noqa: BLE001 - no daemon, an older one: read through the mount
        pass
    return None


def _ask(path: str, request: dict) -> tuple[dict, list]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, CACHE_FILES_PER_ANSWER)
        fds = list(fds)
        try:
            reply = json.loads(message.split(b"\n", 1)[0])
        except ValueError:
            for fd in fds:
                os.close(fd)
            raise
        return reply, fds


def _data_offset(fd: int, length: int) -> int:
    """Where the data of a block file starts; ValueError unless its header is sound, matches the
    file's size (``format.parse_block``) and says ``length`` bytes (the caller closes the fd)."""
    try:
        header, _ = parse_block(fd, 0, os.pread)
    except CorruptBlock as exc:
        raise ValueError(f"bad block file: {exc}") from None
    if header.data_len != length:
        raise ValueError(f"block file holds {header.data_len} bytes, not {length}")
    # No WILLNEED here: advising a whole shard's files at once queues all of it (256 MiB) ahead
    # of the first sample's read; each record's own pread starts just the I/O it needs.
    return header.length
