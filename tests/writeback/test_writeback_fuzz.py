"""Random file operations on a writable mount and on a local directory give the same results
(a Hypothesis state machine, as JuiceFS tests its FUSE layer), and after `sync --wait` the
bucket holds exactly what the local directory holds.

One mount per test (moto on loopback), reused by every example; each example works in a fresh
sub-directory of it and of the reference directory. Short sync periods make uploads, retires
and copy-ups race with the operations, which is where write-back bugs live.
"""

import itertools

import pytest
from hypothesis.stateful import run_state_machine_as_test
from writeback_model import SETTINGS, LocalSide, bucket_tree, make_machine, sync_mount

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse


def test_random_operations_match_a_local_directory(s3_server, bucket, mount_factory, tmp_path):
    client = s3_client(s3_server.endpoint_url)
    mnt = mount_factory(f"s3://{bucket}", "--endpoint-url", s3_server.endpoint_url, "--block-size", "64K",
                        "--log-sync-period", "0.3", "--checkpoint-quiet-period", "0.3",
                        "--small-file-size", "100K", "--upload-part-size", "5M").start()
    reference = tmp_path / "reference"
    reference.mkdir()
    counter = itertools.count()

    def new_example():
        name = f"ex{next(counter)}"
        (mnt.path / name).mkdir()
        (reference / name).mkdir()
        return name, LocalSide(mnt.path / name), LocalSide(reference / name)

    machine = make_machine(new_example, lambda: sync_mount(mnt.path),
                           lambda name: bucket_tree(client, bucket, f"{name}/"))
    run_state_machine_as_test(machine, settings=SETTINGS)
