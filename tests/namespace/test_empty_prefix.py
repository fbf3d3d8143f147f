"""A new output prefix (no objects under it yet) mounts writable; a read-only mount of one is a
likely typo: refused with exit 3 unless --allow-empty-prefix."""

import pytest
from mounts import cachefs

from cachefs.errors import ExitCode
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse


def test_a_writable_mount_of_a_new_prefix_works_and_uploads(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    client.put_object(Bucket=bucket, Key="datasets/a.bin", Body=b"x")      # the bucket is not empty
    mnt = mount_factory(f"s3://{bucket}/run-42", "--endpoint-url", s3_server.endpoint_url).start()
    assert [p.name for p in mnt.path.iterdir()] == []
    (mnt / "logs").mkdir()
    (mnt / "logs" / "train.log").write_text("step 1 loss 0.5\n")
    (mnt / "model.ckpt").write_bytes(b"w" * 4096)
    result = cachefs("sync", str(mnt.path), "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stderr
    got = client.get_object(Bucket=bucket, Key="run-42/logs/train.log")["Body"].read()
    assert got == b"step 1 loss 0.5\n"
    assert client.get_object(Bucket=bucket, Key="run-42/model.ckpt")["Body"].read() == b"w" * 4096
    mnt.umount()


def test_a_read_only_mount_of_an_empty_prefix_is_refused_unless_allowed(s3_server, bucket, mount_factory):
    args = ("--endpoint-url", s3_server.endpoint_url, "--read-only")
    refused = mount_factory(f"s3://{bucket}/typo", *args, name="ro").try_start()
    assert refused.returncode == ExitCode.NOT_FOUND, refused.stderr
    assert "--allow-empty-prefix" in refused.stderr
    assert "Traceback" not in refused.stderr
    allowed = mount_factory(f"s3://{bucket}/typo", *args, "--allow-empty-prefix", name="ro2").start()
    assert [p.name for p in allowed.path.iterdir()] == []
    allowed.umount()


def test_a_missing_bucket_is_still_refused_on_a_writable_mount(s3_server, mount_factory):
    result = mount_factory("s3://no-such-bucket-cachefs/run-1", "--endpoint-url",
                           s3_server.endpoint_url).try_start()
    assert result.returncode == ExitCode.NOT_FOUND, result.stderr
