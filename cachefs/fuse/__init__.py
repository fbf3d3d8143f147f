"""The FUSE layer: the kernel protocol over ``/dev/fuse`` (``session``), mounting (``mount``),
the handler types (``types``), and the pyfuse3 fallback (``pyfuse3_backend``).

The session (and trio with it), mounting and the handler types are imported on first use: a
request-loop process (``loop_worker``) imports this package for the table it answers from, and
nothing heavier (it starts while readers wait on a daemon that took a mount over).

``backend(name)`` returns what the daemon mounts and serves with: ``cachefs`` (our own session,
the default) or ``pyfuse3``. Both take the same ``fuse_ops.Operations``.
"""

from cachefs.fuse import abi

__all__ = ["Attr", "CachefsBackend", "Context", "DirReply", "FileInfo", "FuseError", "MountOptions", "Session",
           "SessionOptions", "SetattrFields", "StatFs", "backend"]


class CachefsBackend:
    """Our own session: mount with ``mount(2)`` (or fusermount3), serve, unmount."""

    name = "cachefs"

    def __init__(self, options=None, cloned=None) -> None:
        from cachefs.fuse.session import Session
        self.session = Session(options, cloned=cloned)
        self.kernel = self.session

    def mount(self, ops, mountpoint: str, *, allow_other: bool, read_only: bool) -> None:
        from cachefs.fuse.mount import MountOptions
        self.ops = ops
        self.session.mount(mountpoint, MountOptions(allow_other=allow_other, read_only=read_only))

    def adopt(self, ops, fds: list[int], negotiated: dict, mountpoint: str) -> None:
        """Serve a live mount a previous daemon served (``cachefs/keeper.py``)."""
        self.ops = ops
        self.session.adopt(fds, negotiated, mountpoint)

    async def serve(self) -> None:
        await self.session.serve(self.ops)

    def stop_reading(self) -> None:
        self.session.stop_reading()

    def settled(self) -> None:
        """Before a metrics scrape (its thread): what the session answered is counted."""
        self.session.settled()

    def terminate(self) -> None:
        self.session.terminate()

    def status(self) -> dict:
        n = self.session.negotiated
        return {"backend": self.name, "protocol": f"7.{n.minor}", "flags": abi.flag_names(n.flags).split(),
                "passthrough": self.session.passthrough, "requests": self.session.requests,
                "poll": self.session.poll.status() if self.session.poll is not None else None,
                "inflight_log": self.session.inflight.status() if self.session.inflight is not None else None,
                "loop_processes": self.session.procs.status() if self.session.procs is not None else None,
                "by_opcode": {abi.OPCODE_NAMES.get(op, str(op)): count
                              for op, count in sorted(self.session.opcodes.items())}}

    def close(self, unmount: bool) -> None:
        self.session.close(unmount)


def __getattr__(name: str):
    if name in ("Session", "SessionOptions"):
        from cachefs.fuse import session
        return getattr(session, name)
    if name == "MountOptions":
        from cachefs.fuse import mount
        return mount.MountOptions
    if name in ("Attr", "Context", "DirReply", "FileInfo", "FuseError", "SetattrFields", "StatFs"):
        from cachefs.fuse import types
        return getattr(types, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend(name: str, options=None, cloned=None):
    """``cloned``: a Port called with each request loop's cloned descriptor (our own layer)."""
    if name == "pyfuse3":
        from cachefs.fuse.pyfuse3_backend import Pyfuse3Backend
        return Pyfuse3Backend()
    return CachefsBackend(options, cloned)
