"""FsspecStore on memory:// (in-process) and file:// (what the FUSE tests use)."""

import os
import uuid

import fsspec
import pytest

from cachefs.errors import NoSuchBucket, NoSuchKey, StoreError, VersionChanged
from cachefs.metrics import Metrics
from cachefs.store import ObjectStore, open_store
from cachefs.store.fsspec_store import FsspecStore, version_token

TREE = {"a.txt": b"hello world", "d/b.bin": bytes(range(256)) * 10, "d/e/c": b"c", "z": b""}


@pytest.fixture(params=["memory", "file"])
def root_url(request, tmp_path):
    """A URL whose root holds TREE."""
    if request.param == "memory":
        url = f"memory://bkt-{uuid.uuid4().hex[:12]}/root"
        base = url
    else:
        url = base = f"file://{tmp_path}/root"
    fs = fsspec.filesystem(request.param)
    for path, data in TREE.items():
        fs.makedirs(fs._parent(f"{base}/{path}"), exist_ok=True)
        fs.pipe_file(f"{base}/{path}", data)
    yield url
    fs.rm(fs._strip_protocol(base), recursive=True)


@pytest.fixture
def metrics():
    return Metrics()


@pytest.fixture
def store(root_url, metrics):
    return open_store(root_url, metrics=metrics)


def overwrite(store: FsspecStore, path: str, data: bytes) -> None:
    store._fs.pipe_file(store._full(path), data)


def test_list_dir_gives_files_and_dirs_relative_to_root(store):
    root = store.list_dir("")
    assert sorted(f.path for f in root.files) == ["a.txt", "z"]
    assert root.dirs == ["d"]
    sub = store.list_dir("d/")
    assert [f.path for f in sub.files] == ["d/b.bin"] and sub.dirs == ["e"]
    assert sub.files[0].size == 2560 and sub.files[0].mtime > 0
    assert store.list_dir("absent/").files == []


def test_list_all_is_recursive(store):
    assert [i.path for i in store.list_all()] == sorted(TREE)
    assert [i.path for i in store.list_all("d/")] == ["d/b.bin", "d/e/c"]


def test_head_and_get(store, metrics):
    info = store.head("d/b.bin")
    data = TREE["d/b.bin"]
    assert info.etag == store.list_dir("d/").files[0].etag
    assert store.get("d/b.bin", 0, info.size, info.etag, info.size) == data
    assert store.get("d/b.bin", 2048, info.size, info.etag, info.size) == data[2048:]
    assert store.get("z", 0, 0, store.head("z").etag, 0) == b""
    assert metrics.counter_value("cachefs_store_requests_total", op="get", status="ok") == 3
    assert metrics.counter_value("cachefs_store_read_bytes_total") == len(data) + 512


def test_get_after_overwrite_is_version_changed(store):
    info = store.head("a.txt")
    overwrite(store, "a.txt", b"a new and longer version")
    with pytest.raises(VersionChanged, match="a.txt"):
        store.get("a.txt", 0, 5, info.etag, info.size)


def test_change_during_read_is_detected(store, monkeypatch):
    info = store.head("a.txt")
    real_cat = store._fs.cat_file

    def cat_then_change(path, start, end):
        data = real_cat(path, start, end)
        overwrite(store, "a.txt", b"changed under the reader")
        return data
    monkeypatch.setattr(store._fs, "cat_file", cat_then_change)
    with pytest.raises(VersionChanged):
        store.get("a.txt", 0, 5, info.etag, info.size)


def test_missing_object_is_no_such_key(store, metrics):
    with pytest.raises(NoSuchKey, match="head .*/root/nope"):
        store.head("nope")
    with pytest.raises(NoSuchKey, match="nope"):
        store.get("nope", 0, 1, "x", 1)
    with pytest.raises(NoSuchKey):
        store.head("d")
    assert metrics.counter_value("cachefs_store_requests_total", op="head", status="not_found") == 2


def test_check(store, root_url, metrics):
    store.check()
    with pytest.raises(NoSuchKey, match="no objects under"):
        open_store(root_url + "/absent", metrics=metrics).check()
    with pytest.raises(NoSuchBucket):
        open_store(f"memory://absent-{uuid.uuid4().hex}", metrics=metrics).check()


def test_identity_and_file_urls(tmp_path):
    (tmp_path / "x").write_bytes(b"12345")
    store = FsspecStore(f"file://{tmp_path}/", metrics=Metrics())
    assert store.identity == f"file|{tmp_path}"
    assert store.url == f"file://{tmp_path}"            # what messages name: never the identity
    with pytest.raises(StoreError) as info:
        ObjectStore.put(store, "y", b"")                  # the base class's refusal
    assert str(info.value) == f"file://{tmp_path}: this store is read-only" and "|" not in str(info.value)
    info = store.head("x")
    assert info.etag.endswith(f"-5-{os.stat(tmp_path / 'x').st_ino:x}")   # mtime-size-inode


def test_version_token_prefers_etag():
    assert version_token({"ETag": '"abc"', "size": 3, "mtime": 1.0}) == "abc"
    assert version_token({"size": 16, "mtime": 1.5}) == f"{1_500_000_000:x}-10"
    assert version_token({"size": 16, "mtime": 1.5}) != version_token({"size": 16, "mtime": 1.6})
