"""Request loops as processes (``--fuse-loop-kind process``), on real mounts: the loops answer the
opens of handed-over files, their releases and CPython's isatty ioctl by themselves, with right
bytes and nothing left open; a loop SIGKILLed under readers, or the daemon SIGKILLed under its
keeper, costs the readers nothing; a backing a loop still has files open on is never closed
(the protocol checked step by step on the shared table, and under eviction churn on a mount);
the daemon's own count of a backing's opens, which decides when it may close; and, with no loop
process, the daemon's own answers from the table."""

import collections
import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest
import trio
import trio.testing
from mounts import cachefs, put_tree

from cachefs.fuse import abi
from cachefs.fuse.backing import Backings
from cachefs.fuse.loop_procs import LoopProcesses
from cachefs.fuse.looptable import LOOP_FH
from cachefs.fuse_ops import Operations
from cachefs.tiers.handover import ExactFile
from cachefs.tiers.key import BlockKey
from testing.s3 import free_port, s3_client

pytestmark = pytest.mark.fuse

FILES = {f"c{i % 4}/f{i:03d}.jpg": random.Random(i).randbytes(2000 + 1531 * i) for i in range(48)}
LOOPS = ("--immutable", "--fuse-loops", "2", "--fuse-loop-kind", "process")

# A reader: opens each file with CPython's buffered open (an isatty ioctl per open), checks its
# digest, for ROUNDS rounds or until STOP exists; writes its tally.
READER = r"""
import hashlib, json, os, random, sys, time
root, expected, rounds, out, stop = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
ok = wrong = 0; errors = []; names = sorted(expected); rng = random.Random(out); n = 0
while n < rounds and not os.path.exists(stop):
    rng.shuffle(names); n += 1
    for name in names:
        try:
            with open(os.path.join(root, name), "rb") as fh:
                data = fh.read()
        except OSError as exc:
            errors.append(f"{name}: {exc}"); continue
        if hashlib.sha256(data).hexdigest() == expected[name]:
            ok += 1
        else:
            wrong += 1
json.dump({"ok": ok, "wrong": wrong, "errors": errors[:5], "error_count": len(errors), "rounds": n}, open(out, "w"))
"""


@pytest.fixture
def dataset(s3_server, bucket):
    put_tree(s3_client(s3_server.endpoint_url), bucket, "ds", FILES)
    return f"s3://{bucket}/ds", ("--endpoint-url", s3_server.endpoint_url)


def start_readers(root: Path, tmp_path: Path, count: int, rounds: int) -> list[tuple[subprocess.Popen, Path]]:
    expected = json.dumps({name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()})
    readers = []
    for i in range(count):
        out = tmp_path / f"reader-{i}.json"
        proc = subprocess.Popen([sys.executable, "-c", READER, str(root), expected, str(rounds), str(out),
                                 str(tmp_path / "stop")])
        readers.append((proc, out))
    return readers


def finish(readers: list[tuple[subprocess.Popen, Path]], timeout: float = 120) -> list[dict]:
    tallies = []
    for proc, out in readers:
        assert proc.wait(timeout=timeout) == 0
        tallies.append(json.loads(out.read_text()))
    return tallies


def stop_clean(readers: list[tuple[subprocess.Popen, Path]], tmp_path: Path) -> None:
    """Stop readers that read in a loop: each read something, never an error or a wrong byte."""
    (tmp_path / "stop").touch()
    tallies = finish(readers)
    assert all(t["wrong"] == 0 and t["error_count"] == 0 and t["ok"] > 0 for t in tallies), tallies


def loop_status(mnt) -> dict:
    status = mnt.status()["fuse"]["loop_processes"]
    assert status is not None, mnt.status()["fuse"]
    return status


def reading(mnt, timeout: float = 20.0) -> dict:
    """Once every loop reads requests (each is a Python process that starts; the daemon reads
    them itself until then)."""
    deadline = time.monotonic() + timeout
    while True:
        status = loop_status(mnt)
        if all(loop["reading"] for loop in status["loops"]):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def warmed(mount_factory, dataset, *extra):
    """A mount with loop processes over a cache already holding every file (a second daemon: its
    first opens hand sealed files over), its loops reading."""
    url, args = dataset
    mnt = mount_factory(url, *args, *LOOPS, *extra).start()
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    mnt.umount()
    reading(mnt.start())
    return mnt


