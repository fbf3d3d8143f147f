"""Reading a mounted packed dataset's shards from the daemon's cache files, not through FUSE.

In a cachefs mount, every read of a sample is a FUSE request (or a page-cache hit the daemon
filled through FUSE). When the daemon runs on this machine, it hands the loader read-only
descriptors of the disk-tier files that hold a shard's blocks, each with where the block's bytes
start in it (the loader channel: ``cachefs.packed.wire``, a unix socket in the daemon's cache dir
that only its user and root can open, named in the daemon's control handshake), and the loader
``pread``s them directly: the short-circuit local read of HDFS and Alluxio. It knows nothing of
the cache files' format. It also asks for a shard's warm there (``warm``).

Only blocks the disk tier holds when a process first reads a shard are handed over; a sample in
any other block is read through the mount as before (which fetches it). The caller checks every
record's crc32c; a mismatch drops the shard's descriptors and the sample is read through the
mount, which verifies and refetches. Descriptors belong to one process (DataLoader workers fork),
and at most ``keep`` shards' worth are held (``KEEP``; more in a process reading samples by
reference, which may see the shards of several workers at once). The socket is found once, when
the dataset is built, from the handshake; anything unexpected there (no daemon, one that speaks
another wire version, a socket we may not open) turns the channel off for that dataset, silently:
the mount still works.
"""

import os
import socket
from collections import OrderedDict
from pathlib import Path

import cachefs.packed.wire as wire

KEEP = 2
_TIMEOUT_S = 30.0


class _Blocks:
    __slots__ = ("block_size", "fds", "offsets")

    def __init__(self, block_size: int, count: int) -> None:
        self.block_size = block_size
        self.fds: list[int | None] = [None] * count
        self.offsets: list[int] = [0] * count      # where each block's bytes start in its file

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

    def warm(self, shard: int, name: str) -> bool:
        """Ask the daemon to warm the whole shard (its shard warm); False when there is no
        channel, or the daemon has no shard warm on (the caller then reads a byte through the
        mount, which starts it as well where it is on)."""
        if self._socket is None:
            return False
        try:
            message, fds = _ask(self._socket, wire.encode_request(wire.Warm(shard, name)))
            for fd in fds:
                os.close(fd)
            return wire.decode_warm(message)
        except (OSError, wire.WireError):
            return False

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
            except (OSError, wire.WireError):
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
                message, fds = _ask(path, wire.encode_request(wire.Files(shard, name, first)))
                try:
                    answer = wire.decode_files(message, len(fds))
                    if blocks is None:
                        blocks = _Blocks(answer.block_size, -(-size // answer.block_size))
                    for i, extent in enumerate(answer.extents):
                        if extent.index < len(blocks.fds) and blocks.fds[extent.index] is None:
                            blocks.offsets[extent.index] = extent.offset
                            blocks.fds[extent.index], fds[i] = fds[i], None
                finally:
                    for fd in fds:
                        if fd is not None:
                            os.close(fd)
                first += wire.FILES_PER_ANSWER
            return blocks
        except BaseException:
            if blocks is not None:
                blocks.close()
            raise


def _find_socket(mount_root: Path) -> str | None:
    """The channel's socket, from the daemon's handshake, if it speaks our wire and this process
    may connect to it."""
    try:
        from cachefs.control import client
        found = client.hello(str(mount_root)).get("loader_channel") or {}
        if found.get("wire") == wire.WIRE and found.get("socket") and os.access(found["socket"], os.R_OK | os.W_OK):
            return found["socket"]
    except Exception:       # noqa: BLE001 - no daemon, an older one: read through the mount
        pass
    return None


def _ask(path: str, request: bytes) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(path)
        sock.sendall(request)
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, wire.FILES_PER_ANSWER)
        return message, list(fds)
