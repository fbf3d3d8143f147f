"""The cache-file channel: a loader on this machine (``cachefs.data``) asks the daemon for the
disk-tier files that hold a packed shard and reads them itself, with no FUSE request per read
(the short-circuit local read of HDFS and Alluxio; docs/design.md, components, the packer's lever).

A unix socket, ``CACHE_DIR/loader.sock``, mode 0600, whose peers are checked (SO_PEERCRED): only
the daemon's user and root are answered, and they may read the cache files anyway. One request per connection, a JSON line::

    {"shard": 3, "name": "00003.tfrecord", "first": 0, "count": 64}

Of the blocks [first, first+count) of that shard, the daemon opens the files of those its disk
tier holds, read-only, and answers with one message: ``{"ok": true, "block_size": B, "blocks":
[[index, length], ...]}`` for those, with their descriptors in SCM_RIGHTS in the same order, or
``{"ok": false, "error": "..."}`` and none. It fetches nothing: a block not on disk is read
through the mount, which fetches it. A block file is never
rewritten in place (temp + rename) and an evicted one stays readable through its descriptor, so
the loader reads the bytes the daemon checked in. The loader checks each record's crc32c itself
and falls back to reading through the mount on any trouble.
"""

import array
import json
import logging
import os
import socket
import struct
from contextlib import suppress
from pathlib import Path

import trio

from cachefs.control.protocol import CACHE_FILES_PER_ANSWER
from cachefs.errors import CachefsError

log = logging.getLogger(__name__)

SOCKET_NAME = "loader.sock"
MAX_BLOCKS = CACHE_FILES_PER_ANSWER       # descriptors per answer
_MAX_REQUEST = 4096
_REQUEST_TIMEOUT_S = 10.0


class CacheFds:
    def __init__(self, cache_dir: Path, packed, tiers) -> None:
        self.path = Path(cache_dir) / SOCKET_NAME
        self.packed = packed
        self.tiers = tiers
        self.served = 0               # block descriptors handed out
        self.refused = 0              # connections from other users
        self.allowed_uids = {0, os.getuid()}
        self.listening = False        # the socket is bound (status shows the channel only then)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; when the socket cannot be made, log why and serve nothing."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with suppress(FileNotFoundError):
                os.unlink(self.path)
            await sock.bind(str(self.path))
            os.chmod(self.path, 0o600)      # connecting needs write permission: before this, only the owner had it
            sock.listen(16)
        except OSError as exc:
            sock.close()
            log.info("cache-file channel for local loaders off: %s: %s", self.path, exc)
            task_status.started()
            return
        self.listening = True
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    conn, _ = await sock.accept()
                    nursery.start_soon(self._serve, conn)
        finally:
            self.listening = False
            sock.close()
            with suppress(OSError):
                os.unlink(self.path)

    async def _serve(self, conn) -> None:
        fds: list[int] = []
        with conn:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid not in self.allowed_uids:     # the socket's mode says so too; this does not race it
                self.refused += 1
                return
            try:
                with trio.fail_after(_REQUEST_TIMEOUT_S):
                    request = await _read_line(conn)
                reply, fds = await self._answer(json.loads(request))
            except trio.TooSlowError:
                return
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                reply = {"ok": False, "error": f"bad request: {exc}"}
            except CachefsError as exc:
                reply = {"ok": False, "error": str(exc)}
            except Exception:          # a bug: logged, answered, never takes the daemon down
                log.exception("cache-file channel: request failed")
                reply = {"ok": False, "error": "internal error (see the daemon's log)"}
            try:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                await conn.sendmsg([json.dumps(reply).encode() + b"\n"], ancillary)
                self.served += len(fds)
            except OSError as exc:
                log.debug("cache-file channel: answer not sent: %s", exc)
            finally:
                for fd in fds:
                    os.close(fd)

    async def _answer(self, request: dict) -> tuple[dict, list[int]]:
        number, name = int(request["shard"]), str(request["name"])
        first, count = max(int(request["first"]), 0), min(max(int(request["count"]), 0), MAX_BLOCKS)
        f = self.packed.shard_version(number)
        if f.path.rsplit("/", 1)[-1] != name:
            raise ValueError(f"shard {number} is {f.path}, not {name}")
        fds: list[int] = []
        blocks = []
        for index in range(first, min(first + count, self.tiers.block_count(f))):
            fd = self.tiers.open_block_file(self.tiers.key(f, index))
            if fd is not None:
                fds.append(fd)
                blocks.append([index, self.tiers.block_len(f, index)])
        return {"ok": True, "block_size": self.tiers.block_size, "blocks": blocks}, fds


async def _read_line(conn) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = await conn.recv(_MAX_REQUEST)
        if not chunk:
            break
        buf += chunk
        if len(buf) > _MAX_REQUEST:
            raise ValueError("request over 4 KiB")
    return buf.split(b"\n", 1)[0]