def test_the_daemon_reads_requests_until_a_loop_does(dataset, mount_factory, monkeypatch):
    """Loops that take 8 s to start cost readers nothing: the daemon answers meanwhile (it stops
    reading only once a loop reads), then the loops answer."""
    url, args = dataset
    mnt = mount_factory(url, *args, *LOOPS).start()
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES       # the cache filled
    mnt.umount()
    monkeypatch.setenv("CACHEFS_TEST_LOOP_START", "8")
    mnt.start()
    started = time.monotonic()
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    assert time.monotonic() - started < 5, "the readers waited for the loops"
    assert not any(loop["reading"] for loop in loop_status(mnt)["loops"])
    status = reading(mnt)
    before = sum(loop["opens"] for loop in status["loops"])
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    assert sum(loop["opens"] for loop in loop_status(mnt)["loops"]) >= before + len(FILES) - 2


def test_loop_processes_answer_opens_releases_and_isatty_of_handed_over_files(dataset, mount_factory, tmp_path):
    port = free_port()
    mnt = warmed(mount_factory, dataset, "--metrics-port", str(port))
    status = loop_status(mnt)
    assert [loop["running"] for loop in status["loops"]] == [True, True], status
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES        # the daemon hands each over
    tallies = finish(start_readers(mnt.path, tmp_path, 4, 5))
    assert all(t["wrong"] == 0 and t["error_count"] == 0 and t["ok"] == 5 * len(FILES) for t in tallies), tallies
    status = loop_status(mnt)
    answered = sum(loop["opens"] for loop in status["loops"])
    assert answered > len(FILES), status                    # the loops answered opens themselves
    assert sum(loop["ioctls"] for loop in status["loops"]) > 0, status     # CPython's isatty, on their handles
    assert status["open_files"] == 0, status                # every open they answered was released
    fuse = mnt.status()["fuse"]
    # every open reached the daemon or a loop; READ never did (the kernel reads the cache files)
    assert fuse["by_opcode"].get("read", 0) == 0, fuse
    assert fuse["by_opcode"]["open"] + answered >= 21 * len(FILES), fuse
    assert status["forwarded"] >= sum(loop["forwarded"] for loop in status["loops"]) - 2, status
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exported = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("cachefs_fuse_loop_requests_total{")}
    status = loop_status(mnt)
    assert exported["open"] == sum(loop["opens"] for loop in status["loops"]) == answered, (exported, status)
    assert exported["release"] == sum(loop["releases"] for loop in status["loops"])


