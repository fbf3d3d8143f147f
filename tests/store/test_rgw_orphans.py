"""Orphaned multipart uploads on a real Ceph RGW (16.2): a daemon SIGKILLed mid multipart upload,
restarted on the same cache dir, aborts the upload the crash left open (its journal noted the id
before the first part). The cluster comes from test_rgw's fixtures (its own start, ~6-17 s)."""

import os

import pytest
from rgw_fixtures import bucket, ceph_rgw, client, mount_args, rgw  # noqa: F401  (fixtures)
from uploads import MIB, crash_mid_multipart_upload

pytestmark = pytest.mark.fuse


@pytest.mark.allow_warnings          # the restarted daemon logs the crash it recovers from
def test_sigkill_mid_multipart_upload_on_rgw_leaves_no_open_upload(rgw, client, bucket, mount_factory):  # noqa: F811
    mnt = mount_factory(f"s3://{bucket}/p", *mount_args(rgw, "--upload-part-size", "5M",
                                                        "--upload-concurrency", "1")).start()
    crash_mid_multipart_upload(client, bucket, mnt, os.urandom(48 * MIB))
