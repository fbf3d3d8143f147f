"""docs/design.md invariant 1 on a real mount: a read never mixes object versions, and a change in the
bucket becomes visible after the metadata TTL (or never, for an --immutable dataset)."""

import os
import random
import time

import pytest
from mounts import overwrite_while_open

from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

BLOCK = 64 * 1024
SIZE = 8 * 1024 * 1024


def args(server, *extra):
    return ("--endpoint-url", server.endpoint_url, "--block-size", str(BLOCK), *extra)


def test_overwrite_while_open_never_mixes_versions(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    v1, v2 = random.Random(1).randbytes(SIZE), random.Random(2).randbytes(SIZE)
    client.put_object(Bucket=bucket, Key="obj", Body=v1)
    mnt = mount_factory(f"s3://{bucket}", *args(s3_server, "--metadata-ttl", "1")).start()
    overwrite_while_open(client, bucket, mnt, v1, v2, BLOCK)
    time.sleep(1.5)                                    # past the metadata TTL
    assert (mnt / "obj").read_bytes() == v2            # kernel pages of v1 were not kept
    assert os.stat(mnt / "obj").st_size == SIZE


def test_size_change_and_new_and_deleted_objects_after_ttl(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    client.put_object(Bucket=bucket, Key="d/a.txt", Body=b"version one")
    client.put_object(Bucket=bucket, Key="d/gone.txt", Body=b"bye")
    mnt = mount_factory(f"s3://{bucket}", *args(s3_server, "--metadata-ttl", "1")).start()
    assert (mnt / "d/a.txt").read_bytes() == b"version one"
    assert sorted(os.listdir(mnt / "d")) == ["a.txt", "gone.txt"]
    client.put_object(Bucket=bucket, Key="d/a.txt", Body=b"the second, longer version")
    client.put_object(Bucket=bucket, Key="d/new.txt", Body=b"new")
    client.delete_object(Bucket=bucket, Key="d/gone.txt")
    time.sleep(1.5)
    assert (mnt / "d/a.txt").read_bytes() == b"the second, longer version"
    assert os.stat(mnt / "d/a.txt").st_size == len(b"the second, longer version")
    assert sorted(os.listdir(mnt / "d")) == ["a.txt", "new.txt"]
    assert (mnt / "d/new.txt").read_bytes() == b"new"
    assert not (mnt / "d/gone.txt").exists()


def test_within_ttl_the_cached_version_is_served_whole(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    v1, v2 = random.Random(3).randbytes(3 * BLOCK), random.Random(4).randbytes(3 * BLOCK)
    client.put_object(Bucket=bucket, Key="f", Body=v1)
    mnt = mount_factory(f"s3://{bucket}", *args(s3_server, "--metadata-ttl", "3600")).start()
    heads = mnt.requests("head")                       # the mount's one probe for a pack manifest
    assert (mnt / "f").read_bytes() == v1
    client.put_object(Bucket=bucket, Key="f", Body=v2)
    assert (mnt / "f").read_bytes() == v1              # fully cached: still whole v1, no mix
    assert mnt.requests("head") == heads


def test_immutable_dataset_never_revalidates(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    client.put_object(Bucket=bucket, Key="f", Body=b"frozen")
    mnt = mount_factory(f"s3://{bucket}", *args(s3_server, "--immutable", "--metadata-ttl", "0")).start()
    assert mnt.requests("head") <= 1                   # the mount's one probe for a pack manifest
    heads = mnt.requests("head")
    assert (mnt / "f").read_bytes() == b"frozen"
    client.put_object(Bucket=bucket, Key="f", Body=b"FROZEN")
    time.sleep(0.2)
    assert (mnt / "f").read_bytes() == b"frozen"
    assert mnt.requests("head") == heads
    assert mnt.requests("list") == 1     # one listing of the root (a bucket root needs no prefix check)
