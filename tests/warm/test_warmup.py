"""`cachefs warmup` on real mounts of a moto bucket, through the fault-injecting proxy."""

import json
import os
import random
import signal
import subprocess
import threading
import time
from urllib.parse import urlparse

import pytest
from mounts import CACHEFS, cachefs, interruptible, put_tree

from testing.latency_proxy import LatencyProxy
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse

BLOCK = 64 * 1024


def make_files(n: int = 24, seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"ds/train/c{i % 3}/img_{i}.jpg": rng.randbytes(rng.randint(1, 30_000)) for i in range(n)}
    files["ds/train/empty.txt"] = b""
    files["ds/val/big.bin"] = rng.randbytes(5 * BLOCK + 17)        # 6 ranged GETs
    files["other/x.bin"] = b"not warmed"
    return files


@pytest.fixture
def proxied(s3_server, bucket):
    url = urlparse(s3_server.endpoint_url)
    with LatencyProxy(url.hostname, url.port, latency=0.0) as proxy:
        yield proxy, bucket, s3_client(s3_server.endpoint_url)


def mount(proxy, bucket, mount_factory, *extra, **kwargs):
    # These tests count GETs exactly (each object fetched once); a hedged GET (a second GET for a
    # straggler, tests/test_hedge*.py) is right but would be counted too, and a loaded test machine
    # makes stragglers: hedging is off here.
    return mount_factory(f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url, "--block-size", str(BLOCK),
                         "--metadata-ttl", "3600", "--connect-timeout", "1", "--max-attempts", "2",
                         "--hedge-budget", "0", *extra, **kwargs).start()


def warmup(*args: str, timeout: float = 120) -> tuple[int, list[dict], str]:
    result = cachefs("warmup", "--json", *args, timeout=timeout)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return result.returncode, lines, result.stderr


def final(lines: list[dict]) -> dict:
    return [r for r in lines if r.get("event") in ("done", "check", "evicted", "unpinned")][-1]


def ds_files(files: dict[str, bytes], prefix: str = "ds/") -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k.startswith(prefix)}