@pytest.mark.parametrize("ahead", [True, False], ids=["open-ahead", "no-open-ahead"])
def test_a_looked_up_file_is_opened_by_a_loop_the_first_time_too(dataset, mount_factory, ahead):
    """After a remount each file's backing is registered when it is looked up (its sealed cache
    file at hand), so even its first open is answered by a loop: the daemon sees no OPEN
    (``--no-fuse-open-ahead``: each first open goes to the daemon). A backing registered for a
    lookup is closed when the kernel forgets the inode."""
    mnt = warmed(mount_factory, dataset, *(() if ahead else ("--no-fuse-open-ahead",)))
    opens = mnt.status()["fuse"]["by_opcode"].get("open", 0)      # the control file's (each status call)
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    by_daemon = 0 if ahead else len(FILES)
    assert mnt.status()["fuse"]["by_opcode"].get("open", 0) == opens + 1 + by_daemon, mnt.status()["fuse"]
    status = loop_status(mnt)
    assert sum(loop["opens"] for loop in status["loops"]) == len(FILES) - by_daemon, status
    assert status["open_files"] == 0 and status["published"] == len(FILES), status
    os.stat(mnt / "c0/f000.jpg")
    subprocess.run(["sh", "-c", "echo 2 > /proc/sys/vm/drop_caches"], check=True)     # FORGET every inode
    deadline = time.monotonic() + 20
    while loop_status(mnt)["published"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loop_status(mnt)["published"] == 0, loop_status(mnt)
    opens = mnt.status()["fuse"]["by_opcode"].get("open", 0)
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    assert mnt.status()["fuse"]["by_opcode"].get("open", 0) == opens + 1 + by_daemon


@pytest.mark.parametrize("extra,processes", [(("--immutable",), 1), (("--immutable", "--fuse-loop-kind", "thread"), None),
                                             ((), None), (("--immutable", "--fuse-loops", "0"), 0)])
def test_loops_are_processes_by_default_where_they_can_answer_alone(dataset, mount_factory, extra, processes):
    """auto: processes on an --immutable mount with passthrough; threads on a writable one; with
    no extra loop, the processes' table alone (the daemon answers opens from it)."""
    url, args = dataset
    mnt = mount_factory(url, *args, "--fuse-loops", "1", *extra).start()
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    status = mnt.status()["fuse"]["loop_processes"]
    if processes is None:
        assert status is None, status
    else:
        assert [loop["running"] for loop in status["loops"]] == [True] * processes, status


def test_with_no_loop_process_the_daemon_answers_opens_from_the_table(dataset, mount_factory, tmp_path):
    """The default on a small machine (no extra loop), --immutable: after a remount each looked-up
    file's backing is published and the daemon answers its opens from the table, as a loop would
    (no handle, no operation); counted as passthrough opens; nothing left open; a writable open
    never answered from it."""
    port = free_port()
    mnt = warmed(mount_factory, dataset, "--fuse-loops", "0", "--metrics-port", str(port))
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    status = loop_status(mnt)
    assert status["loops"] == [] and status["daemon"]["opens"] == len(FILES), status
    assert status["open_files"] == 0 and mnt.status()["open_files"] == 0, status
    tallies = finish(start_readers(mnt.path, tmp_path, 4, 5))
    assert all(t["wrong"] == 0 and t["error_count"] == 0 and t["ok"] == 5 * len(FILES) for t in tallies), tallies
    status = loop_status(mnt)
    assert status["daemon"]["opens"] == 21 * len(FILES) == status["daemon"]["releases"], status
    isatty = 21 * len(FILES) if sys.version_info < (3, 14) else 0      # CPython's buffered open asks it
    assert status["daemon"]["ioctls"] == isatty, status
    assert status["open_files"] == 0, status
    with open(mnt / "c0/f000.jpg", "rb") as held:             # an open file counts as open
        assert loop_status(mnt)["open_files"] == 1 == mnt.status()["open_files"]
        assert held.read() == FILES["c0/f000.jpg"]
        os.fsync(held.fileno())                               # nothing to sync: no error
    with pytest.raises(OSError):
        open(mnt / "c0/f000.jpg", "r+b")
    exported = metrics_of(port)
    status = loop_status(mnt)
    assert exported['cachefs_fuse_table_requests_total{answer="open"}'] == status["daemon"]["opens"], exported
    assert exported['cachefs_fuse_table_requests_total{answer="ioctl"}'] == status["daemon"]["ioctls"], exported
    assert exported["cachefs_passthrough_opens_total"] == status["daemon"]["opens"], exported
    assert exported['cachefs_fuse_loop_requests_total{answer="open"}'] == 0
    human = cachefs("status", str(mnt.path)).stdout          # as people read it
    assert "passthrough on" in human and f"{status['daemon']['opens']} opens answered from it by the daemon" in human


def test_loop_processes_killed_under_readers_cost_them_nothing(dataset, mount_factory, tmp_path):
    """One loop SIGKILLed: the other reads on; the second too: the daemon reads every request
    itself again. What each had read is sent again by the kernel: no reader sees an error."""
    mnt = warmed(mount_factory, dataset)
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    readers = start_readers(mnt.path, tmp_path, 4, 10_000)
    pids = [loop["pid"] for loop in loop_status(mnt)["loops"]]
    served = []
    for victim in pids:
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        time.sleep(1.0)
        served.append(mnt.status()["fuse"]["requests"])
    time.sleep(1.0)
    stop_clean(readers, tmp_path)
    status = loop_status(mnt)
    assert [loop["running"] for loop in status["loops"]] == [False, False], status
    assert mnt.status()["fuse"]["requests"] > served[-1] + len(FILES)      # the daemon's own loop reads again
    assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
    assert (mnt.cache_dir / "cachefs.log").read_text().count("FUSE request loop process") >= 2


def test_the_daemon_killed_under_its_keeper_takes_its_loops_with_it_and_readers_read_on(dataset, mount_factory,
                                                                                         tmp_path):
    mnt = warmed(mount_factory, dataset)
    old = [loop["pid"] for loop in loop_status(mnt)["loops"]]
    readers = start_readers(mnt.path, tmp_path, 3, 10_000)
    time.sleep(1.0)
    mnt.kill_daemon()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in old), "a loop process outlived its daemon"
    time.sleep(1.5)
    stop_clean(readers, tmp_path)
    status = loop_status(mnt)
    assert [loop["running"] for loop in status["loops"]] == [True, True], status
    assert not {loop["pid"] for loop in status["loops"]} & set(old)


