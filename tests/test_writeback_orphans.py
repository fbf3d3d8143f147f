"""Orphaned multipart uploads: a SIGKILL mid multipart upload leaves the upload
open in the bucket (billed, never visible); the journal notes each upload id before its first part
and the next start aborts every noted upload. Real daemon, real moto server on loopback."""

import os
import subprocess
import time

import pytest
from mounts import cachefs

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

MIB = 1 << 20


def open_uploads(client, bucket: str) -> list[str]:
    return [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def kill_mid_upload(client, bucket: str, mnt, key: str, timeout: float = 60.0) -> str:
    """SIGKILL the daemon once an upload of ``key`` has at least one part in the bucket."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for upload_id in open_uploads(client, bucket):
            if client.list_parts(Bucket=bucket, Key=key, UploadId=upload_id).get("Parts"):
                mnt.kill()
                return upload_id
        time.sleep(0.005)
    raise AssertionError(f"no multipart upload of {key} seen within {timeout} s")


def crash_mid_multipart_upload(client, bucket: str, mnt, payload: bytes) -> None:
    """Write ``model.pt`` through ``mnt``, start its upload, SIGKILL the daemon mid-upload, restart
    it on the same cache dir: the open upload is aborted, the object completes from the journal."""
    (mnt / "model.pt").write_bytes(payload)
    assert cachefs("sync", str(mnt.path)).returncode == 0              # starts the upload, returns
    upload_id = kill_mid_upload(client, bucket, mnt, "p/model.pt")
    assert upload_id in open_uploads(client, bucket)                   # the crash left it open
    notes = list((mnt.cache_dir / "staging" / "uploads").glob("*.json"))
    assert any(upload_id in n.read_text() for n in notes)              # noted before its first part
    subprocess.run(["fusermount3", "-u", "-z", str(mnt.path)], check=False)
    mnt.start()
    assert cachefs("sync", str(mnt.path), "--wait", "--timeout", "120").returncode == 0
    deadline = time.monotonic() + 30
    while upload_id in open_uploads(client, bucket) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_uploads(client, bucket) == []                          # the orphan is aborted
    assert not list((mnt.cache_dir / "staging" / "uploads").glob("*.json"))
    got = client.get_object(Bucket=bucket, Key="p/model.pt")["Body"].read()
    assert got == payload                                              # and the file made it


@pytest.mark.allow_warnings          # the restarted daemon logs the crash it recovers from
def test_sigkill_mid_multipart_upload_leaves_no_open_upload(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = mount_factory(f"s3://{bucket}/p", "--endpoint-url", s3_server.endpoint_url, "--upload-part-size", "5M",
                        "--upload-concurrency", "1").start()
    crash_mid_multipart_upload(client, bucket, mnt, os.urandom(96 * MIB))