def test_warm_then_read_everything_with_the_store_refusing(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = make_files()
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory)
    code, lines, err = warmup(str(mnt / "ds"))
    assert code == 0, err
    done = final(lines)
    wanted = ds_files(files)
    assert done["files"] == len(wanted) and done["failed_files"] == 0
    assert done["fetched_files"] == len([v for v in wanted.values() if v])
    assert done["bytes"] == sum(map(len, wanted.values())) == done["done_bytes"]
    assert mnt.requests("get") == sum(-(-len(v) // BLOCK) for v in wanted.values())
    assert not [r for r in lines if r.get("event") == "listed"]   # a mutable mount's entries expire: no listing

    code, lines, _ = warmup("--check", str(mnt / "ds"))
    check = final(lines)
    assert code == 0
    assert check["files"] == check["cached_files"] == check["disk"]["files"] == len(wanted)
    assert check["bytes"] == check["cached_bytes"] == check["disk"]["bytes"] == sum(map(len, wanted.values()))
    assert check["memory"]["blocks"] == 0                     # warm fills go to the disk tier only

    lists = mnt.requests("list")
    proxy.refuse(True)
    for path, data in wanted.items():
        assert (mnt / path).read_bytes() == data, path
    assert mnt.requests("list") == lists                    # the listing was warmed too
    with pytest.raises(OSError):
        (mnt / "other/x.bin").read_bytes()                  # not warmed: the store is down
    proxy.refuse(False)

    code, lines, _ = warmup(str(mnt / "ds"))                 # a rerun fetches nothing
    again = final(lines)
    assert code == 0 and again["fetched_files"] == 0 and again["cached_files"] == len(wanted)


@pytest.mark.parametrize("immutable", [True, False], ids=["immutable", "mutable"])
def test_a_warmup_the_launcher_waits_for_is_listed_on_an_immutable_mount(proxied, mount_factory, immutable):
    """``launcher.warm`` (the CSI agent's warmup at stage, waited for) lists what it warmed through
    an immutable mount, as `cachefs warmup` does: every directory of the path, once each."""
    from cachefs import launcher

    proxy, bucket, client = proxied
    put_tree(client, bucket, "", make_files())
    mnt = mount(proxy, bucket, mount_factory, *(("--immutable",) if immutable else ()))
    final = launcher.warm(str(mnt.path), ["ds"])
    assert final["state"] == "done" and final["failed_files"] == 0
    if immutable:      # ds: train, val; train: c0-c2, empty.txt; c0-c2: 24 files; val: big.bin
        assert {k: final["listed"][k] for k in ("entries", "directories", "errors")} == \
            {"entries": 2 + 4 + 24 + 1, "directories": 6, "errors": 0}, final["listed"]
    else:
        assert "listed" not in final


def test_manifest_glob_url_and_evict(proxied, mount_factory, tmp_path):
    proxy, bucket, client = proxied
    files = make_files()
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory)
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\ntrain/c0/img_0.jpg,1\ntrain/c1/img_1.jpg,2\nval/big.bin,3\n")
    code, lines, err = warmup("--manifest", str(manifest), str(mnt / "ds"))
    assert code == 0, err
    assert final(lines)["files"] == 3 and final(lines)["fetched_files"] == 3

    code, lines, err = warmup(f"{mnt.path}/ds/train/c2/*.jpg")
    c2 = [k for k in files if k.startswith("ds/train/c2/")]
    assert code == 0, err
    assert final(lines)["files"] == len(c2)

    code, lines, err = warmup("--check", f"s3://{bucket}/ds/train")
    assert code == 0, err
    check = final(lines)
    assert check["files"] == len([k for k in files if k.startswith("ds/train/")])
    assert check["cached_files"] == len(c2) + 2 + 1          # + the empty file

    code, lines, _ = warmup("--evict", f"{mnt.path}/ds/train/c2/*.jpg")
    assert code == 0 and final(lines)["blocks"] == len(c2)
    code, lines, _ = warmup("--check", f"{mnt.path}/ds/train/c2/*.jpg")
    assert final(lines)["cached_files"] == 0 and final(lines)["disk"]["bytes"] == 0


def test_missing_dataset_and_no_daemon(proxied, mount_factory, tmp_path):
    proxy, bucket, client = proxied
    put_tree(client, bucket, "", make_files(4))
    mnt = mount(proxy, bucket, mount_factory)
    code, lines, err = warmup(str(mnt / "ds/nope"), str(mnt / "ds/train/c0"))
    assert code == 11, err
    assert final(lines)["failures"] == [{"path": "ds/nope", "error": "no such file or directory"}]
    result = cachefs("warmup", str(tmp_path))
    assert result.returncode == 9
    assert result.stderr.count("\n") == 1 and "not inside a cachefs mount" in result.stderr


def test_capacity_refusal_and_force(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = {f"ds/f{i}.bin": random.Random(i).randbytes(BLOCK) for i in range(12)}      # 768 KiB
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory, "--cache-size", "512K", "--mem-cache-size", "1M")
    result = cachefs("warmup", str(mnt / "ds"))
    assert result.returncode == 12, result.stderr
    assert "needs" in result.stderr and "capacity 524288" in result.stderr
    assert mnt.requests("get") == 0
    code, lines, _ = warmup("--force", "--concurrency", "1", str(mnt / "ds"))
    done = final(lines)
    assert code == 11 and 0 < done["fetched_files"] < 12
    assert all("cache is full" in f["error"] for f in done["failures"])
    # the warmup never evicted its own beginning: everything it fetched is still there
    _, lines, _ = warmup("--check", str(mnt / "ds"))
    assert final(lines)["disk"]["files"] == done["fetched_files"]


def test_ctrl_c_stops_and_a_rerun_fetches_only_the_rest(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = {f"ds/f{i:03d}.bin": random.Random(i).randbytes(2000 + i) for i in range(120)}
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory)
    os.listdir(mnt / "ds")
    proxy.set_latency(0.2)                      # >= 12 s for all 120: Ctrl-C comes long before
    proc = subprocess.Popen([*CACHEFS, "warmup", "--json", "--concurrency", "2", str(mnt / "ds")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    for line in proc.stdout:
        reply = json.loads(line)
        if reply.get("done_files", 0) >= 10:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    deadline = time.monotonic() + 10
    while mnt.status()["warmup"]["running"]:
        assert time.monotonic() < deadline, "the warmup did not stop after Ctrl-C"
        time.sleep(0.05)
    assert mnt.status()["warmup"]["last"]["state"] == "cancelled"
    proxy.set_latency(0.0)
    _, lines, _ = warmup("--check", str(mnt / "ds"))
    cached = final(lines)["cached_files"]
    assert 10 <= cached < 120
    gets = mnt.requests("get")
    code, lines, _ = warmup(str(mnt / "ds"))
    done = final(lines)
    assert code == 0
    assert (done["cached_files"], done["fetched_files"]) == (cached, 120 - cached)
    assert mnt.requests("get") - gets == 120 - cached
    for path, data in files.items():
        assert (mnt / path).read_bytes() == data


def test_foreground_read_is_not_queued_behind_a_warmup_and_a_second_warmup_joins(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = {f"ds/f{i:03d}.bin": random.Random(i).randbytes(1000) for i in range(200)}
    files["solo.bin"] = b"read me now" * 100
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory, "--max-fetches", "2")
    os.listdir(mnt / "ds")
    assert (mnt / "solo.bin").stat().st_size
    proxy.set_latency(0.05)
    first = subprocess.Popen([*CACHEFS, "warmup", "--json", "--concurrency", "8", str(mnt / "ds")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(first.stdout.readline())["joined"] is False
    code, lines, err = [None], [None], [None]

    def second():
        code[0], lines[0], err[0] = warmup(str(mnt / "ds"))
    joiner = threading.Thread(target=second)
    joiner.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert (mnt / "solo.bin").read_bytes() == files["solo.bin"]
    assert time.monotonic() - started < 1.0          # ~2 round trips of 50 ms, not 200 files / 8
    out, _ = first.communicate(timeout=60)
    joiner.join(60)
    assert first.returncode == 0 and code[0] == 0, err[0]
    assert lines[0][0]["joined"] is True and final(lines[0])["files"] == 200
    assert mnt.requests("get") == 201                     # each object fetched once


def test_pin_survives_a_remount_and_unpin(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = {f"ds/f{i}.bin": random.Random(i).randbytes(BLOCK) for i in range(4)}
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory)
    code, lines, _ = warmup("--pin", str(mnt / "ds"))
    assert code == 0
    assert mnt.status()["tiers"]["disk"]["held_bytes"] >= 4 * BLOCK
    mnt.umount()
    mnt.start()
    status = mnt.status()
    assert status["tiers"]["disk"]["held_bytes"] >= 4 * BLOCK and len(status["warmup"]["pinned"]) == 1
    code, lines, _ = warmup("--unpin", str(mnt / "ds"))
    assert code == 0 and final(lines)["unpinned"] is True
    assert mnt.status()["tiers"]["disk"]["held_bytes"] == 0
    human = cachefs("status", str(mnt.path))
    assert human.returncode == 0


def test_prefetch_dataset_warms_the_rest(proxied, mount_factory):
    proxy, bucket, client = proxied
    files = {f"ds/c{i % 4}/f{i:03d}.bin": random.Random(i).randbytes(3000) for i in range(80)}
    put_tree(client, bucket, "", files)
    mnt = mount(proxy, bucket, mount_factory, "--immutable", "--prefetch-dataset")
    names = sorted(files)
    for path in names[:40]:
        assert (mnt / path).read_bytes() == files[path]
    deadline = time.monotonic() + 30
    while True:
        _, lines, _ = warmup("--check", str(mnt / "ds"))
        if final(lines)["cached_files"] == 80:
            break
        assert time.monotonic() < deadline, final(lines)
        time.sleep(0.2)
    assert "ds" in mnt.status()["warmup"]["dataset_prefetch"]["datasets"]
