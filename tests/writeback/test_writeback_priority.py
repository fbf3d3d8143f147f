"""Log-class uploads go before checkpoint parts: while a log upload runs, no new part starts."""

import threading
import time

import trio

from cachefs.metrics import Metrics
from cachefs.store import ObjectInfo
from cachefs.writeback.engine import SyncPolicy, Writeback
from cachefs.writeback.journal import Journal
from cachefs.writeback.policy import WritebackOptions


class SlowStore:
    """Records when each request starts and ends; a log PUT takes 0.3 s, a part 0.05 s."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()

    def _timed(self, what: str, seconds: float) -> None:
        started = time.monotonic()
        time.sleep(seconds)
        with self.lock:
            self.events.append((what, started, time.monotonic()))

    def put(self, path: str, data: bytes) -> ObjectInfo:
        self._timed("put", 0.3)
        return ObjectInfo(path, len(data), time.time(), "e")

    def start_upload(self, path: str) -> str:
        return "u"

    def upload_part(self, path: str, upload_id: str, number: int, data: bytes) -> str:
        self._timed("part", 0.05)
        return f"p{number}"

    def finish_upload(self, path, upload_id, parts, size) -> ObjectInfo:
        return ObjectInfo(path, size, time.time(), "e-n")

    def abort_upload(self, path, upload_id) -> None:
        pass

    def head(self, path: str) -> ObjectInfo:
        raise AssertionError("not expected")


def test_checkpoint_parts_wait_for_a_log_upload(tmp_path):
    store = SlowStore()
    policy = SyncPolicy(("*.log",), ("*.pt",), 1 << 20, 600.0, 600.0, 600.0)
    wb = Writeback(store, Journal(str(tmp_path)), WritebackOptions(policy, staging_size=1 << 30, staging_wait=1,
                   part_size=1000, upload_concurrency=1, log_concurrency=1), Metrics())

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(wb.run)
            ckpt = await wb.create("model.pt", remote=False)
            await wb.write(ckpt, 0, b"c" * 20_000)         # 20 parts of 1000 bytes, one at a time
            wb.request_sync("checkpoint")
            await trio.sleep(0.2)
            log = await wb.create("train.log", remote=False)
            await wb.write(log, 0, b"line\n")
            wb.request_sync("log")
            assert await wb.wait_synced(None, 10)
            nursery.cancel_scope.cancel()

    trio.run(main)
    (_, put_start, put_end), = [e for e in store.events if e[0] == "put"]
    parts = [e for e in store.events if e[0] == "part"]
    assert len(parts) == 20
    assert not [p for p in parts if put_start + 0.01 < p[1] < put_end - 0.01], "a part started during the log PUT"
    assert any(p[1] >= put_end - 0.01 for p in parts)      # the checkpoint went on afterwards
