import pytest

from cachefs.errors import ConfigError, ExitCode
from cachefs.metrics import Metrics
from cachefs.store import StoreURL, open_store, parse_url
from cachefs.store.fsspec_store import FsspecStore
from cachefs.store.s3.store import S3Store


@pytest.mark.parametrize("url, expected", [
    ("s3://bucket", StoreURL("s3", "bucket", "")),
    ("s3://bucket/", StoreURL("s3", "bucket", "")),
    ("s3://my.bucket-1/data/train/", StoreURL("s3", "my.bucket-1", "data/train")),
    ("S3://bucket/a?b#c", StoreURL("s3", "bucket", "a?b#c")),   # S3 keys may hold ? and #
    ("file:///tmp/data", StoreURL("file", "", "tmp/data")),
    ("memory://bkt/root", StoreURL("memory", "bkt", "root")),
])
def test_parse_valid_urls(url, expected):
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", [
    "s3://", "s3:///x", "s3:/bucket", "bucket/prefix", "", "nosuchscheme://b/p",
    "s3://bucket/../etc", "s3://bucket/a/./b", "file://",
])
def test_parse_rejects_malformed_urls(url):
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize("url", [
    "s3://AKIAXXXX:SeCrEt@bucket/p",
    "s3://SeCrEt@bucket/p",
    "s3://bucket/p?X-Amz-Credential=AKIA&X-Amz-Signature=SeCrEt",
    "s3://bucket/p?AWSAccessKeyId=AKIA&Signature=SeCrEt",
    "s3:/AKIA:SeCrEt@bucket/p",
])
def test_parse_rejects_credentials_without_echoing_them(url):
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert "SeCrEt" not in str(info.value)


def test_str_round_trips():
    assert str(parse_url("s3://b/x/y/")) == "s3://b/x/y"
    assert str(parse_url("file:///tmp/d")) == "file:///tmp/d"


def test_open_store_picks_the_backend(s3_server):
    metrics = Metrics()
    s3 = open_store("s3://some-bucket/p", metrics=metrics, endpoint_url=s3_server.endpoint_url)
    assert isinstance(s3, S3Store)
    assert s3.identity == f"s3|{s3_server.endpoint_url}|some-bucket|p"
    s3.close()
    mem = open_store("memory://some-bucket/p", metrics=metrics)
    assert isinstance(mem, FsspecStore)
    assert mem.identity == "memory|/some-bucket/p"


def test_open_store_unknown_profile_is_a_config_error():
    with pytest.raises(ConfigError, match="profile"):
        open_store("s3://b/p", metrics=Metrics(), profile="cachefs-test-no-such-profile")
