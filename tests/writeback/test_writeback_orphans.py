"""Orphaned multipart uploads: a SIGKILL mid multipart upload leaves the upload
open in the bucket (billed, never visible); the journal notes each upload id before its first part
and the next start aborts every noted upload. Real daemon, real moto server on loopback."""

import os

import pytest
from uploads import MIB, crash_mid_multipart_upload

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

@pytest.mark.allow_warnings          # the restarted daemon logs the crash it recovers from
def test_sigkill_mid_multipart_upload_leaves_no_open_upload(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = mount_factory(f"s3://{bucket}/p", "--endpoint-url", s3_server.endpoint_url, "--upload-part-size", "5M",
                        "--upload-concurrency", "1").start()
    crash_mid_multipart_upload(client, bucket, mnt, os.urandom(96 * MIB))
