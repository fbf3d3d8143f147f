"""Multipart uploads caught mid-way by a SIGKILL: finding them in the bucket, killing the daemon
while one is open, and the whole crash-and-recover sequence (write-back tests on moto and Ceph RGW)."""

import subprocess
import time

from mounts import cachefs

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
