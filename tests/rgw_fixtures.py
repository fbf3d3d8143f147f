"""The fixtures of the tests against a real Ceph RGW (tests/ceph_rgw.py starts it): one cluster per
test module, its S3 user's keys in the environment mounts inherit, a client and a fresh bucket."""

import os
import uuid

import boto3
import pytest
from botocore.config import Config
from ceph_rgw import CephRGW

BLOCK = 256 * 1024


@pytest.fixture(scope="module")
def ceph_rgw():
    """One cluster for this module, stopped as soon as its tests are done (~0.3 GB RSS)."""
    missing = CephRGW.missing_binaries()
    if missing:
        message = f"ceph binaries missing: {' '.join(missing)} (`make deps` installs them)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; under CI the RGW tests must run", pytrace=False)
        pytest.skip(message)
    with CephRGW() as rgw:
        yield rgw


@pytest.fixture
def rgw(ceph_rgw: CephRGW, monkeypatch: pytest.MonkeyPatch) -> CephRGW:
    """The cluster, with its S3 user's keys in the environment `cachefs mount` inherits (never argv)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ceph_rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ceph_rgw.secret_key)
    return ceph_rgw


@pytest.fixture
def client(rgw: CephRGW):
    return boto3.client("s3", endpoint_url=rgw.endpoint_url, region_name="us-east-1",
                        aws_access_key_id=rgw.access_key, aws_secret_access_key=rgw.secret_key,
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16,
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


@pytest.fixture
def bucket(client) -> str:
    name = f"rgw-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    return name


def mount_args(rgw: CephRGW, *extra: str) -> tuple[str, ...]:
    return ("--endpoint-url", rgw.endpoint_url, "--block-size", str(BLOCK), *extra)
