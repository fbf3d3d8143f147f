"""Crash campaign: SIGKILL the daemon under a mixed write-back load, restart, check.

One trial: mount ``s3://BUCKET/crash`` on a cache dir; a writer process (``writer`` below, a
separate process) appends records to logs and fsyncs them, rewrites checkpoints in place, saves
checkpoints atomically (temp file + rename), deletes and truncates files. Before each operation it
appends an *intent* line to an ack log on local disk (outside the mount), and after the operation
is acknowledged (fsync or close or rename returned) an *ack* line with the content digest the path
now has. At a random moment the daemon and the writer are SIGKILLed (in random order). The mount is
then restarted on the same cache dir, ``cachefs sync --wait`` runs, and the bucket is checked:

- **no acknowledged byte lost**: each path holds its last acknowledged content, or the content of
  an operation started after it (in flight at the kill; a checkpoint rewrite in flight may be torn);
- **no partial object ever visible**: a watcher thread reads every object of the bucket in a loop
  for the whole campaign; every body must parse as complete, self-checking records (a log is a
  sequence of ``len | crc32 | payload`` records, a checkpoint a sequence of 4 KiB blocks that each
  carry their own crc and the block count of the file), so a truncated or spliced upload shows;
- **journal and bucket agree**: after the sync nothing is pending, and after the final unmount
  the journal holds no record.

Variants: ``normal``; ``staging-full`` (a tiny ``--staging-size``: ENOSPC may refuse writes, and
refused writes are not acknowledged); ``readonly`` (the cache dir lives on a small tmpfs made
read-only mid-trial by an ext4 error (``errors=remount-ro`` on a loop device: the kernel's
emergency read-only, as a failing disk does): reads of a seeded dataset must go on; then the
daemon is killed, the fs mounted again and the trial checked as usual).

    python -m benchmarks.crash_campaign --trials 100 [--variant normal|staging-full|readonly|mixed]

prints one JSON line of figures (trials, kills, ops acknowledged, bytes acknowledged, bytes lost,
partial objects seen, ENOSPC refusals). Needs root and /dev/fuse; starts its own moto server
unless ``--endpoint-url`` and ``--bucket`` are given.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 4096
_BLOCK_HEAD = struct.Struct("<4sIIII")        # magic, version, index, count, crc32 of the rest
_REC_HEAD = struct.Struct("<II")              # payload length, crc32 of the payload
PREFIX = "crash"
SEED_FILES = {f"data/seed{i}.bin": random.Random(i).randbytes(200_000 + i) for i in range(4)}


# ---- self-checking content ---------------------------------------------------------------------
def checkpoint_bytes(version: int, count: int) -> bytes:
    """``count`` 4 KiB blocks, each saying its version, index and the file's block count."""
    rng = random.Random(version)
    out = bytearray()
    for index in range(count):
        body = rng.randbytes(BLOCK - _BLOCK_HEAD.size)
        crc = zlib.crc32(struct.pack("<III", version, index, count) + body)
        out += _BLOCK_HEAD.pack(b"CKPT", version, index, count, crc) + body
    return bytes(out)


