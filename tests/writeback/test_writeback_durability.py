"""What must be on disk before the journal says so (crash campaign, cache dir turning read-only):
a copy-up's staging file is fsynced before its record is written, or a power cut (or an ext4
emergency read-only, which drops unsynced pages) leaves a record naming an empty copy that the
next start uploads over the object."""

import os

import trio
from kernel_free import Driver, counted, make_stack, running, stored
from memory_stores import MemoryBucket


def test_copy_up_is_durable_before_its_record(tmp_path):
    bucket = MemoryBucket()
    bucket.put("acked.log", b"acknowledged long ago\n" * 500)
    try:
        store = counted(bucket)
        vfs, wb = make_stack(store, str(tmp_path))
        synced: list[tuple[int, bool]] = []
        real_sync = wb.journal.sync_data

        def sync_data(fd: int) -> None:
            records = os.listdir(os.path.join(str(tmp_path), "records"))
            synced.append((os.fstat(fd).st_size, bool(records)))
            real_sync(fd)
        wb.journal.sync_data = sync_data

        async def main():
            async with running(vfs, wb):
                fs = Driver(vfs)
                assert await fs.call("write_at", "acked.log", os.O_APPEND, 0, b"more\n") == 5   # a copy-up
                assert synced and synced[0] == (11000, False)   # the whole copy, before any record
                wb.request_sync()
                assert await wb.wait_synced(None, 5)
        trio.run(main)
        assert stored(store, "acked.log") == b"acknowledged long ago\n" * 500 + b"more\n"
    finally:
        bucket.remove()
