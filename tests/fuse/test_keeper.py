"""Mounts that outlive their daemon (cachefs/keeper.py), on real mounts against moto: SIGKILLs of
the daemon under readers that compare every byte and a writer of fsynced logs and checkpoints
(benchmarks/handover_campaign.py, CI-sized; the long run and its figures are in
docs/reliability.md), `cachefs restart` and `cachefs mount` again as hand-overs, the keeper's own
death, a daemon that dies as soon as it serves, a kernel that cannot resend, --no-keeper."""

import errno
import os
import signal
import threading
import time
import urllib.request

import pytest
from mounts import cachefs, is_mounted, put_tree, wait_for

from benchmarks.handover_campaign import run as campaign
from cachefs.errors import ExitCode
from cachefs.launcher import process_alive
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse

FILES = {f"ds/f{i:03d}.bin": os.urandom(3000 + 97 * i) for i in range(40)}


@pytest.fixture
def dataset(s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "", FILES)
    return f"s3://{bucket}", ("--endpoint-url", s3_server.endpoint_url)


def metrics_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def read_all(mnt) -> None:
    for name, data in FILES.items():
        assert (mnt / name).read_bytes() == data


@pytest.mark.allow_warnings        # the keeper logs each death it rides out
def test_sigkilled_daemons_cost_readers_and_writers_nothing(s3_server, bucket, tmp_path):
    figures, problems = campaign(s3_server.endpoint_url, bucket, tmp_path, kills=4, files=60, readers=4, seed=5)
    assert problems == [], "\n".join(problems[:20])
    assert figures["kills"] == 4 and figures["keeper"]["generation"] == 4
    assert figures["read_errors"] == 0 and figures["wrong_reads"] == 0 and figures["reads"] > 1000
    assert figures["ops_acked"] > 20 and figures["bytes_acked"] > 0
    assert figures["pause_ms"]["max"] < 5000


@pytest.mark.allow_warnings
def test_restart_hands_the_mount_to_a_new_daemon(s3_server, bucket, tmp_path):
    figures, problems = campaign(s3_server.endpoint_url, bucket, tmp_path, kills=2, mode="restart", files=60,
                                 readers=4, seed=6)
    assert problems == [], "\n".join(problems[:20])
    assert figures["read_errors"] == 0 and figures["wrong_reads"] == 0 and figures["keeper"]["restarts"] == 2


def test_mount_again_hands_over_and_keeps_what_it_must(dataset, mount_factory, tmp_path):
    url, args = dataset
    port = free_port()
    args = (*args, "--metrics-port", str(port))
    mnt = mount_factory(url, *args, "--immutable").start()
    assert "cachefs_takeovers 0.0" in metrics_text(port)
    read_all(mnt)
    before = mnt.status()
    again = cachefs("mount", url, str(mnt.path), "--cache-dir", str(mnt.cache_dir), *args, "--immutable",
                    "--log-level", "debug")
    assert again.returncode == 0 and "handed to a new daemon" in again.stderr, again.stderr
    after = mnt.status()
    assert after["pid"] != before["pid"] and after["keeper"]["pid"] == before["keeper"]["pid"]
    assert after["keeper"]["restarts"] == 1 and not process_alive(before["pid"])
    read_all(mnt)
    assert after["log_level"] == "debug" and before["log_level"] == "info"      # the new options took
    assert "cachefs_takeovers 1.0" in metrics_text(port)
    other = cachefs("mount", url, str(mnt.path), "--cache-dir", str(tmp_path / "other"), "--metrics-port", "0", *args)
    assert other.returncode == ExitCode.MOUNTPOINT and "busy" in other.stderr and "cache_dir" in other.stderr
    assert mnt.status()["pid"] == after["pid"]
    mnt.pid = after["pid"]
    mnt.umount()


def test_a_dead_keeper_leaves_the_daemon_serving(dataset, mount_factory):
    url, args = dataset
    mnt = mount_factory(url, *args).start()
    os.kill(mnt.keeper_pid, signal.SIGKILL)
    wait_for(lambda: not process_alive(mnt.keeper_pid), 10)
    mnt.keeper_pid = None
    read_all(mnt)                           # the daemon holds the connection itself
    assert mnt.status()["pid"] == mnt.pid
    mnt.umount()