def log_record(payload: bytes) -> bytes:
    return _REC_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def record_ends(data: bytes) -> list[int]:
    """Offsets where the complete records of a log end; raises ValueError on a torn record."""
    ends, pos = [], 0
    while pos < len(data):
        if pos + _REC_HEAD.size > len(data):
            raise ValueError(f"torn record header at {pos}")
        length, crc = _REC_HEAD.unpack_from(data, pos)
        payload = data[pos + _REC_HEAD.size: pos + _REC_HEAD.size + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise ValueError(f"torn or corrupt record at {pos}")
        pos += _REC_HEAD.size + length
        ends.append(pos)
    return ends


def check_checkpoint(data: bytes, prefix_ok: bool = False) -> None:
    """Whole blocks, each block ``index`` of the same count; all of them unless ``prefix_ok``
    (a temp file being written at a crash is a prefix of one)."""
    if len(data) % BLOCK:
        raise ValueError(f"{len(data)} bytes is not whole blocks")
    count = len(data) // BLOCK
    if prefix_ok and count:
        count = _BLOCK_HEAD.unpack_from(data)[3]
    for index in range(len(data) // BLOCK):
        block = data[index * BLOCK:(index + 1) * BLOCK]
        magic, version, idx, n, crc = _BLOCK_HEAD.unpack_from(block)
        rest = struct.pack("<III", version, idx, n) + block[_BLOCK_HEAD.size:]
        if magic != b"CKPT" or idx != index or n != count or zlib.crc32(rest) != crc:
            raise ValueError(f"block {index} is not block {index} of {count}")


def content_problem(path: str, data: bytes) -> str | None:
    """None if ``data`` is complete content for ``path`` (a log or a checkpoint), else why not."""
    try:
        if path.endswith(".log"):
            record_ends(data)
        elif path.startswith("data/"):
            if SEED_FILES.get(path) != data:
                return "seed file changed"
        else:
            check_checkpoint(data, prefix_ok=path.startswith("tmp/"))
    except ValueError as exc:
        return str(exc)
    return None


def digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.md5(data).hexdigest()


# ---- the writer process --------------------------------------------------------------------------
class Writer:
    """The load. Every operation: intent line, operation, ack line (the ack log is fsynced)."""

    def __init__(self, root: Path, ack_path: Path, seed: int, max_blocks: int):
        self.root, self.rng, self.max_blocks = root, random.Random(seed), max_blocks
        self.ack = open(ack_path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
        self.version = seed * 100_000
        self.model: dict[str, bytes] = {}
        for sub in ("logs", "ckpt", "tmp"):
            (root / sub).mkdir(exist_ok=True)
        for sub in ("logs", "ckpt"):
            for name in os.listdir(root / sub):
                self.model[f"{sub}/{name}"] = (root / sub / name).read_bytes()

    def note(self, kind: str, path: str, data: bytes | None, **extra) -> None:
        line = {"t": kind, "path": path, "digest": digest(data),
                "size": 0 if data is None else len(data), **extra}
        self.ack.write(json.dumps(line) + "\n")
        os.fsync(self.ack.fileno())

    def run(self, ops: int) -> None:
        actions = [self.append] * 8 + [self.rewrite] * 4 + [self.save] * 3 + [self.delete, self.truncate] * 2
        for _ in range(ops):
            action = self.rng.choice(actions)
            try:
                action()
            except OSError as exc:
                if exc.errno not in (28, 122):      # ENOSPC, EDQUOT: refused, not acknowledged
                    raise
                self.note("refused", "", None, errno=exc.errno)
                self.reload()

    def reload(self) -> None:
        self.model = {p: (self.root / p).read_bytes() for p in self.model if (self.root / p).exists()}

    def append(self) -> None:
        path = f"logs/L{self.rng.randrange(4)}.log"
        new = self.model.get(path, b"") + log_record(self.rng.randbytes(self.rng.randrange(10, 3000)))
        added = new[len(self.model.get(path, b"")):]
        # open(O_CREAT) may have made an empty file when the crash came before the write
        self.note("intent", path, new, also=None if path in self.model else digest(b""))
        with open(self.root / path, "ab") as fh:
            fh.write(added)
            fh.flush()                          # one write request: never torn
            os.fsync(fh.fileno())
        self.model[path] = new
        self.note("ack", path, new, written=len(added))

    def _blocks(self) -> int:
        return self.rng.randrange(1, self.max_blocks + 1)

    def rewrite(self) -> None:
        """A checkpoint rewritten in place (same size, no O_TRUNC: may be torn at 4 KiB pages by a
        crash, each block stays whole); a new one is created by an atomic save."""
        path = f"ckpt/c{self.rng.randrange(3)}.pt"
        old = self.model.get(path)
        if not old:
            return self.save(path)
        self.version += 1
        new = checkpoint_bytes(self.version, len(old) // BLOCK)
        self.note("intent", path, new, torn=True)
        with open(self.root / path, "r+b") as fh:
            fh.write(new)
            fh.flush()
            os.fsync(fh.fileno())
        self.model[path] = new
        self.note("ack", path, new, written=len(new))

    def save(self, path: str | None = None) -> None:
        """torch.save-style atomic save: temp file, fsync, rename over the final name."""
        path = path or f"ckpt/s{self.rng.randrange(3)}.pt"
        tmp = "tmp/" + path.split("/")[1] + ".tmp"
        self.version += 1
        new = checkpoint_bytes(self.version, self._blocks())
        self.note("intent", tmp, new, torn=True)
        with open(self.root / tmp, "wb") as fh:
            fh.write(new)
            fh.flush()
            os.fsync(fh.fileno())
        self.note("intent", path, new)
        self.note("intent", tmp, None)
        os.rename(self.root / tmp, self.root / path)
        self.model[path] = new
        self.note("ack", path, new, written=len(new))
        self.note("ack", tmp, None)

    def delete(self) -> None:
        if not self.model:
            return
        path = self.rng.choice(sorted(self.model))
        self.note("intent", path, None)
        os.unlink(self.root / path)
        del self.model[path]
        self.note("ack", path, None)

    def truncate(self) -> None:
        logs = [p for p in sorted(self.model) if p.endswith(".log") and self.model[p]]
        if not logs:
            return
        path = self.rng.choice(logs)
        ends = [0, *record_ends(self.model[path])]
        new = self.model[path][:self.rng.choice(ends[:-1])]
        self.note("intent", path, new)
        with open(self.root / path, "r+b") as fh:
            fh.truncate(len(new))
            os.fsync(fh.fileno())
        self.model[path] = new
        self.note("ack", path, new)


def writer_main(argv: list[str]) -> int:
    root, ack, seed, blocks = Path(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    writer = Writer(root, ack, seed, blocks)
    writer.note("start", "", None)
    writer.run(10**9)
    return 0


# ---- the checker ---------------------------------------------------------------------------------
@dataclass
class PathState:
    acked: str | None = None          # digest of the last acknowledged content (None: absent)
    ever_acked: bool = False
    since: set = field(default_factory=set)    # digests of intents after the last ack
    torn: bool = False                # an in-place rewrite after the last ack may be torn


def read_acks(ack_path: Path) -> tuple[dict[str, PathState], dict]:
    states: dict[str, PathState] = {}
    tally = {"ops_acked": 0, "bytes_acked": 0, "refused": 0}
    for line in ack_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue             # the writer died mid-line
        if event["t"] in ("trial", "start"):
            continue
        if event["t"] == "refused":
            tally["refused"] += 1
            continue
        state = states.setdefault(event["path"], PathState())
        if event["t"] == "ack":
            state.acked, state.ever_acked, state.since, state.torn = event["digest"], True, set(), False
            tally["ops_acked"] += 1
            tally["bytes_acked"] += event.get("written", 0)
        else:
            state.since.add(event["digest"])
            if event.get("also"):
                state.since.add(event["also"])
            state.torn |= bool(event.get("torn"))
    return states, tally


def evidence(path: str, ack_path: Path, daemon_log: Path, data: bytes | None, lines: int = 12) -> str:
    """For a failed check of ``path``: the object's size and complete records, the writer's last
    events for it and the daemon's last log lines naming it (the test's tmp dir is gone later)."""
    if data is None:
        held = "no object"
    else:
        ends, pos = [], 0
        while pos + _REC_HEAD.size <= len(data):
            length, crc = _REC_HEAD.unpack_from(data, pos)
            payload = data[pos + _REC_HEAD.size: pos + _REC_HEAD.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                break
            pos += _REC_HEAD.size + length
            ends.append(pos)
        held = f"object {len(data)} bytes, complete records up to {pos} (ends {ends[-4:]})"
    needle = json.dumps(path)
    events = [line for line in _lines(ack_path) if needle in line][-lines:]
    logged = [line for line in _lines(daemon_log) if path in line][-lines:]
    return "\n".join([f"evidence for {path}: {held}", "writer's last events:", *events,
                      "daemon's last lines naming it:", *logged])


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def check_bucket(objects: dict[str, bytes], states: dict[str, PathState], sizes: dict[str, int]) -> list[str]:
    """Problems: acknowledged content missing, unknown objects, incomplete content."""
    problems = []
    for path in sorted(set(states) | set(objects)):
        data = objects.get(path)
        if path.startswith("data/"):
            continue
        if data is not None and (why := content_problem(path, data)):
            problems.append(f"{path}: incomplete content ({why})")
            continue
        state = states.get(path)
        if state is None:
            problems.append(f"{path}: in the bucket, never written")
            continue
        allowed = state.since | ({state.acked} if state.ever_acked else {None})
        if digest(data) in allowed or (state.torn and data is not None):
            continue
        problems.append(f"{path}: holds {digest(data)}, acknowledged {state.acked} "
                        f"({sizes.get(path, 0)} bytes lost)")
    return problems


def compare_view(root: Path, objects: dict[str, bytes]) -> list[str]:
    """What the mount shows against what the bucket holds (after a sync they must agree)."""
    seen = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            if name != ".cachefs-control":
                try:
                    seen[str(full.relative_to(root))] = digest(full.read_bytes())
                except OSError as exc:
                    seen[str(full.relative_to(root))] = f"error {exc.errno}"
    want = {path: digest(data) for path, data in objects.items()}
    return [f"{path}: mount {seen.get(path)}, bucket {want.get(path)}"
            for path in sorted(set(seen) | set(want)) if seen.get(path) != want.get(path)]


class Watcher(threading.Thread):
    """Reads every object of the bucket in a loop: each body must be complete content."""

    def __init__(self, client, bucket: str):
        super().__init__(daemon=True)
        self.client, self.bucket = client, bucket
        self.stop_event = threading.Event()
        self.reads = 0
        self.partial: list[str] = []
        self.seen: set[tuple[str, str]] = set()

    def run(self) -> None:
        while not self.stop_event.wait(0.1):
            with contextlib.suppress(Exception):
                self.scan()

    def scan(self) -> None:
        """Read each new version (key, ETag) once: its body must be complete content."""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=PREFIX + "/"):
            for obj in page.get("Contents", []):
                key = obj["Key"][len(PREFIX) + 1:]
                if key.endswith("/") or key.startswith("data/") or (key, obj["ETag"]) in self.seen:
                    continue
                with contextlib.suppress(self.client.exceptions.NoSuchKey):
                    data = self.client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read()
                    self.seen.add((key, obj["ETag"]))
                    self.reads += 1
                    if why := content_problem(key, data):
                        self.partial.append(f"{key}: {why}")

    def stop(self) -> None:
        self.stop_event.set()
        self.join()


def bucket_objects(client, bucket: str, prefix: str = PREFIX) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            key = obj["Key"][len(prefix) + 1:]
            if key.endswith("/"):
                continue
            with contextlib.suppress(client.exceptions.NoSuchKey):
                out[key] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


# ---- mounts and trials ---------------------------------------------------------------------------
def cachefs(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == str(path) for line in fh)


@dataclass
class Campaign:
    endpoint_url: str
    bucket: str
    workdir: Path
    seed: int = 0
    max_blocks: int = 256
    kinds: tuple[str, ...] = ("normal",)     # trial i is of kind kinds[i % len(kinds)]
    # 0: a restarted daemon relists. With the default TTL it trusts the listing snapshot of the
    # killed daemon, which misses what that daemon changed in the bucket (docs/reliability.md, bug 1)
    metadata_ttl: float = 0.0
    stats: dict = field(default_factory=lambda: {"trials": 0, "kills": 0,
                                                 "reads_while_readonly": 0, "read_errors": 0})
    problems: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.mnt = self.workdir / "mnt"
        self.cache = self.workdir / "cache"
        self.ack_path = self.workdir / "acks.jsonl"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None
        self.evidence_given = False      # the first failed check also reports what led to it

    def kind(self) -> str:
        """The kind of the next trial (a mount is made for the trial that follows it)."""
        return self.kinds[self.stats["trials"] % len(self.kinds)]

    def extra(self) -> tuple[str, ...]:
        return ("--staging-size", "1M", "--staging-wait", "0.2") if self.kind() == "staging-full" else ()

    def mount(self, *more: str) -> None:
        args = ["mount", f"s3://{self.bucket}/{PREFIX}", str(self.mnt), "--endpoint-url", self.endpoint_url,
                "--cache-dir", str(self.cache), "--log-file", str(self.workdir / "cachefs.log"),
                "--metrics-port", "0", "--block-size", "256K", "--upload-part-size", "5M",
                "--log-sync-period", "0.3", "--checkpoint-quiet-period", "0.5",
                "--metadata-ttl", str(self.metadata_ttl), "--no-keeper", *self.extra(), *more]
        from cachefs import launcher
        from cachefs.cli import build_parser, config_from_args
        cfg = config_from_args(build_parser().parse_args(args))   # what `cachefs mount` does, in-process
        self.pid = launcher.start(cfg).pid

    def kill_all(self, writer: subprocess.Popen) -> None:
        victims = [writer.pid, self.pid]
        self.rng.shuffle(victims)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        writer.wait()
        wait_gone(self.pid)
        self.stats["kills"] += 1
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, check=False)

    def start_writer(self) -> subprocess.Popen:
        seed = self.rng.randrange(1, 40_000)       # versions seed * 100_000 + n fit in 32 bits
        with open(self.ack_path, "a") as fh:
            fh.write(json.dumps({"t": "trial", "n": self.stats["trials"] + 1, "kind": self.kind()}) + "\n")
        return subprocess.Popen([sys.executable, "-m", "benchmarks.crash_campaign", "_writer", str(self.mnt),
                                 str(self.ack_path), str(seed), str(self.max_blocks)],
                                stderr=open(self.workdir / "writer.err", "ab"), cwd=Path(__file__).resolve().parent.parent)

    def trial(self, run_for: float, during=None, after_kill=None) -> None:
        """On the live mount: write for ``run_for`` s (calling ``during()`` half-way), kill,
        remount, sync, check. The mount stays up for the next trial."""
        writer = self.start_writer()
        self.wait_started(writer)
        time.sleep(run_for / 2)
        if during is not None:
            during()
        time.sleep(run_for / 2)
        self.kill_all(writer)
        if after_kill is not None:
            after_kill()
        self.stats["trials"] += 1
        self.mount()
        self.sync_and_check()

    def wait_started(self, writer: subprocess.Popen, timeout: float = 60.0) -> None:
        """Python takes seconds to start on a busy machine: the kill clock starts with the load."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and writer.poll() is None:
            if self.ack_path.read_text().rsplit('"t": "trial"', 1)[1].count('"t": "start"'):
                return
            time.sleep(0.05)

    def sync(self) -> dict:
        """``cachefs sync --wait`` in-process (the CLI's own control request): the final reply."""
        from cachefs.control.client import request
        final: dict = {}
        for reply in request(str(self.mnt), "sync", wait=True, timeout=120):
            final = reply
        return final

    def sync_and_check(self) -> None:
        final = self.sync()
        if not final.get("done"):
            self.problems.append(f"trial {self.stats['trials']}: sync left {final.get('pending')}")
        states, tally = read_acks(self.ack_path)
        self.stats.update(tally)
        objects = bucket_objects(self.client, self.bucket)
        found = check_bucket(objects, states, self.sizes(states))
        for problem in found:
            self.problems.append(f"trial {self.stats['trials']}: {problem}")
        if found and not self.evidence_given:      # what the next reader needs, before the tmp dir goes
            self.evidence_given = True
            for path in sorted({problem.split(":", 1)[0] for problem in found})[:2]:
                self.problems.append(evidence(path, self.ack_path, self.workdir / "cachefs.log", objects.get(path)))
        for problem in compare_view(self.mnt, objects):
            self.problems.append(f"trial {self.stats['trials']}: mount and bucket differ after sync: {problem}")

    def sizes(self, states: dict[str, PathState]) -> dict[str, int]:
        sizes = {}
        for line in self.ack_path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                if event["t"] == "ack":
                    sizes[event["path"]] = event["size"]
        return sizes

    def unmount(self, drain: bool = True) -> None:
        if is_mounted(self.mnt):
            result = cachefs("umount", str(self.mnt), *([] if drain else ["--no-drain"]), "--timeout", "120")
            if result.returncode != 0:
                self.problems.append(f"umount failed: {result.stderr.strip()}")
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, check=False)
        if self.pid:
            wait_gone(self.pid)

    def finish(self) -> dict:
        """Final sync and drain-unmount: the journal must hold no record afterwards."""
        self.sync_and_check()
        self.unmount(drain=True)
        records = list((self.cache / "staging" / "records").glob("*.json"))
        if records:
            self.problems.append(f"journal still holds {len(records)} record(s) after the final sync")
        return self.stats


def wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)


class LoopFs:
    """A small ext4 filesystem on a loop device (``errors=remount-ro``), for a cache dir that turns
    read-only: ``make_readonly`` triggers an ext4 error (the kernel's emergency read-only, which
    works with files open for writing, unlike ``mount -o remount,ro``), ``remount`` brings it back."""

    def __init__(self, image: Path, path: Path, size: str = "96M"):
        self.image, self.path = image, path
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        path.mkdir(parents=True, exist_ok=True)
        self.mount()

    def mount(self) -> None:
        subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.path)], check=True)

    def make_readonly(self) -> None:
        device = subprocess.run(["findmnt", "-no", "SOURCE", str(self.path)], capture_output=True, text=True,
                                check=True).stdout.strip()
        Path(f"/sys/fs/ext4/{Path(device).name}/trigger_fs_error").write_text("1\n")

    def remount(self) -> None:
        """Unmount, repair (the triggered error is recorded in the superblock, and a mount of a
        filesystem marked with errors can come back read-only), mount again and prove it is
        writable; a few tries, then a clear failure of the harness (not of cachefs)."""
        for attempt in range(3):
            subprocess.run(["umount", str(self.path)], check=True)
            subprocess.run(["e2fsck", "-fy", str(self.image)], capture_output=True, check=False)
            self.mount()
            probe = self.path / ".harness-writable"
            try:
                probe.write_bytes(b"x")
                probe.unlink()
                return
            except OSError as exc:
                last = exc
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"harness: the loop filesystem at {self.path} stays read-only after "
                           f"remount and e2fsck: {last}")

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        self.image.unlink(missing_ok=True)


