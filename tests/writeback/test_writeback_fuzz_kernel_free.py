"""The Hypothesis differential machine of ``test_writeback_fuzz`` on the kernel-free stack: the
same rules drive ``Vfs`` + ``Writeback`` (through ``kernel_free.Driver``, which does the kernel's
path walk and checks) and a local reference directory, over an in-memory store. No mount; short
sync periods make uploads, retires and copy-ups race with the operations."""

import itertools
import os

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from kernel_free import Portal, SyncDriver, make_policy, make_stack
from memory_stores import MemoryBucket
from writeback_model import LocalSide, make_machine

SETTINGS = settings(max_examples=int(os.environ.get("CACHEFS_FUZZ_EXAMPLES", "40")), stateful_step_count=30,
                    deadline=None, suppress_health_check=list(HealthCheck))


def store_tree(store, prefix: str) -> tuple[dict[str, bytes], set[str]]:
    """Files (with content) and folders the store holds under directory ``prefix``."""
    files, folders = {}, set()

    def visit(rel: str) -> None:
        listing = store.list_dir(f"{prefix}/{rel}/" if rel else f"{prefix}/")
        for name in listing.dirs:
            child = f"{rel}/{name}" if rel else name
            folders.add(child)
            visit(child)
        for info in listing.files:
            child = info.path[len(prefix) + 1:]
            files[child] = store.get(info.path, 0, info.size, info.etag, info.size)

    visit("")
    return files, folders


def test_random_operations_match_a_local_directory_without_a_kernel(tmp_path):
    bucket = MemoryBucket()
    store = bucket.store().inner
    policy = make_policy(log_period=0.3, quiet=0.3, checkpoint=0.3)
    vfs, wb = make_stack(store, str(tmp_path / "staging"), policy=policy, part_size=64 << 10)
    reference = tmp_path / "reference"
    reference.mkdir()
    counter = itertools.count()
    try:
        with Portal(vfs, wb) as portal:
            def new_example():
                name = f"ex{next(counter)}"
                SyncDriver(portal).mkdir(name)
                (reference / name).mkdir()
                return name, SyncDriver(portal, name), LocalSide(reference / name)

            def sync():
                assert portal.sync(60), wb.pending()

            machine = make_machine(new_example, sync, lambda name: store_tree(store, name))
            run_state_machine_as_test(machine, settings=SETTINGS)
    finally:
        bucket.remove()