def test_idle_backings_are_bounded_by_the_option(dataset, mount_factory):
    """--fuse-idle-backings: past that many backings with no open file, the oldest are closed
    (their slots in the table freed) and those files' next opens register them again."""
    mnt = warmed(mount_factory, dataset, "--fuse-loops", "0", "--fuse-idle-backings", "4")
    for _ in range(2):
        assert {name: (mnt / name).read_bytes() for name in FILES} == FILES
        deadline = time.monotonic() + 10
        while loop_status(mnt)["published"] > 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loop_status(mnt)["published"] == 4, loop_status(mnt)
    assert loop_status(mnt)["open_files"] == 0


def metrics_of(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("cachefs_")}


@pytest.mark.parametrize("bound,loops", [(None, "0"), (4, "0"), (None, "2")], ids=["all", "bounded", "processes"])
def test_a_listed_dataset_opens_from_the_table_with_no_lookup(dataset, mount_factory, bound, loops):
    """A loader that lists its dataset first (ImageFolder): the kernel gets every entry with its
    attributes (READDIRPLUS) and opens them later with no LOOKUP, so the daemon registers each
    listed file's backing once no request waits; every first open after a remount is then
    answered from the table. Bounded by --fuse-idle-backings: a listing fills what room there
    is and pushes no backing out (the files listed past it open the usual way). With loop
    processes (which send the READDIRPLUS to the daemon and answer the opens themselves) too."""
    port = free_port()
    extra = ("--fuse-idle-backings", str(bound)) if bound else ()
    mnt = warmed(mount_factory, dataset, "--fuse-loops", loops, "--metrics-port", str(port), *extra)
    listed = sorted(os.path.relpath(os.path.join(top, name), mnt.path)
                    for top, _dirs, names in os.walk(mnt.path) for name in names)
    assert listed == sorted(FILES)
    deadline = time.monotonic() + 10
    while loop_status(mnt)["published"] < (bound or len(FILES)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)                           # (none past the bound)
    assert loop_status(mnt)["published"] == (bound or len(FILES)), loop_status(mnt)
    before = metrics_of(port)
    assert {name: (mnt / name).read_bytes() for name in listed} == FILES
    after = metrics_of(port)
    status = loop_status(mnt)
    assert after['cachefs_fuse_operations_total{op="lookup"}'] == before['cachefs_fuse_operations_total{op="lookup"}']
    from_table = status["daemon"]["opens"] + sum(loop["opens"] for loop in status["loops"])
    assert from_table == (bound or len(FILES)), status          # the rest: the usual way
    handed = 'cachefs_passthrough_opens_total', 'cachefs_fuse_loop_requests_total{answer="open"}'
    assert sum(after.get(name, 0) - before.get(name, 0) for name in handed) == len(FILES)   # the daemon's, the loops'
    assert status["open_files"] == 0, status
    deadline = time.monotonic() + 10          # (the backings registered past the bound close as they go idle)
    while loop_status(mnt)["published"] > (bound or len(FILES)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loop_status(mnt)["published"] == (bound or len(FILES)), loop_status(mnt)


@pytest.mark.parametrize("how", ["listed", "manifest", "no-list"])
def test_a_warmed_dataset_opens_by_name_with_no_lookup(dataset, mount_factory, tmp_path, how):
    """`cachefs warmup` of an --immutable mount lists what it warmed through the mount (a
    manifest's paths: each looked up): a loader that then opens every file by name (no listing
    of its own) sends no LOOKUP, and each first open is answered from the table. With --no-list
    each first open is looked up."""
    port = free_port()
    url, args = dataset
    mnt = mount_factory(url, *args, *LOOPS, "--metrics-port", str(port)).start()
    reading(mnt)
    listing = how != "no-list"
    manifest = tmp_path / "files.txt"
    manifest.write_text("".join(f"{name}\n" for name in FILES))
    what = ("--manifest", str(manifest), str(mnt.path)) if how == "manifest" else (str(mnt.path),)
    result = cachefs("warmup", "--json", *(() if listing else ("--no-list",)), *what)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert events[-1]["event"] == "done" and events[-1]["fetched_files"] == len(FILES)   # the summary last
    listed = [e for e in events if e.get("event") == "listed"]
    if how == "manifest":
        assert [(e["entries"], e["directories"], e["errors"]) for e in listed] == [(len(FILES), 0, 0)]
    if how == "listed":
        assert len(listed) == 1 and listed[0]["errors"] == 0 and listed[0]["directories"] == 5, listed
        assert listed[0]["entries"] >= len(FILES) + 4, listed          # (+ the root's control file)
    if listing:
        deadline = time.monotonic() + 10
        while loop_status(mnt)["published"] < len(FILES) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        assert listed == []
    before = metrics_of(port)
    assert {name: (mnt / name).read_bytes() for name in sorted(FILES)} == FILES
    after = metrics_of(port)
    status = loop_status(mnt)
    lookups = after['cachefs_fuse_operations_total{op="lookup"}'] - before['cachefs_fuse_operations_total{op="lookup"}']
    from_table = status["daemon"]["opens"] + sum(loop["opens"] for loop in status["loops"])
    if listing:
        assert lookups == 0 and from_table == len(FILES), (lookups, status)
    else:
        assert lookups >= len(FILES) + 4, lookups                    # each file and its folder
    assert status["open_files"] == 0, status


@pytest.mark.parametrize("loops", ["2", "0"], ids=["processes", "table-only"])
def test_eviction_churn_under_loop_processes_never_fails_an_open(dataset, mount_factory, tmp_path, loops):
    """Idle backings bounded to a quarter of a 256 KiB tier: they are closed and registered
    again all the time while four readers open the files through the loops (or the daemon's
    own loop, from the table)."""
    mnt = warmed(mount_factory, dataset, "--cache-size", "2M", "--free-space-ratio", "0", "--fuse-loops", loops)
    tallies = finish(start_readers(mnt.path, tmp_path, 4, 6))
    assert all(t["wrong"] == 0 and t["error_count"] == 0 and t["ok"] == 6 * len(FILES) for t in tallies), tallies
    assert loop_status(mnt)["open_files"] == 0
    assert "ERROR" not in (mnt.cache_dir / "cachefs.log").read_text()


# ---- the protocol on the shared table, step by step (no kernel: a loop played here) --------------
class Played:
    """Loop 1 of ``loops``'s table, answering opens and releases as loop_worker.py does."""

    def __init__(self, loops: LoopProcesses) -> None:
        self.table, self.row = loops.table, 8

    def begin(self) -> None:
        self.table.seq[self.row] += 1

    def end(self) -> None:
        self.table.seq[self.row] += 1

    def open(self, inode: int) -> int | None:
        """The backing id a loop answers an open of ``inode`` with (None: sent to the daemon)."""
        entry = self.table.inode[inode]
        if not entry:
            return None
        slot = (entry >> 32) - 1
        self.table.opened[1][slot] += 1
        self.fh_slot = slot
        return entry & 0xFFFFFFFF

    def release(self, slot: int) -> None:
        self.table.released[1][slot] += 1


def idle(backings: Backings, inode: int, backing_id: int, fh: int) -> None:
    """The daemon's open of ``inode`` registers ``backing_id``; its file is closed: idle."""
    backings.add(inode, backing_id, ExactFile(fd=-1, key=None, size=1000))
    backings.bind(fh, inode)
    backings.unbind(fh)


def request(opcode: int, unique: int, nodeid: int, body: bytes) -> memoryview:
    return memoryview(abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body)


def answers(fd: int) -> list[tuple[int, int, bytes]]:
    """What was written to the pipe ``fd``: (error, unique, body) per answer."""
    got, data = [], b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    while data:
        length, error, unique = abi.OUT_HEADER.unpack_from(data)
        got.append((error, unique, data[abi.OUT_HEADER.size:length]))
        data = data[length:]
    return got


@pytest.mark.parametrize("row", [0, 1])
def test_the_table_answers_what_it_can_alone_and_counts_it_in_its_row(row, monkeypatch):
    """``LoopTable.answerer``, the code a loop process and the daemon's own loop (row 0) answer
    from the table with: the read-only open of a published inode (its handle names the nonce and
    the slot; counted open, the inode told), the release of such a handle (counted released; one
    of an earlier daemon, another nonce, answered uncounted), isatty on one (ENOTTY); anything
    else, or a request cut short, is left to the caller (0), with nothing written. An open whose answer the kernel no
    longer waits for is not counted open (no RELEASE will come); a write error is raised."""
    loops = LoopProcesses(lambda data, fd: None, lambda: None, count=1, nonce=7, slots=8)
    read_end, write_end = os.pipe()
    told = []
    try:
        table = loops.table
        table.publish(10, 3, 101)
        answer = table.answerer(row, told.append)
        flags = abi.OPEN_IN.pack(os.O_RDONLY, 0)
        assert answer(request(abi.OPEN, 1, 10, flags), write_end) == abi.OPEN
        (error, unique, body), = answers(read_end)
        fh, open_flags, backing_id = abi.OPEN_OUT.unpack(body)
        assert (error, unique, backing_id, open_flags) == (0, 1, 101, abi.FOPEN_PASSTHROUGH)
        assert fh == LOOP_FH | 7 << 32 | 3 and told == [10]
        assert table.opened[row][3] == 1 and table.open_files(3) == 1 and table.stats(row)["opens"] == 1

        for unanswered in (request(abi.OPEN, 2, 11, flags),                         # not published
                           request(abi.OPEN, 3, 10, abi.OPEN_IN.pack(os.O_RDWR, 0)),   # a writer
                           request(abi.OPEN, 4, 1 << 40, flags),                    # past the table
                           request(abi.RELEASE, 5, 10, abi.RELEASE_IN.pack(42, 0, 0, 0)),   # the daemon's handle
                           request(abi.IOCTL, 6, 10, abi.IOCTL_IN.pack(42, 0, 0x5401, 0, 0, 60)),
                           request(abi.GETATTR, 7, 10, bytes(16)),
                           request(abi.OPEN, 13, 10, b""),                           # cut short
                           request(abi.RELEASE, 14, 10, b"")[:30]):
            assert answer(unanswered, write_end) == 0
        assert answers(read_end) == [] and told == [10] and table.stats(row)["opens"] == 1

        isatty = abi.IOCTL_IN.pack(fh, 0, 0x5401, 0, 0, 60)
        assert answer(request(abi.IOCTL, 8, 10, isatty), write_end) == abi.IOCTL
        assert answer(request(abi.RELEASE, 9, 10, abi.RELEASE_IN.pack(fh, 0, 0, 0)), write_end) == abi.RELEASE
        earlier = LOOP_FH | 6 << 32 | 3                 # an earlier daemon's handle of that slot
        assert answer(request(abi.RELEASE, 10, 10, abi.RELEASE_IN.pack(earlier, 0, 0, 0)), write_end) == abi.RELEASE
        assert answers(read_end) == [(-errno.ENOTTY, 8, b""), (0, 9, b""), (0, 10, b"")]
        assert table.released[row][3] == 1 and table.open_files(3) == 0
        assert table.stats(row) == {"opens": 1, "releases": 2, "ioctls": 1, "forwarded": 0}

        def interrupted(fd, parts):
            raise OSError(errno.ENOENT, "no such request")
        monkeypatch.setattr(os, "writev", interrupted)
        gone = table.answerer(row, told.append)
        assert gone(request(abi.OPEN, 11, 10, flags), write_end) == abi.OPEN
        assert table.open_files(3) == 0 and told == [10] and table.stats(row)["opens"] == 1
        monkeypatch.undo()
        os.close(read_end)
        read_end = -1
        broken = table.answerer(row)
        with pytest.raises(BrokenPipeError):
            broken(request(abi.OPEN, 12, 10, flags), write_end)
        assert table.open_files(3) == 0
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        loops.close()


def test_a_backing_is_closed_only_after_every_loop_let_go_of_it():
    closed = []
    loops = LoopProcesses(lambda data, fd: None, lambda: None, count=1, nonce=7, slots=8)
    backings = Backings(closed.append, max_idle=1)
    try:
        backings.attach(loops)
        idle(backings, 10, 101, fh=1)
        loop = Played(loops)
        loop.begin()
        assert loop.open(10) == 101                  # a loop answers an open of 10 with its backing
        slot = loop.fh_slot
        loop.end()
        loop.release(slot)                           # (that file closed again: none open on it now)
        loop.begin()                                 # the loop reads another open of 10, slow to answer
        entry = loops.table.inode[10]
        idle(backings, 11, 111, fh=2)                # past max_idle: 10, the oldest idle, is to close
        assert loops.table.inode[10] == 0 and closed == [] and 10 in backings.by_inode
        backings.sweep()
        assert closed == []                          # that loop was answering when it was taken out
        assert entry >> 32 == slot + 1               # it read the entry before: it answers with it
        loops.table.opened[1][slot] += 1
        loop.end()
        backings.sweep()
        assert closed == []                          # its file is open on it
        loop.release(slot)
        backings.sweep()
        assert [b.id for b in closed] == [101] and 10 not in backings.by_inode
        assert loops.status()["published"] == 1      # 11's slot only: 10's is free again

        loop.begin()
        assert loop.open(11) == 111                  # a loop's file on 11...
        slot11 = loop.fh_slot
        loop.end()
        idle(backings, 12, 121, fh=3)                # ... 11 is to close...
        assert loops.table.inode[11] == 0
        assert backings.reuse(11) == 111             # ... the daemon opens 11 meanwhile: the same id,
        assert loops.table.inode[11] >> 32 == slot11 + 1     # published again on its slot
        loop.release(slot11)
        backings.sweep()
        assert [b.id for b in closed] == [101] and backings.by_inode[11].closing is None
    finally:
        loops.close()


def exact(name: str) -> ExactFile:
    return ExactFile(fd=-1, key=BlockKey("store", name, "etag", 1 << 20, 0), size=1000)


def test_a_backing_whose_cache_file_the_scrub_found_corrupt_answers_no_more_opens():
    """Idle: closed at once. Open in the daemon: no open reuses it, none may register another for
    its inode, and it closes at its last release. Published for loop processes: out of their table
    at once, closed once their files are released."""
    closed = []
    backings = Backings(closed.append)
    a, b = exact("a"), exact("b")
    backings.add(1, 11, a)
    backings.bind(100, 1)
    backings.unbind(100)                                # idle
    backings.add(2, 22, b)
    backings.bind(200, 2)                               # open
    assert backings.corrupt(a.key.digest()) == 1
    assert [x.id for x in closed] == [11] and backings.reuse(1) == 0 and not backings.blocked(1)
    assert backings.corrupt(b.key.digest()) == 1
    assert backings.reuse(2) == 0 and backings.blocked(2) and closed == [closed[0]]
    backings.unbind(200)
    assert [x.id for x in closed] == [11, 22] and not backings.blocked(2)

    closed.clear()
    loops = LoopProcesses(lambda data, fd: None, lambda: None, count=1, nonce=3, slots=4)
    try:
        backings = Backings(closed.append)
        backings.attach(loops)
        c = exact("c")
        backings.add(3, 33, c)
        backings.bind(300, 3)
        backings.unbind(300)
        loop = Played(loops)
        loop.begin()
        assert loop.open(3) == 33                       # a loop's file on it
        loop.end()
        backings.corrupt(c.key.digest())
        assert loops.table.inode[3] == 0 and loop.open(3) is None     # no loop answers with it again
        assert backings.reuse(3) == 0 and backings.blocked(3)
        backings.sweep()
        assert closed == []                             # the loop's file is still open
        loop.release(loop.fh_slot)
        backings.sweep()
        assert [x.id for x in closed] == [33] and not backings.blocked(3)
    finally:
        loops.close()


def test_an_open_that_waited_counts_once_on_the_backing_another_open_registered():
    """Two first opens of one file: the second waits (its cache file is being checked) while the
    first registers the backing; the second then holds it once, so both releases leave it idle."""
    closed = []
    node = types.SimpleNamespace(opens=0, restored=False)
    gate = trio.Event()
    ops = Operations.__new__(Operations)
    ops.backings = Backings(closed.append)
    ops.kernel = types.SimpleNamespace(passthrough=True)

    async def exact_file(version):
        await gate.wait()
        return None

    ops.vfs = types.SimpleNamespace(handover_version=lambda inode, flags: "v1", node=lambda inode: node,
                                    blocks=types.SimpleNamespace(exact_file=exact_file))

    async def main():
        async with trio.open_nursery() as nursery:
            got = []

            async def second():
                got.append(await ops._hand_over(7, os.O_RDONLY))
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            ops.backings.add(7, 70, exact("seven"))        # the first open registered it meanwhile
            gate.set()
        assert got == [70] and ops.backings.by_inode[7].opens == 2
        assert await ops._hand_over(7, os.O_RDONLY) == 70 and ops.backings.by_inode[7].opens == 3
        for fh in (1, 2, 3):
            ops.backings.bind(fh, 7)
            ops.backings.unbind(fh)
        assert ops.backings.by_inode[7].opens == 0 and 7 in ops.backings._idle
    trio.run(main)



def test_listed_files_are_registered_a_few_at_a_time_while_there_is_room():
    """``Operations.idle``: the files a READDIRPLUS listed get their backings a slice at a time,
    skipping the ones forgotten or opened since; once idle backings are full the rest of the
    queue is dropped, no backing pushed out."""
    from cachefs.fuse.types import DirReply
    nodes = {i: types.SimpleNamespace(inode=i, path=f"f{i}", is_dir=False, size=10, opens=0, restored=False,
                                      lookups=0) for i in range(10, 40)}

    def exact_file_now(version):
        return ExactFile(fd=os.open(os.devnull, os.O_RDONLY), key=BlockKey("store", version, "etag", 10, 0), size=10)

    ops = Operations.__new__(Operations)
    ops.open_ahead, ops._listed = True, collections.deque()
    ops.backings = Backings(lambda backing: None, max_idle=20)
    ops.backings.attach(types.SimpleNamespace(ticks=[], publish=lambda inode, backing_id, slot: slot))
    woken = []
    ops.kernel = types.SimpleNamespace(passthrough=True, backing_open=lambda fd: fd, idle_work=lambda: woken.append(1))
    ops.vfs = types.SimpleNamespace(
        blocks=types.SimpleNamespace(block_size=1 << 20, exact_file_now=exact_file_now),
        handover_version=lambda inode, flags: f"f{inode}", find_node=nodes.get,
        remember=lambda node: setattr(node, "lookups", node.lookups + 1),
        readdir_entries=lambda fh, start: ((n.path, n, i + 1) for i, n in enumerate(nodes.values()) if i >= start),
        dir_handle=lambda fh: trio.lowlevel.checkpoint(), ids_log_backing=lambda inode, backing_id: None)
    ops._attr = lambda node: types.SimpleNamespace(ino=node.inode, mode=0o100644)

    class Reply(DirReply):
        def add(self, name, attr, next_offset):
            return True

    trio.run(Operations.readdir.__wrapped__, ops, 1, 0, Reply())
    assert list(ops._listed) == list(range(10, 30)) and len(ops.backings) == 0   # queued, at most 20
    assert woken == [1]                            # the session's loop told once
    for inode in range(100, 104):                  # four idle backings already: room for 16
        ops.backings.add(inode, inode, ExactFile(fd=-1, key=BlockKey("store", f"g{inode}", "etag", 10, 0), size=10),
                         opens=0)
    nodes[10].lookups = 0                          # forgotten since
    nodes[11].opens = 1                            # opened the usual way since
    assert ops.idle() is True and len(ops.backings) == 4 + 6      # one slice: 8 looked at, 2 skipped
    while ops.idle():
        pass
    assert len(ops.backings) == 20 and not ops._listed      # full: the rest dropped, none pushed out
    assert sorted(ops.backings.by_inode) == [*range(12, 28), *range(100, 104)]