def read_seed_files(campaign: Campaign) -> None:
    """Reads of the (read-only) dataset through the mount: they must go on, byte for byte."""
    for path, data in SEED_FILES.items():
        try:
            got = (campaign.mnt / path).read_bytes()
        except OSError as exc:
            campaign.stats["read_errors"] += 1
            campaign.problems.append(f"read of {path} with the cache dir read-only failed: {exc}")
            continue
        campaign.stats["reads_while_readonly"] += 1
        if got != data:
            campaign.problems.append(f"read of {path} with the cache dir read-only: wrong bytes")


def readonly_trial(campaign: Campaign, fs: LoopFs, run_for: float) -> None:
    """The cache dir's filesystem turns read-only half-way: reads must go on; it is mounted
    again (writable) after the kill, before the restart."""
    def go_readonly():
        fs.make_readonly()
        read_seed_files(campaign)

    campaign.trial(run_for, during=go_readonly, after_kill=fs.remount)


VARIANTS = {"normal": ("normal",), "staging-full": ("staging-full",), "readonly": ("readonly",),
            "mixed": ("normal", "staging-full", "readonly")}


def run(endpoint_url: str, bucket: str, workdir: Path, *, trials: int, variant: str, seed: int = 0,
        max_blocks: int = 256, run_for: tuple[float, float] = (0.5, 2.5),
        metadata_ttl: float = 0.0) -> tuple[dict, list[str]]:
    """Run ``trials`` kill trials of ``variant``; return (figures, problems)."""
    from testing.s3 import s3_client
    client = s3_client(endpoint_url)
    for path, data in SEED_FILES.items():
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{path}", Body=data)
    kinds = VARIANTS[variant]
    with contextlib.ExitStack() as stack:
        campaign = Campaign(endpoint_url, bucket, workdir, seed=seed, max_blocks=max_blocks, kinds=kinds,
                            metadata_ttl=metadata_ttl)
        fs = None
        if "readonly" in kinds:
            fs = LoopFs(workdir / "cache.img", workdir / "fs")
            stack.callback(fs.close)
            campaign.cache = fs.path / "cache"
        campaign.client = client
        watcher = Watcher(client, bucket)
        watcher.start()
        started = time.monotonic()
        try:
            campaign.mount()
            for _ in range(trials):
                duration = campaign.rng.uniform(*run_for)
                if campaign.kind() == "readonly":
                    readonly_trial(campaign, fs, duration)
                else:
                    campaign.trial(duration)
            stats = campaign.finish()
        finally:
            watcher.stop()
            campaign.unmount(drain=False)
        stats.update(variant=variant, partial_objects_seen=len(watcher.partial), watcher_reads=watcher.reads,
                     bytes_lost=sum(int(p.rsplit("(", 1)[1].split()[0]) for p in campaign.problems
                                    if "bytes lost)" in p), seconds=round(time.monotonic() - started, 1))
        return stats, campaign.problems + [f"partial object: {p}" for p in watcher.partial]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_writer":
        return writer_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--variant", choices=("normal", "staging-full", "readonly", "mixed"), default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-blocks", type=int, default=1800, help="largest checkpoint, in 4 KiB blocks")
    parser.add_argument("--metadata-ttl", type=float, default=0.0,
                        help="the mounts' --metadata-ttl (0: a restarted daemon relists)")
    parser.add_argument("--endpoint-url")
    parser.add_argument("--bucket")
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)
    from testing.s3 import LocalS3Server, local_credentials_env, make_bucket
    for name, value in local_credentials_env().items():
        os.environ.setdefault(name, value)
    with contextlib.ExitStack() as stack:
        endpoint, bucket = args.endpoint_url, args.bucket
        if not endpoint:
            endpoint = stack.enter_context(LocalS3Server()).endpoint_url
            bucket = f"crash-{os.getpid()}"
            make_bucket(endpoint, bucket)
        workdir = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="crash-")))
        stats, problems = run(endpoint, bucket, workdir, trials=args.trials, variant=args.variant,
                              seed=args.seed, max_blocks=args.max_blocks, metadata_ttl=args.metadata_ttl)
    print(json.dumps(stats))
    for problem in problems:
        print("PROBLEM", problem, file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
