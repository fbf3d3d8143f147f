"""What a FUSE session is asked for (``SessionOptions``, from a mount's config) and what INIT
settled with the kernel (``Negotiated``, handed to a daemon that takes the connection over)."""

import os
from dataclasses import dataclass

from cachefs.fuse import abi


@dataclass(frozen=True, slots=True)
class SessionOptions:
    max_background: int = 64
    congestion_threshold: int = 48
    passthrough: bool = False           # ask for FUSE_PASSTHROUGH (where the kernel offers it)
    readdirplus: bool = True
    loops: int = 0                      # extra request loops: threads reading cloned descriptors
    loop_processes: str = ""            # ... or processes that answer published opens themselves:
                                        # "process" (asked for), "auto" (where they can run), "" (never)
    inflight: str | None = None         # the in-flight log's path (a mount under a keeper)
    no_open: bool = False               # ask for zero-message opens (FUSE_NO_OPEN_SUPPORT), answer OPEN ENOSYS
    table_slots: int = 81920            # backings the loops' table can publish (idle ones and open ones)
    poll_s: float = 0.0                 # how long the loop polls for a next request before it sleeps

    @classmethod
    def from_config(cls, cfg, *, passthrough: bool, kept: bool) -> "SessionOptions":
        """A mount's session (``cfg``: its MountConfig): congestion at 3/4 of the background
        requests; the in-flight log in the cache dir where a keeper keeps the mount (``kept``)."""
        return cls(max_background=cfg.fuse_max_background,
                   congestion_threshold=max(1, cfg.fuse_max_background * 3 // 4), passthrough=passthrough,
                   loops=cfg.fuse_loops,
                   loop_processes=cfg.fuse_loop_kind if cfg.fuse_loop_kind != "thread" and cfg.immutable else "",
                   inflight=os.path.join(cfg.cache_dir, "fuse-inflight") if kept else None,
                   no_open=cfg.fuse_no_open, table_slots=cfg.fuse_idle_backings + 16384,
                   poll_s=cfg.fuse_poll_us / 1e6)


@dataclass(slots=True)
class Negotiated:
    """What INIT settled: the protocol minor and the flags both sides agreed on."""

    minor: int = 0
    flags: int = 0
    kernel_flags: int = 0
    max_readahead: int = 0
    max_write: int = abi.MAX_WRITE

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    @property
    def resend(self) -> bool:
        """The kernel can send again the requests a dead server had read (Linux 6.9+;
        CACHEFS_TEST_NO_RESEND=1 plays an older kernel, for the tests of the keeper's fallback)."""
        return bool(self.kernel_flags & abi.HAS_RESEND) and os.environ.get("CACHEFS_TEST_NO_RESEND") != "1"

    def export(self) -> dict:
        return {"minor": self.minor, "flags": self.flags, "kernel_flags": self.kernel_flags,
                "max_readahead": self.max_readahead, "max_write": self.max_write, "resend": self.resend}

    @classmethod
    def adopt(cls, values: dict) -> "Negotiated":
        return cls(values["minor"], values["flags"], values["kernel_flags"], values["max_readahead"],
                   values["max_write"])
