"""The write-back's control command (``cachefs sync``), called by the daemon's command table."""

import time
from collections.abc import AsyncIterator

from cachefs.writeback.engine import Writeback
from cachefs.writeback.policy import CLASSES


async def sync_command(writeback: Writeback, args: dict) -> AsyncIterator[dict]:
    """The control command behind ``cachefs sync``: {"class": log|checkpoint|None, "wait": bool,
    "timeout": s}. Streams {"progress": pending} lines while waiting, then {"done", "pending"}."""
    cls = args.get("class")
    if cls not in (None, *CLASSES):
        yield {"error": f"unknown sync class {cls!r}; use log or checkpoint"}
        return
    writeback.request_sync(cls)
    deadline = time.monotonic() + float(args.get("timeout", 3600))
    while args.get("wait") and time.monotonic() < deadline:
        left = writeback.pending(cls)
        if not left["files"] and not left["operations"]:
            break
        yield {"progress": left}
        await writeback.wait_changed(min(2.0, max(0.0, deadline - time.monotonic())))
    left = writeback.pending(cls)
    yield {"done": not left["files"] and not left["operations"], "pending": left}
