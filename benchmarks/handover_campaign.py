"""Handover campaign: SIGKILL the daemon of a live mount again and again (or restart it on
purpose) under readers and a writer; the mount must never fail them.

Setup: ``s3://BUCKET/handover`` holds a seeded dataset (``data/``, self-describing bytes); it is
mounted with a keeper (the default). Eight reader threads read random dataset files through the
mount and compare every byte; a writer process (``crash_campaign``'s: log appends each fsynced,
checkpoints rewritten in place, atomic saves by rename, deletes, truncates; every operation noted
as intent and ack in a log outside the mount) writes under ``logs/``, ``ckpt/`` and ``tmp/``.
Then, ``--kills`` times, 2.3-3.3 s apart: SIGKILL of the serving daemon (``--mode kill``) or
``cachefs restart`` (``--mode restart``); the keeper starts (or has standing by) the next daemon.

Checked: **0 read errors and 0 wrong bytes** (readers), **the writer never saw an error** (it
stops at the first one), and after ``sync --wait``, the bucket holds every acknowledged content
(``crash_campaign.check_bucket``) and the mount shows what the bucket holds. Measured: the pause
each kill cost the readers (the longest read in flight across the kill: p50, p99, max), the
daemon's own takeover time (from its log), reads and bytes verified, writer operations acked.

    python -m benchmarks.handover_campaign --kills 100 [--mode kill|restart] [--immutable] [--no-standby] [--mount-opt=FLAG]

prints one JSON line. Needs root and /dev/fuse; starts its own moto server unless
``--endpoint-url`` and ``--bucket`` are given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.crash_campaign import bucket_objects, check_bucket, compare_view, read_acks

PREFIX = "handover"
QUIET = 2.3             # seconds between a takeover and the next kill (the keeper's QUICK is 2 s)


def seed_files(count: int, rng: random.Random) -> dict[str, bytes]:
    return {f"data/f{i:04d}.bin": rng.randbytes(rng.randrange(4_000, 64_000)) for i in range(count)}


class Readers:
    """Threads reading random files through the mount, comparing every byte."""

    def __init__(self, root: Path, files: dict[str, bytes], threads: int, seed: int) -> None:
        self.root, self.files = root, files
        self.stop = threading.Event()
        self.reads = self.bytes = 0
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.slow: list[tuple[float, float]] = []       # (start, seconds) of reads over 2 ms
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(seed + i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        names = sorted(self.files)
        while not self.stop.is_set():
            name = rng.choice(names)
            started = time.monotonic()
            try:
                with open(self.root / name, "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                with self.lock:
                    self.errors.append(f"{name}: {exc}")
                time.sleep(0.01)
                continue
            took = time.monotonic() - started
            with self.lock:
                self.reads += 1
                self.bytes += len(data)
                if data != self.files[name]:
                    self.wrong.append(name)
                if took > 0.002:
                    self.slow.append((started, took))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def pause(self, at: float, window: float = 1.5) -> float:
        """The longest read in flight across ``at`` or begun within ``window`` s after it."""
        return max((took for start, took in self.slow if start <= at + window and start + took >= at), default=0.0)


def status(mnt: Path) -> dict:
    from cachefs.control.client import request
    return next(request(str(mnt), "status"))


def wait_new_daemon(mnt: Path, old: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.02)
        with contextlib.suppress(Exception):
            pid = status(mnt)["pid"]
            if pid != old:
                return pid
    raise RuntimeError(f"no new daemon within {timeout} s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run(endpoint_url: str, bucket: str, workdir: Path, *, kills: int, mode: str = "kill", immutable: bool = False,
        standby: bool = True, files: int = 300, readers: int = 8, seed: int = 0,
        resend: bool = True, mount_opts: tuple[str, ...] = (), quiet: float = QUIET) -> tuple[dict, list[str]]:
    """One campaign; returns (figures, problems). ``resend=False`` plays a kernel before 6.9: the
    daemons never ask for resends, and what a dead one had read is answered from its in-flight log."""
    from cachefs import launcher
    from cachefs.cli import build_parser, config_from_args
    from testing.s3 import s3_client

    rng = random.Random(seed)
    client = s3_client(endpoint_url)
    dataset = seed_files(files, rng)
    for name, data in dataset.items():
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{name}", Body=data)
    mnt, cache, log_file = workdir / "mnt", workdir / "cache", workdir / "cachefs.log"
    ack_path = workdir / "acks.jsonl"
    mnt.mkdir(parents=True, exist_ok=True)
    args = ["mount", f"s3://{bucket}/{PREFIX}", str(mnt), "--endpoint-url", endpoint_url, "--cache-dir", str(cache),
            "--log-file", str(log_file), "--metrics-port", "0", "--log-sync-period", "0.3",
            "--checkpoint-quiet-period", "0.5", "--upload-part-size", "5M",
            *(["--immutable"] if immutable else []), *([] if standby else ["--no-keeper-standby"]), *mount_opts]
    if not resend:
        os.environ["CACHEFS_TEST_NO_RESEND"] = "1"          # inherited by the keeper and its daemons
    try:
        started = launcher.start(config_from_args(build_parser().parse_args(args)))
    finally:
        os.environ.pop("CACHEFS_TEST_NO_RESEND", None)
    keeper = started.keeper_pid
    problems: list[str] = []
    writer = None
    readers_ = Readers(mnt, {name: data for name, data in dataset.items()}, readers, seed)
    figures: dict = {"mode": mode, "kills": 0, "immutable": immutable, "standby": standby, "mount_opts": list(mount_opts),
                     "quiet_s": quiet}
    pauses, kill_times = [], []
    try:
        readers_.start()
        if not immutable:
            ack_path.write_text(json.dumps({"t": "trial", "n": 1, "kind": "handover"}) + "\n")
            writer = subprocess.Popen([sys.executable, "-m", "benchmarks.crash_campaign", "_writer", str(mnt),
                                       str(ack_path), str(rng.randrange(1, 40_000)), "200"],
                                      stderr=open(workdir / "writer.err", "ab"),  # noqa: SIM115
                                      cwd=Path(__file__).resolve().parent.parent)
        pid = started.pid
        time.sleep(quiet)
        for _ in range(kills):
            time.sleep(rng.uniform(0.0, 1.0))
            at = time.monotonic()
            if mode == "kill":
                os.kill(pid, signal.SIGKILL)
                pid = wait_new_daemon(mnt, pid)
            else:
                pid = launcher.restart(str(mnt)).new_pid
            kill_times.append(at)
            figures["kills"] += 1
            if writer is not None and writer.poll() is not None:
                problems.append(f"the writer stopped (status {writer.returncode}): "
                                f"{(workdir / 'writer.err').read_text()[-600:]}")
                writer = None
            time.sleep(quiet)
        readers_.finish()
        if writer is not None:
            if writer.poll() is not None:
                problems.append(f"the writer stopped: {(workdir / 'writer.err').read_text()[-600:]}")
            writer.kill()
            writer.wait()
        final = {}
        if not immutable:
            from cachefs.control.client import request
            for reply in request(str(mnt), "sync", wait=True, timeout=120):
                final = reply
            if not final.get("done"):
                problems.append(f"sync left {final.get('pending')}")
            states, tally = read_acks(ack_path)
            figures.update(tally)
            objects = bucket_objects(client, bucket, PREFIX)
            problems += check_bucket(objects, states, {})
            problems += [f"mount and bucket differ: {p}" for p in compare_view(mnt, objects)]
        final_status = status(mnt)
        figures["keeper"] = final_status.get("keeper")
        if (final_status.get("keeper") or {}).get("pid") != keeper:
            problems.append("the keeper changed")
    finally:
        readers_.finish()
        if writer is not None and writer.poll() is None:
            writer.kill()
        result = subprocess.run([sys.executable, "-m", "cachefs", "umount", str(mnt), "--timeout", "120"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            problems.append(f"umount: {result.stderr.strip()}")
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    pauses = [readers_.pause(at) for at in kill_times]
    log_text = log_file.read_text()
    builds = [float(ms) for ms in re.findall(r"took over .* in (\d+) ms", log_text)]
    figures["replayed_requests"] = sum(int(n) for n in re.findall(r"answering (\d+) request\(s\)", log_text))
    figures.update(reads=readers_.reads, bytes_verified=readers_.bytes, read_errors=len(readers_.errors),
                   wrong_reads=len(readers_.wrong),
                   pause_ms={"p50": round(percentile(pauses, 0.5) * 1000, 1),
                             "p99": round(percentile(pauses, 0.99) * 1000, 1),
                             "max": round(max(pauses, default=0) * 1000, 1),
                             "mean": round(statistics.fmean(pauses) * 1000, 1) if pauses else 0.0},
                   takeover_build_ms={"p50": percentile(builds, 0.5), "max": max(builds, default=0.0)})
    problems += [f"read error: {e}" for e in readers_.errors[:20]] + [f"wrong bytes: {w}" for w in readers_.wrong[:20]]
    return figures, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--mode", choices=("kill", "restart"), default="kill")
    parser.add_argument("--immutable", action="store_true", help="a read-only dataset mount (passthrough), no writer")
    parser.add_argument("--no-standby", dest="standby", action="store_false")
    parser.add_argument("--no-resend", dest="resend", action="store_false",
                        help="play a kernel before 6.9: the in-flight log answers what a dead daemon had read")
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mount-opt", action="append", default=[],
                        help="one more `cachefs mount` flag, e.g. --mount-opt=--fuse-loop-kind=process")
    parser.add_argument("--quiet", type=float, default=QUIET,
                        help="seconds from a takeover to the next kill (the standby starts 1 s after one)")
    parser.add_argument("--endpoint-url")
    parser.add_argument("--bucket")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cachefs-handover-") as tmp, contextlib.ExitStack() as stack:
        endpoint, bucket = args.endpoint_url, args.bucket
        if endpoint is None:
            from testing.s3 import LocalS3Server, local_credentials_env, make_bucket
            os.environ.update(local_credentials_env())
            server = LocalS3Server()
            server.start()
            stack.callback(server.stop)
            endpoint, bucket = server.endpoint_url, "handover"
            make_bucket(endpoint, bucket)
        figures, problems = run(endpoint, bucket, Path(tmp), kills=args.kills, mode=args.mode,
                                immutable=args.immutable, standby=args.standby, files=args.files, seed=args.seed,
                                resend=args.resend, mount_opts=tuple(args.mount_opt), quiet=args.quiet)
    print(json.dumps({**figures, "problems": problems[:50]}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