@pytest.mark.allow_warnings
def test_a_daemon_that_dies_as_it_serves_makes_the_keeper_give_up_not_hang(dataset, mount_factory):
    """Five daemons in a row that die within 2 s of serving (a request that kills every daemon):
    the keeper aborts the connection; readers get ENOTCONN at once instead of waiting forever."""
    url, args = dataset
    mnt = mount_factory(url, *args).start()
    read_all(mnt)
    keeper = mnt.keeper_pid
    for _ in range(6):
        pid = mnt.status()["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process_alive(keeper):
            try:
                if mnt.status()["pid"] != pid:
                    break
            except Exception:  # noqa: BLE001  (no daemon yet, or the connection was aborted)
                pass
            time.sleep(0.02)
    wait_for(lambda: not process_alive(keeper), 20)
    mnt.keeper_pid = mnt.pid = None
    with pytest.raises(OSError) as info:
        (mnt / "ds/f000.bin").read_bytes()
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    assert "aborting the FUSE connection" in (mnt.cache_dir / "cachefs.log").read_text()


@pytest.mark.allow_warnings
def test_without_resend_the_inflight_log_answers_what_the_dead_daemon_read(s3_server, bucket, tmp_path):
    """A kernel that cannot resend (before 6.9, played with CACHEFS_TEST_NO_RESEND=1): each daemon
    keeps the requests it reads in the in-flight log, and the next one answers those a dead one
    left: readers and the writer see no error, no wrong byte and lose nothing acknowledged."""
    figures, problems = campaign(s3_server.endpoint_url, bucket, tmp_path, kills=4, files=60, readers=4, seed=7,
                                 resend=False)
    assert problems == [], "\n".join(problems[:20])
    assert figures["read_errors"] == 0 and figures["wrong_reads"] == 0 and figures["reads"] > 1000
    assert figures["keeper"]["generation"] == 4 and figures["ops_acked"] > 20
    assert figures["replayed_requests"] > 0            # some kills found requests read and not answered
    log_text = (tmp_path / "cachefs.log").read_text()
    assert "requests in flight sent again" not in log_text and "aborting" not in log_text


@pytest.mark.allow_warnings
def test_without_resend_or_inflight_log_a_dead_daemon_ends_the_mount_at_once(dataset, mount_factory, monkeypatch):
    """No resend and no in-flight log (it cannot be created: a directory holds its name): requests
    the dead daemon had read would hang forever, so the keeper aborts the connection instead:
    readers fail fast, as with no keeper."""
    monkeypatch.setenv("CACHEFS_TEST_NO_RESEND", "1")
    url, args = dataset
    mnt = mount_factory(url, *args)
    (mnt.cache_dir / "fuse-inflight").mkdir(parents=True)
    mnt.start()
    read_all(mnt)
    assert mnt.status()["fuse"]["inflight_log"] is None
    keeper = mnt.keeper_pid
    errors: list[int] = []

    def reader():
        for _ in range(2000):
            try:
                (mnt / "ds/f001.bin").read_bytes()
            except OSError as exc:
                errors.append(exc.errno)
                return
    thread = threading.Thread(target=reader)
    thread.start()
    os.kill(mnt.pid, signal.SIGKILL)
    thread.join(20)
    assert not thread.is_alive(), "a reader hangs on the dead daemon's connection"
    wait_for(lambda: not process_alive(keeper), 10)
    mnt.keeper_pid = mnt.pid = None
    with pytest.raises(OSError):
        (mnt / "ds/f000.bin").read_bytes()
    log_text = (mnt.cache_dir / "cachefs.log").read_text()
    assert "cannot keep the in-flight log" in log_text and "cannot send again" in log_text


def test_no_keeper_means_no_restart_and_a_crash_ends_the_mount(dataset, mount_factory):
    url, args = dataset
    mnt = mount_factory(url, *args, "--no-keeper").start()
    assert mnt.status()["keeper"] is None and mnt.keeper_pid is None
    result = cachefs("restart", str(mnt.path))
    assert result.returncode == ExitCode.UNSUPPORTED and "no keeper" in result.stderr
    mnt.kill()
    with pytest.raises(OSError) as info:
        (mnt / "ds/f000.bin").read_bytes()
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)


def test_umount_leaves_no_keeper_or_standby(dataset, mount_factory):
    url, args = dataset
    mnt = mount_factory(url, *args).start()
    time.sleep(1.5)                                   # the standby has started
    children = open(f"/proc/{mnt.keeper_pid}/task/{mnt.keeper_pid}/children").read().split()
    assert len(children) == 2                         # the daemon and its standby
    mnt.umount()                                      # waits for the keeper to exit
    assert not is_mounted(mnt.path)
    wait_for(lambda: not any(process_alive(int(pid)) for pid in children), 10)
