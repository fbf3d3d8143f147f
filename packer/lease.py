"""One pack at a time per destination and worker: a lease object below DST/work/.

A pack writes ``work/lease-<worker>.json`` (host, pid, start, renewal time) before it plans and
renews it every ``RENEW_S`` seconds from a helper thread; it deletes it when it ends, however it
ends. A second pack of the same DST (and worker index) that finds a lease renewed within
``TTL_S`` refuses to start with exit code 25, naming the holder. A lease left by a killed pack
expires after ``TTL_S``. Object stores have no compare-and-swap that every S3 server honours, so
two packs started within the same instant may both proceed: their output is the same bytes (the
plan is deterministic), so the destination stays consistent; the lease is there to turn the
common mistake (a second run while one is going) into a clear message.
"""

import json
import os
import socket
import threading
import time
import uuid

from cachefs.errors import NoSuchKey
from cachefs.packfmt.errors import PackBusy
from cachefs.packfmt.store_index import read_object
from cachefs.store import ObjectStore

from .layout import WORK

TTL_S = 60.0
RENEW_S = 10.0


def lease_path(worker_index: int) -> str:
    return f"{WORK}/lease-{worker_index:05d}.json"


class Lease:
    def __init__(self, dst: ObjectStore, worker_index: int, ttl: float = TTL_S, renew: float = RENEW_S) -> None:
        self.dst, self.path = dst, lease_path(worker_index)
        self.ttl, self.renew = ttl, renew
        self.record = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.time(), "renewed": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Lease":
        held = self._current()
        if held is not None and held.get("id") != self.record["id"] and time.time() - held["renewed"] < self.ttl:
            raise PackBusy(f"another cachefs pack is writing {self.dst.url} (host {held.get('host')}, pid "
                           f"{held.get('pid')}, started {time.ctime(held.get('started', 0))}): wait for it to "
                           f"finish; if it died, run again after its lease expires ({self.ttl:.0f} s after "
                           f"{time.ctime(held['renewed'])})")
        self._write()
        self._thread = threading.Thread(target=self._renew_loop, name="pack-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.dst.delete(self.path)
            self.dst.remove_dir(WORK)       # once nothing else is below it (an interrupted pack's work stays)
        except Exception:       # noqa: BLE001  (the pack's own outcome matters more; the lease expires)
            pass

    def _current(self) -> dict | None:
        try:
            held = json.loads(read_object(self.dst, self.path))
        except (NoSuchKey, ValueError):
            return None
        return held if isinstance(held, dict) and isinstance(held.get("renewed"), (int, float)) else None

    def _write(self) -> None:
        self.record["renewed"] = time.time()
        self.dst.put(self.path, json.dumps(self.record).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew):
            try:
                self._write()
            except Exception:   # noqa: BLE001  (a store hiccup: the next renewal tries again)
                pass
