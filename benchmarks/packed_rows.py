"""Rows of the packed benchmark (bench_packed.py): the packer vs a boto3 copy, DataLoader epochs,
the peers' virtualenvs and runs.

``pack_run``: ``cachefs pack`` as a subprocess, timed, its peak RSS sampled from
``/proc/PID/status`` (VmHWM) and as the packer read it at its end (its summary's ``peak_rss_bytes``).
``boto3_copy``: GET + PUT of every object with N threads. ``loader_epoch``: a
``torch.utils.data.DataLoader`` with N workers over a dataset yielding (path, bytes), every size
checked against the manifest and every path accounted for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.cachefs_mount import cachefs_command
from benchmarks.dataset import Entry, object_key
from benchmarks.readers import Result, Tally
from cachefs.host import vm_hwm

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
VENVS = REPO / ".bench-venvs"
TORCH_WHEELS = Path("/opt/wheels")
# peer -> pip requirements installed into VENVS/peer (torch from the same version as .venv)
PEER_REQUIREMENTS = {
    "streaming": ["mosaicml-streaming==0.13.0"],          # pins numpy<2.2: its own venv
    "litdata": ["litdata==0.2.76", "boto3"],
    "webdataset": ["webdataset==1.0.2", "boto3"],
    "s3torch": ["s3torchconnector==1.5.0"],
}
PEER_LABELS = {"streaming": "MosaicML Streaming (MDS)", "litdata": "LitData (optimize)",
               "webdataset": "WebDataset (tar shards)", "s3torch": "s3torchconnector (unpacked)"}


# ---- cachefs pack vs a boto3 copy ----------------------------------------------------------------
def pack_run(src: str, dst: str, endpoint_url: str, concurrency: int, shard_size: str,
             env: dict) -> dict:
    """Run ``cachefs pack SRC DST``; seconds, exit code, peak RSS (bytes), the JSON summary."""
    cmd = cachefs_command() + ["pack", src, dst, *(["--endpoint-url", endpoint_url] if endpoint_url else []), "--json",
                               "--concurrency", str(concurrency), "--shard-size", shard_size]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], vm_hwm(proc.pid) or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout_lines: list[str] = []
    reader = threading.Thread(target=lambda: stdout_lines.extend(proc.stdout), daemon=True)
    reader.start()
    stderr = proc.stderr.read()
    reader.join()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    summary = {}
    for line in stdout_lines:
        if '"summary"' in line:
            summary = json.loads(line)
    # The packer's own peak: VmHWM, sampled here and read by the packer as it ends (its summary's
    # peak_rss_bytes). Not wait4's ru_maxrss, kept only for the record: on Linux it also counts
    # what this process had resident when it spawned the packer (494-509 MiB in full runs, whose
    # DataLoader rows had grown this process, against the packer's own 280).
    own = int(summary.get("peak_rss_bytes") or 0)
    return {"seconds": seconds, "returncode": proc.returncode, "stderr": stderr.strip()[-2000:],
            "peak_rss": max(peak[0], own), "vm_hwm_sampled": peak[0], "vm_hwm_at_end": own,
            "ru_maxrss": usage.ru_maxrss * 1024, "summary": summary}


def boto3_copy(name: str, client, bucket: str, src_prefix: str, dst_prefix: str,
               entries: list[Entry], threads: int) -> Result:
    """Download and upload every object with ``threads`` threads (one client, pool >= threads)."""
    client.head_bucket(Bucket=bucket)
    tally_lock, tally = threading.Lock(), Tally()

    def copy(entry: Entry) -> None:
        try:
            data = client.get_object(Bucket=bucket, Key=object_key(src_prefix, entry.path))["Body"].read()
            client.put_object(Bucket=bucket, Key=object_key(dst_prefix, entry.path), Body=data)
        except Exception as exc:  # noqa: BLE001 - count every botocore error
            with tally_lock:
                tally.error(f"{entry.path}: {type(exc).__name__}: {exc}")
            return
        with tally_lock:
            tally.files += 1
            tally.bytes += len(data)
            if len(data) != entry.size:
                tally.bad_size += 1

    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, entries))
    return Result(name, time.monotonic() - start, tally)


# ---- DataLoader epochs ---------------------------------------------------------------------------
class FileDataset:
    """Map-style: sample i is (path, bytes) of the i-th file below ``root`` (plain open/read)."""

    def __init__(self, root: Path, paths: list[str]):
        self.root, self.paths = str(root), paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[str, bytes]:
        path = self.paths[i]
        with open(os.path.join(self.root, path), "rb") as fh:
            return path, fh.read()


def loader_epoch(name: str, dataset, entries: list[Entry], workers: int, seed: int = 0,
                 batch_size: int = 0) -> Result:
    """One epoch of a DataLoader (``workers`` workers) over ``dataset``; the clock covers creating
    the loader, forking its workers and reading every sample. ``batch_size`` > 0: batches of that
    many samples, each a list of (path, bytes) (the way training code takes them; the collate only
    lists them, raw bytes); 0: ``batch_size=None``, one sample per item."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    sizes = {e.path: e.size for e in entries}
    kwargs = {}
    if not isinstance(dataset, IterableDataset):
        kwargs = {"shuffle": True, "generator": torch.Generator().manual_seed(seed)}
    tally, seen = Tally(), set()
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            if batch_size > 0:
                kwargs.update(batch_size=batch_size, collate_fn=list)
            else:
                kwargs.update(batch_size=None)
            items = iter(DataLoader(dataset, num_workers=workers, **kwargs))
        for path, data in (one for batch in items for one in batch) if batch_size > 0 else items:
            tally.files += 1
            tally.bytes += len(data)
            seen.add(path)
            if sizes.get(path) != len(data):
                tally.bad_size += 1
                tally.first_error = tally.first_error or f"{path}: {len(data)} bytes"
    except Exception as exc:  # noqa: BLE001 - a failed epoch is a row with an error
        tally.error(f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    if missing := len(sizes.keys() - seen):
        tally.error(f"{missing} files never yielded")
    return Result(name, seconds, tally)


# ---- peers ---------------------------------------------------------------------------------------
def peer_python(peer: str) -> Path:
    return VENVS / peer / "bin" / "python"


def peer_ready(peer: str) -> bool:
    py = peer_python(peer)
    if not py.exists():
        return False
    module = {"streaming": "streaming", "litdata": "litdata", "webdataset": "webdataset",
              "s3torch": "s3torchconnector"}[peer]
    return subprocess.run([str(py), "-c", f"import importlib.util, torch; assert importlib.util.find_spec('{module}')"],
                          capture_output=True, check=False).returncode == 0


def setup_peer(peer: str) -> None:
    """Create VENVS/peer (Python of .venv's base) and install the peer and torch into it."""
    VENVS.mkdir(exist_ok=True)
    (VENVS / ".gitignore").write_text("*\n")
    base = Path(sys.base_prefix) / "bin" / "python3"
    target = VENVS / peer
    if not peer_python(peer).exists():
        subprocess.run([str(base), "-m", "venv", str(target)], check=True)
    import torch
    wheels = sorted(TORCH_WHEELS.glob(f"torch-{torch.__version__}-*.whl"))
    torch_req = [str(wheels[-1])] if wheels else [f"torch=={torch.__version__.split('+')[0]}"]
    subprocess.run([str(peer_python(peer)), "-m", "pip", "install", "-q", *torch_req,
                    *PEER_REQUIREMENTS[peer]], check=True)


def _last_error(stderr: str, limit: int = 300) -> str:
    """The last line of a peer's stderr (its exception), cut at ``limit`` from its start: the
    exception's type and message come first, a long path or hint after them."""
    line = (stderr.strip().splitlines() or ["failed"])[-1]
    return line if len(line) <= limit else line[:limit] + "..."


def run_peer(peer: str, job: dict, scratch: Path, timeout: float = 1800.0) -> dict:
    """One peer's converter and first epoch in its venv; the JSON it printed (or an error)."""
    scratch.mkdir(parents=True, exist_ok=True)
    job_file = scratch / f"{peer}-job.json"
    job_file.write_text(json.dumps({**job, "scratch": str(scratch)}))
    if not peer_ready(peer):
        return {"peer": peer, "error": "not installed: python -m benchmarks.bench_packed --setup"}
    out: dict = {}
    for step in ("convert", "epoch"):
        try:
            result = subprocess.run([str(peer_python(peer)), "-m", "benchmarks.packed_peers", peer, step,
                                     str(job_file)], cwd=REPO, capture_output=True, text=True,
                                    timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                                    check=False)
        except subprocess.TimeoutExpired:
            return {**out, "peer": peer, "error": f"{step} timed out after {timeout:.0f} s"}
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
        if result.returncode != 0 or not lines:
            return {**out, "peer": peer, "error": f"{step}: " + _last_error(result.stderr),
                    "stderr": result.stderr[-4000:]}
        out.update(json.loads(lines[-1]))
    return out
