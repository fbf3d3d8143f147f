"""The loader channel, the daemon's side: a loader on this machine (``cachefs.data``) asks for the
disk-tier files that hold a packed shard and reads them itself, with no FUSE request per read
(the short-circuit local read of HDFS and Alluxio; docs/design.md, components, the packer's lever),
and asks for a shard's warm explicitly. The wire format is ``wire``.

A unix socket, ``CACHE_DIR/loader.sock``, mode 0600, whose peers are checked (SO_PEERCRED): only
the daemon's user and root are answered, and they may read the cache files anyway. The daemon
names it in its control handshake (``hello``), with the wire version.

For ``files`` the daemon opens, read-only, the disk-tier file of each asked block it holds and
says where the block's bytes start in it; the loader needs nothing of the cache file's format. It fetches nothing: a block not on disk is read through the mount, which fetches
it. A cache file is never rewritten in place (temp + rename) and an evicted one stays readable
through its descriptor, so the loader reads the bytes the daemon checked in. The loader checks
each record's crc32c itself and falls back to reading through the mount on any trouble.
"""

import array
import logging
import os
import socket
import struct
from contextlib import suppress
from pathlib import Path

import trio

from cachefs.errors import CachefsError
from cachefs.packed import wire
from cachefs.ports import Port

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 10.0


class LoaderChannel:
    def __init__(self, cache_dir: Path, packed, tiers, shard_read: Port | None = None) -> None:
        self.path = Path(cache_dir) / wire.SOCKET_NAME
        self.packed = packed
        self.tiers = tiers
        self.shard_read = shard_read or Port("shard_read")    # the shard warm (daemon.py wires it)
        self.served = 0               # block descriptors handed out
        self.warms = 0                # shard warms asked for
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
            log.info("loader channel (cache files for local loaders) off: %s: %s", self.path, exc)
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

    def advertised(self) -> dict | None:
        """What the control handshake says of the channel (None while it is not listening)."""
        return {"socket": str(self.path), "wire": wire.WIRE} if self.listening else None

    async def _serve(self, conn) -> None:
        fds: list[int] = []
        with conn:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid not in self.allowed_uids:     # the socket's mode says so too; this does not race it
                self.refused += 1
                return
            request_wire = wire.WIRE
            try:
                with trio.fail_after(_REQUEST_TIMEOUT_S):
                    line = await _read_line(conn)
                request = wire.decode_request(line)
                request_wire = request.wire
                answer, fds = self._answer(request)
            except trio.TooSlowError:
                return
            except (wire.WireError, IndexError) as exc:
                answer = wire.encode_error(request_wire, str(exc))
            except CachefsError as exc:
                answer = wire.encode_error(request_wire, str(exc))
            except Exception:          # a bug: logged, answered, never takes the daemon down
                log.exception("loader channel: request failed")
                answer = wire.encode_error(request_wire, "internal error (see the daemon's log)")
            try:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                await conn.sendmsg([answer], ancillary)
                self.served += len(fds)
            except OSError as exc:
                log.debug("loader channel: answer not sent: %s", exc)
            finally:
                for fd in fds:
                    os.close(fd)

    def _answer(self, request: wire.Files | wire.Warm) -> tuple[bytes, list[int]]:
        f = self.packed.shard_version(request.shard)
        if f.path.rsplit("/", 1)[-1] != request.name:
            raise wire.WireError(f"shard {request.shard} is {f.path}, not {request.name}")
        if isinstance(request, wire.Warm):
            self.warms += 1
            self.shard_read(f)
            return wire.encode_warm(bool(self.shard_read)), []
        fds: list[int] = []
        extents = []
        for index in range(request.first, min(request.first + request.count, self.tiers.block_count(f))):
            opened = self.tiers.open_cache_file(f, index)
            if opened is not None:
                fd, offset = opened
                fds.append(fd)
                extents.append(wire.Extent(index, self.tiers.block_len(f, index), offset))
        return wire.encode_files(request, self.tiers.block_size, extents), fds


async def _read_line(conn) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = await conn.recv(wire.MAX_REQUEST)
        if not chunk:
            break
        buf += chunk
        if len(buf) > wire.MAX_REQUEST:
            raise wire.WireError("request over 4 KiB")
    return buf.split(b"\n", 1)[0]
