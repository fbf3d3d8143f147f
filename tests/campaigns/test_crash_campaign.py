"""The crash campaign (benchmarks/crash_campaign.py), CI-sized: 8 SIGKILLs of a daemon under a mixed
write-back load on real mounts against moto, each followed by a restart on the same cache dir and a
sync: no acknowledged byte lost, no partial object ever visible, journal and bucket (and the mount's
view) agree. The long run (>= 100 kills) is `python -m benchmarks.crash_campaign`; figures in
docs/reliability.md."""

import os
import subprocess

import pytest
from mounts import cachefs

from benchmarks.crash_campaign import check_bucket, content_problem, evidence, log_record, read_acks, run
from benchmarks.crash_campaign import checkpoint_bytes as ckpt
from testing.s3 import s3_client

pytestmark = pytest.mark.fuse


def campaign(s3_server, bucket, tmp_path, variant: str, trials: int) -> dict:
    stats, problems = run(s3_server.endpoint_url, bucket, tmp_path, trials=trials, variant=variant, seed=13,
                          max_blocks=200, run_for=(0.3, 1.5))
    assert problems == [], "\n".join(problems[:20])
    assert stats["kills"] == trials and stats["bytes_lost"] == 0 and stats["partial_objects_seen"] == 0
    assert stats["ops_acked"] > 0 and stats["bytes_acked"] > 0
    return stats


@pytest.mark.allow_warnings      # the restarted daemons log the crash they recover from
def test_sigkill_under_mixed_writeback_load_loses_nothing_acknowledged(s3_server, bucket, tmp_path):
    campaign(s3_server, bucket, tmp_path, "normal", 4)


@pytest.mark.allow_warnings
def test_sigkill_with_a_nearly_full_staging_area(s3_server, bucket, tmp_path):
    """--staging-size 1M: writes may be refused with ENOSPC (not acknowledged); nothing
    acknowledged is lost."""
    campaign(s3_server, bucket, tmp_path, "staging-full", 2)


@pytest.mark.allow_warnings
def test_cache_dir_turning_read_only_keeps_reads_going(s3_server, bucket, tmp_path):
    campaign(s3_server, bucket, tmp_path, "readonly", 2)


@pytest.mark.allow_warnings
def test_restart_after_sigkill_shows_what_the_killed_daemon_renamed(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    mnt = mount_factory(f"s3://{bucket}/p", "--endpoint-url", s3_server.endpoint_url,
                        "--log-sync-period", "0.2").start()
    with open(mnt / "a.tmp", "wb") as fh:
        fh.write(b"x" * 1000)
        fh.flush()
        os.fsync(fh.fileno())
    assert cachefs("sync", str(mnt.path), "--wait", "--timeout", "60").returncode == 0
    os.rename(mnt / "a.tmp", mnt / "a.bin")            # acknowledged: rename returned
    mnt.kill()
    subprocess.run(["fusermount3", "-u", "-z", str(mnt.path)], check=False)
    mnt.start()
    assert cachefs("sync", str(mnt.path), "--wait", "--timeout", "60").returncode == 0
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="p/").get("Contents", [])]
    assert keys == ["p/a.bin"]
    assert os.listdir(mnt.path) == ["a.bin"]          # the bucket has it; the mount must show it


def test_clean_remount_shows_what_the_mount_wrote(s3_server, bucket, mount_factory):
    client = s3_client(s3_server.endpoint_url)
    client.put_object(Bucket=bucket, Key="p/old.bin", Body=b"old")
    mnt = mount_factory(f"s3://{bucket}/p", "--endpoint-url", s3_server.endpoint_url).start()
    assert os.listdir(mnt.path) == ["old.bin"]         # listed (and saved in the snapshot)
    (mnt / "new.log").write_bytes(b"hello")
    (mnt / "sub").mkdir()
    os.rename(mnt / "old.bin", mnt / "moved.bin")      # a server-side copy, then a tombstone
    mnt.umount()                                       # drains: all of it is in the bucket
    keys = lambda: sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))  # noqa: E731
    assert keys() == ["p/moved.bin", "p/new.log", "p/sub/"]
    mnt.start()
    assert sorted(os.listdir(mnt.path)) == ["moved.bin", "new.log", "sub"]
    assert (mnt / "new.log").read_bytes() == b"hello"
    os.unlink(mnt / "new.log")                         # seen as an object: its delete is journaled
    assert cachefs("sync", str(mnt.path), "--wait", "--timeout", "60").returncode == 0
    assert keys() == ["p/moved.bin", "p/sub/"]


# ---- the checker itself (no mount): it must catch what it is there to catch ---------------------
def test_content_checks_catch_torn_and_truncated_content():
    log = log_record(b"one") + log_record(b"two")
    assert content_problem("logs/a.log", log) is None
    assert content_problem("logs/a.log", log[:-1]) is not None          # a truncated upload
    good = ckpt(7, 3)
    assert content_problem("ckpt/c.pt", good) is None
    assert content_problem("ckpt/c.pt", good[:8192]) is not None       # 2 of 3 blocks
    assert content_problem("ckpt/c.pt", good[:4096] + ckpt(8, 3)[4096:]) is None   # torn at a page: whole blocks
    assert content_problem("ckpt/c.pt", good[:100] + b"X" + good[101:]) is not None
    assert content_problem("tmp/c.pt.tmp", good[:8192]) is None         # a temp file cut by the crash


def test_checker_reports_lost_acknowledged_content(tmp_path):
    acks = tmp_path / "acks.jsonl"
    a, b = log_record(b"a"), log_record(b"a") + log_record(b"b")
    import hashlib
    import json
    md5 = lambda d: hashlib.md5(d).hexdigest()   # noqa: E731
    acks.write_text("\n".join(json.dumps(e) for e in [
        {"t": "intent", "path": "logs/x.log", "digest": md5(a)}, {"t": "ack", "path": "logs/x.log", "digest": md5(a),
                                                                   "written": 5},
        {"t": "intent", "path": "logs/x.log", "digest": md5(b)}]) + "\n{\"t\": \"ack\", \"pa")   # torn last line
    states, tally = read_acks(acks)
    assert tally["ops_acked"] == 1
    assert check_bucket({"logs/x.log": a}, states, {}) == []           # the acknowledged state
    assert check_bucket({"logs/x.log": b}, states, {}) == []           # the one in flight
    assert check_bucket({}, states, {"logs/x.log": 5}) != []           # lost
    assert check_bucket({"logs/y.log": a}, states, {}) != []           # never written


def test_a_failed_check_reports_the_evidence_for_its_path(tmp_path):
    """What the next reader of a rare failure needs before the tmp dir goes: where the object's
    complete records end, the writer's last events and the daemon's lines for that path."""
    import json
    good = log_record(b"one") + log_record(b"two")
    torn = good + log_record(b"three")[:-2] + b"??"
    acks = tmp_path / "acks.jsonl"
    acks.write_text("\n".join(json.dumps({"t": t, "path": p, "digest": "d"})
                              for t, p in [("intent", "logs/a.log"), ("ack", "logs/b.log"), ("ack", "logs/a.log")]))
    (tmp_path / "cachefs.log").write_text("uploaded logs/a.log (22 bytes)\nuploaded logs/b.log\n")
    text = evidence("logs/a.log", acks, tmp_path / "cachefs.log", torn)
    assert f"object {len(torn)} bytes, complete records up to {len(good)}" in text
    assert text.count('"path": "logs/a.log"') == 2 and "logs/b.log" not in text
    assert "uploaded logs/a.log (22 bytes)" in text
    assert "no object" in evidence("logs/c.log", acks, tmp_path / "missing.log", None)
