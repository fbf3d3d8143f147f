"""`cachefs pack` / `unpack` end to end on local directories and a moto S3 server on loopback:
round trips, resume, partitioned packs, appends, verify, and every bad input's exit code with
nothing published."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cachefs.cli import main
from cachefs.errors import ExitCode, NoSuchKey
from cachefs.host import vm_hwm
from cachefs.metrics import Metrics
from cachefs.packfmt import MANIFEST, BadName, PackExit, SourceChanged, open_index
from cachefs.packfmt.errors import PackBusy
from cachefs.packfmt.tfrecord import example_fields, iter_records
from cachefs.store import open_store
from packer.engine import Worker, plan_pack
from packer.options import PackOptions
from packer.progress import Progress
from packer.sink import ShardSink
from packer.source import check_names
from packer.stores import local_root, to_url
from testing.s3 import s3_client
from tests.mounts import interruptible, put_tree


@pytest.fixture(autouse=True)
def pack_commands(pack_cli):
    """Every test here runs `cachefs pack` / `unpack` in-process (conftest's ``pack_cli``)."""


def test_the_commands_are_registered_through_the_entry_point():
    for command in ("pack", "unpack"):
        done = subprocess.run([sys.executable, "-c", "import sys; from cachefs.cli import main; "
                               f"sys.exit(main(['{command}', '--help']))"], capture_output=True, text=True,
                              cwd="/", timeout=60)
        assert done.returncode == 0 and "exit codes:" in done.stdout, done.stderr


def make_tree(root: Path, n: int = 60, seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 4}/sub{i % 3}/f{i:03d}.bin": rng.randbytes(rng.randrange(0, 3000)) for i in range(n)}
    files["top.txt"] = b"top level\n"
    write_tree(root, files)
    return files


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def pack(*args: str) -> int:
    return main(["pack", "--quiet", *map(str, args)])


def unpack(*args: str) -> int:
    return main(["unpack", "--quiet", *map(str, args)])


def shard_bytes(dst: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((dst / "shards").iterdir())}


def index_rows(dst: Path) -> list[dict]:
    manifest = json.loads((dst / MANIFEST).read_text())
    return pq.read_table(dst / manifest["index_files"]).to_pylist()


def test_local_pack_unpack_roundtrip_keeps_bytes_modes_and_mtimes(tmp_path):
    files = make_tree(tmp_path / "src")
    os.chmod(tmp_path / "src/top.txt", 0o750)
    os.utime(tmp_path / "src/top.txt", (1_600_000_000, 1_600_000_000))
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "20K") == 0
    dst = tmp_path / "dst"
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["files"] == len(files) and manifest["bytes"] == sum(map(len, files.values()))
    assert manifest["shards"] == len(list((dst / "shards").glob("*.tfrecord"))) > 3
    assert not (dst / "work").exists()
    records = {}
    for shard in sorted((dst / "shards").glob("*.tfrecord")):
        with open(shard, "rb") as f:
            records.update(example_fields(bytes(p)) for _, p in iter_records(f))
    assert {k.decode(): v for k, v in records.items()} == files
    assert unpack(dst, tmp_path / "out") == 0
    assert read_tree(tmp_path / "out") == files
    st = os.stat(tmp_path / "out/top.txt")
    assert (st.st_mode & 0o777, int(st.st_mtime)) == (0o750, 1_600_000_000)
    assert pack("--verify", dst) == 0


def test_s3_pack_with_multipart_shards_and_unpack(s3_server, bucket, tmp_path):
    client = s3_client(s3_server.endpoint_url)
    rng = random.Random(7)
    files = {f"img/{i:02d}.raw": rng.randbytes(3 << 20) for i in range(6)} | {"labels.csv": b"a,b\n1,2\n"}
    put_tree(client, bucket, "src", files)
    flags = ("--endpoint-url", s3_server.endpoint_url)
    assert pack(f"s3://{bucket}/src", f"s3://{bucket}/packed", "--shard-size", "10M", *flags) == 0
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="packed/")["Contents"]}
    assert {"packed/manifest.json", "packed/shards/00000.tfrecord", "packed/shards/00000.tfrecord.idx"} <= keys
    assert not any(k.startswith("packed/work/") for k in keys)
    # 8 MiB parts exactly, records cut across them (the first holds 2 2/3 files): a mount's 4 MiB
    # block never spans two parts
    first = client.head_object(Bucket=bucket, Key="packed/shards/00000.tfrecord", PartNumber=1)
    assert first["ContentLength"] == 8 << 20 and first["PartsCount"] >= 2
    assert pack("--verify", f"s3://{bucket}/packed", *flags) == 0
    assert unpack(f"s3://{bucket}/packed", tmp_path / "out", *flags) == 0
    assert read_tree(tmp_path / "out") == files


class PartsStore:
    """Records the multipart calls ShardSink makes (a unit test: the S3 test above checks a real server)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.put_body: bytes | None = None

    def start_upload(self, path):
        return "upload-1"

    def upload_part(self, path, upload, number, data):
        assert number == len(self.parts) + 1
        self.parts.append(data)
        return f"etag-{number}"

    def finish_upload(self, path, upload, parts, size):
        assert [n for n, _ in parts] == list(range(1, len(self.parts) + 1))
        return size

    def put(self, path, data):
        self.put_body = data
        return len(data)


def test_a_shard_streams_out_in_parts_of_exactly_the_part_size():
    rng = random.Random(4)
    records = [rng.randbytes(n) for n in (700, 3000, 250, 9000, 1, 2500)]   # records span up to 10 parts
    store = PartsStore()
    sink = ShardSink(store, "shards/00000.tfrecord", 1000)
    for record in records:
        sink.write(record)
    assert sink.finish() == sum(map(len, records))
    assert [len(p) for p in store.parts] == [1000] * 15 + [451]
    assert b"".join(store.parts) == b"".join(records) and store.put_body is None

    small = PartsStore()
    sink = ShardSink(small, "shards/00001.tfrecord", 1000)
    sink.write(b"x" * 999)
    sink.finish()
    assert small.parts == [] and small.put_body == b"x" * 999      # under a part: one PUT


class Interrupting:
    """A source store that raises KeyboardInterrupt on its n-th GET and counts GETs."""

    def __init__(self, store, after: int | None) -> None:
        self.store, self.after, self.gets = store, after, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, *args):
        self.gets += 1
        if self.after is not None and self.gets == self.after:
            raise KeyboardInterrupt
        return self.store.get(*args)


def run_worker(src: Path, dst: Path, store_wrapper=None, **options) -> None:
    opts = PackOptions(**{"shard_size": 20 << 10, "concurrency": 1, **options})
    src_store = open_store(to_url(str(src)), metrics=Metrics())
    dst_store = open_store(to_url(str(dst)), metrics=Metrics())
    plan = plan_pack(src_store, dst_store, local_root(str(src)), opts)
    Worker(store_wrapper(src_store) if store_wrapper else src_store, dst_store, to_url(str(src)), opts,
           Progress("pack", quiet=True)).run(plan)


def test_interrupted_pack_resumes_without_redoing_shards_and_equals_a_single_pack(tmp_path):
    files = make_tree(tmp_path / "src", n=80)
    assert pack(tmp_path / "src", tmp_path / "single", "--shard-size", "20K") == 0
    first = Interrupting(None, after=45)
    with pytest.raises(KeyboardInterrupt):
        run_worker(tmp_path / "src", tmp_path / "resumed", lambda s: setattr(first, "store", s) or first)
    assert not (tmp_path / "resumed" / MANIFEST).exists()
    done = len(list((tmp_path / "resumed/work/g00000").glob("shard-*.parquet")))
    assert done >= 2
    second = Interrupting(None, after=None)
    run_worker(tmp_path / "src", tmp_path / "resumed", lambda s: setattr(second, "store", s) or second)
    assert 0 < second.gets < len(files) - 30          # the finished shards' files were not fetched again
    assert pack("--merge", tmp_path / "resumed") == 0
    assert shard_bytes(tmp_path / "resumed") == shard_bytes(tmp_path / "single")
    assert index_rows(tmp_path / "resumed") == index_rows(tmp_path / "single")


def test_partitioned_pack_then_merge_equals_a_single_pack(tmp_path, capsys):
    make_tree(tmp_path / "src", n=80)
    assert pack(tmp_path / "src", tmp_path / "single", "--shard-size", "20K") == 0
    shards = json.loads((tmp_path / "single" / MANIFEST).read_text())["shards"]
    for count in (3, shards + 2):     # more workers than shards: some pack nothing and still commit
        dst = tmp_path / f"parts{count}"
        for index in range(count - 1):
            assert pack(tmp_path / "src", dst, "--shard-size", "20K", "--worker-index", index,
                        "--worker-count", count) == 0
        assert pack("--merge", dst) == PackExit.INCOMPLETE
        assert not (dst / MANIFEST).exists()
        assert pack(tmp_path / "src", dst, "--shard-size", "20K", "--worker-index", count - 1,
                    "--worker-count", count) == 0
        assert pack("--merge", dst) == 0
        assert shard_bytes(dst) == shard_bytes(tmp_path / "single")
        assert index_rows(dst) == index_rows(tmp_path / "single")
    assert "have not committed" in capsys.readouterr().err


def test_a_rerun_with_another_worker_count_reuses_shards_and_merges_its_own_markers(tmp_path):
    make_tree(tmp_path / "src", n=80)
    assert pack(tmp_path / "src", tmp_path / "single", "--shard-size", "20K") == 0
    dst = tmp_path / "dst"
    assert pack(tmp_path / "src", dst, "--shard-size", "20K", "--worker-index", "1", "--worker-count", "5") == 0
    for index in range(2):
        assert pack(tmp_path / "src", dst, "--shard-size", "20K", "--worker-index", index,
                    "--worker-count", "2") == 0
    assert pack("--merge", dst) == 0
    assert shard_bytes(dst) == shard_bytes(tmp_path / "single")
    assert not (dst / "work").exists()


def test_append_adds_changes_and_tombstones_deletions(tmp_path):
    files = make_tree(tmp_path / "src", n=40)
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "20K") == 0
    before = shard_bytes(tmp_path / "dst")
    assert pack(tmp_path / "src", tmp_path / "dst", "--append") == 0        # nothing changed: no generation
    assert json.loads((tmp_path / "dst" / MANIFEST).read_text())["generation"] == 0
    gone, changed = sorted(files)[3], sorted(files)[10]
    (tmp_path / "src" / gone).unlink()
    (tmp_path / "src" / changed).write_bytes(b"new content, another size")
    write_tree(tmp_path / "src", {"new/file.bin": b"\x01" * 5000})
    assert pack(tmp_path / "src", tmp_path / "dst", "--append", "--shard-size", "20K") == 0
    manifest = json.loads((tmp_path / "dst" / MANIFEST).read_text())
    assert manifest["generation"] == 1 and [g["generation"] for g in manifest["generations"]] == [0, 1]
    assert manifest["files"] == len(files)      # one gone, one new
    tombstones = pq.read_table(tmp_path / "dst" / manifest["tombstones"][0]).to_pylist()
    assert tombstones == [{"path": gone, "generation": 1}]
    after = shard_bytes(tmp_path / "dst")
    assert {k: after[k] for k in before} == before and len(after) > len(before)
    rows = {r["path"]: r for r in index_rows(tmp_path / "dst")}
    assert gone not in rows and rows[changed]["generation"] == 1 and rows["new/file.bin"]["generation"] == 1
    assert pack("--verify", tmp_path / "dst") == 0
    assert unpack(tmp_path / "dst", tmp_path / "out") == 0
    assert read_tree(tmp_path / "out") == read_tree(tmp_path / "src")


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_and_unpack_catch_a_corrupted_shard(tmp_path, capsys):
    make_tree(tmp_path / "src")
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "20K") == 0
    row = next(r for r in index_rows(tmp_path / "dst") if r["size"] > 100)
    flip_byte(tmp_path / "dst/shards" / f"{row['shard']:05d}.tfrecord", row["data_offset"] + 50)
    assert pack("--verify", tmp_path / "dst") == PackExit.CORRUPT
    assert unpack(tmp_path / "dst", tmp_path / "out") == PackExit.CORRUPT
    assert not (tmp_path / "out" / row["path"]).exists()
    err = capsys.readouterr().err
    assert "crc32c" in err and len([line for line in err.splitlines() if line.startswith("cachefs: error")]) == 2


def rewrite_index(dst: Path, change) -> None:
    manifest = json.loads((dst / MANIFEST).read_text())
    table = pq.read_table(dst / manifest["index_files"])
    pq.write_table(change(table), dst / manifest["index_files"])


@pytest.mark.parametrize("damage", ["outside", "truncated", "foreign"])
def test_a_bad_index_is_refused_by_verify_unpack_and_append(tmp_path, damage):
    make_tree(tmp_path / "src")
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "20K") == 0
    dst = tmp_path / "dst"
    manifest = json.loads((dst / MANIFEST).read_text())
    if damage == "outside":
        rows = index_rows(dst)
        rows[5]["data_offset"] += 10**6
        rewrite_index(dst, lambda t: pa.Table.from_pylist(rows, schema=t.schema))
    elif damage == "truncated":
        index = dst / manifest["index_files"]
        index.write_bytes(index.read_bytes()[:-100])
    else:
        pq.write_table(pa.table({"filename": ["a"], "label": [1]}), dst / manifest["index_files"])
    assert pack("--verify", dst) == PackExit.CORRUPT
    assert unpack(dst, tmp_path / "out") == PackExit.CORRUPT
    assert pack(tmp_path / "src", dst, "--append") == PackExit.CORRUPT
    assert not (tmp_path / "out").exists()


def test_an_unknown_manifest_version_is_refused(tmp_path):
    make_tree(tmp_path / "src", n=5)
    assert pack(tmp_path / "src", tmp_path / "dst") == 0
    manifest = json.loads((tmp_path / "dst" / MANIFEST).read_text())
    (tmp_path / "dst" / MANIFEST).write_text(json.dumps({**manifest, "version": 7}))
    assert pack("--verify", tmp_path / "dst") == PackExit.UNKNOWN_VERSION
    assert unpack(tmp_path / "dst", tmp_path / "out") == PackExit.UNKNOWN_VERSION
    assert pack(tmp_path / "src", tmp_path / "dst", "--append") == PackExit.UNKNOWN_VERSION


def assert_nothing_published(dst: Path) -> None:
    assert not (dst / MANIFEST).exists()
    assert not (dst / "shards").exists() or not list((dst / "shards").iterdir())


def test_a_name_with_a_newline_is_refused_before_anything_is_written(tmp_path, capsys):
    make_tree(tmp_path / "src", n=5)
    (tmp_path / "src/bad\nname").write_bytes(b"x")
    assert pack(tmp_path / "src", tmp_path / "dst") == PackExit.BAD_NAME
    assert_nothing_published(tmp_path / "dst")
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "newline" in err


@pytest.mark.parametrize("keys, message", [
    (["a/../b"], "'..'"),
    (["/abs"], "absolute"),
    (["a", "a/b"], "both a file and a directory"),
])
def test_bad_s3_names_are_refused(s3_server, bucket, tmp_path, keys, message, capsys):
    client = s3_client(s3_server.endpoint_url)
    for key in keys + ["ok.bin"]:
        client.put_object(Bucket=bucket, Key=f"src/{key}", Body=b"data")
    dst = tmp_path / "dst"
    assert pack(f"s3://{bucket}/src", dst, "--endpoint-url", s3_server.endpoint_url) == PackExit.BAD_NAME
    assert message in capsys.readouterr().err
    assert_nothing_published(dst)


def test_duplicate_names_are_refused():
    with pytest.raises(BadName, match="appears twice"):
        check_names(["a", "b", "b", "c"])
    check_names(["a", "a.b", "a0", "ab/c"])


def test_a_source_that_changes_during_the_pack_publishes_nothing(tmp_path):
    files = make_tree(tmp_path / "src", n=30)
    opts = PackOptions(shard_size=20_000, concurrency=2)
    src = open_store(to_url(str(tmp_path / "src")), metrics=Metrics())
    dst = open_store(to_url(str(tmp_path / "dst")), metrics=Metrics())
    plan = plan_pack(src, dst, str(tmp_path / "src"), opts)
    victim = sorted(files)[-1]
    (tmp_path / "src" / victim).write_bytes(b"changed while packing" * 3)
    with pytest.raises(SourceChanged, match="changed while it was packed"):
        Worker(src, dst, "file://src", opts, Progress("pack", quiet=True)).run(plan)
    assert not (tmp_path / "dst" / MANIFEST).exists()
    with pytest.raises(NoSuchKey):
        open_index(dst)


def test_usage_errors_and_an_already_packed_destination(tmp_path):
    make_tree(tmp_path / "src", n=5)
    assert pack(tmp_path / "src") == 2
    assert pack(tmp_path / "src", tmp_path / "dst", "--worker-index", "3", "--worker-count", "2") == 2
    assert pack(tmp_path / "src", tmp_path / "dst", "--worker-index", "0", "--worker-count", "0") == 2
    assert pack(tmp_path / "src", tmp_path / "dst", "--concurrency", "0") == 2
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "lots") == 2
    assert pack(tmp_path / "src", tmp_path / "dst", "--append") == 2
    assert pack(tmp_path / "src", tmp_path / "src/packed") == 2
    assert pack(tmp_path / "src", tmp_path / "src") == 2
    assert pack(tmp_path / "src", tmp_path / "dst") == 0
    assert pack(tmp_path / "src", tmp_path / "dst") == 2
    assert pack("--merge", tmp_path / "empty") == PackExit.INCOMPLETE
    assert unpack(tmp_path / "dst", tmp_path / "out", "--concurrency", "0") == 2
    assert pack("--verify", tmp_path / "dst", "--concurrency", "0") == 2
    assert not (tmp_path / "out").exists()


def test_a_missing_or_empty_source_is_refused_and_publishes_nothing(tmp_path, s3_server, bucket, capsys):
    """A mistyped SRC lists no files: exit 3 (not found) and one line, never an empty dataset
    published (a mount of it would show nothing), nor an --append that tombstones every file."""
    (tmp_path / "empty").mkdir()
    for src in (tmp_path / "no-such-dir", tmp_path / "empty"):
        assert pack(src, tmp_path / "dst") == ExitCode.NOT_FOUND
        assert_nothing_published(tmp_path / "dst")
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all("SRC holds no files" in line and "nothing to pack" in line for line in err)
    assert pack(f"s3://{bucket}/typo", tmp_path / "dst", "--endpoint-url", s3_server.endpoint_url) == ExitCode.NOT_FOUND
    assert_nothing_published(tmp_path / "dst")
    files = make_tree(tmp_path / "src", n=5)
    assert pack(tmp_path / "src", tmp_path / "dst") == 0
    capsys.readouterr()
    assert pack(tmp_path / "empty", tmp_path / "dst", "--append") == ExitCode.NOT_FOUND
    assert "--append would delete every packed file" in capsys.readouterr().err
    assert unpack(tmp_path / "dst", tmp_path / "out") == 0
    assert read_tree(tmp_path / "out") == files      # the dataset is untouched

def test_pack_refuses_a_destination_holding_other_objects(tmp_path, capsys):
    """A DST that already holds a user's objects: exit 2 and nothing written, since a mount of a packed
    DST shows only the packed dataset (those objects would vanish from view)."""
    make_tree(tmp_path / "src", n=5)
    write_tree(tmp_path / "dst", {"results/run1.csv": b"precious"})
    assert pack(tmp_path / "src", tmp_path / "dst") == 2
    assert "already holds other objects" in capsys.readouterr().err
    assert_nothing_published(tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == {"results/run1.csv": b"precious"}


def test_unpack_never_replaces_a_file_unless_told_to(tmp_path, s3_server, bucket, capsys):
    """OUT holding a file at one of the dataset's paths: exit 2 before anything is written; the user's
    file is kept. Files at other paths are no conflict; --overwrite replaces. The same on S3."""
    files = make_tree(tmp_path / "src", n=12)
    assert pack(tmp_path / "src", tmp_path / "dst") == 0
    victim = sorted(files)[3]
    write_tree(tmp_path / "out", {victim: b"the user's own file", "notes.txt": b"unrelated"})
    capsys.readouterr()
    assert unpack(tmp_path / "dst", tmp_path / "out") == 2
    assert f"e.g. {victim!r}" in capsys.readouterr().err
    assert read_tree(tmp_path / "out") == {victim: b"the user's own file", "notes.txt": b"unrelated"}
    write_tree(tmp_path / "out2", {"notes.txt": b"unrelated"})
    assert unpack(tmp_path / "dst", tmp_path / "out2") == 0
    assert read_tree(tmp_path / "out2") == {**files, "notes.txt": b"unrelated"}
    assert unpack(tmp_path / "dst", tmp_path / "out", "--overwrite") == 0
    assert read_tree(tmp_path / "out") == {**files, "notes.txt": b"unrelated"}
    packed = read_tree(tmp_path / "dst")
    for inside in (tmp_path / "dst", tmp_path / "dst" / "restored"):   # the packed view would hide them
        assert unpack(tmp_path / "dst", inside, "--overwrite") == 2
    assert read_tree(tmp_path / "dst") == packed

    client = s3_client(s3_server.endpoint_url)
    client.put_object(Bucket=bucket, Key=f"restored/{victim}", Body=b"on s3")
    flags = ("--endpoint-url", s3_server.endpoint_url)
    assert unpack(tmp_path / "dst", f"s3://{bucket}/restored", *flags) == 2
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="restored/")["Contents"]]
    assert keys == [f"restored/{victim}"]
    assert client.get_object(Bucket=bucket, Key=f"restored/{victim}")["Body"].read() == b"on s3"
    assert unpack(tmp_path / "dst", f"s3://{bucket}/restored", *flags, "--overwrite") == 0
    assert client.get_object(Bucket=bucket, Key=f"restored/{victim}")["Body"].read() == files[victim]

def test_json_progress_lines_end_with_a_summary(tmp_path, capsys):
    files = make_tree(tmp_path / "src", n=20)
    assert main(["pack", "--json", str(tmp_path / "src"), str(tmp_path / "dst"), "--shard-size", "8K"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "progress" and lines[-1]["event"] == "summary"
    assert lines[-1]["total_files"] == len(files) and lines[-1]["done_files"] == len(files)
    assert 10 << 20 < lines[-1]["peak_rss_bytes"] < 4 << 30


def test_the_peak_rss_is_the_packers_own_not_its_parents():
    """A packer started from a process with 300 MiB resident reports its own peak (VmHWM), where
    getrusage's ru_maxrss would report the parent's 300 MiB (Linux counts it across exec)."""
    code = ("import json, resource; from packer.progress import peak_rss; "
            "print(json.dumps([peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")
    ballast = bytearray(300 << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1                                   # resident, not just mapped
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, ru_maxrss = json.loads(out.stdout)
    del ballast
    assert ru_maxrss > 300 << 20                         # the quirk this works around
    assert 10 << 20 < own < 200 << 20
    assert vm_hwm((1 << 22) + 1) is None                 # past the largest pid: no process says


def test_an_s3_object_overwritten_during_the_pack_publishes_nothing(s3_server, bucket):
    client = s3_client(s3_server.endpoint_url)
    files = {f"f{i:02d}": bytes([i]) * 500 for i in range(20)}
    put_tree(client, bucket, "src", files)
    opts = PackOptions(shard_size=4096, concurrency=4)
    src = open_store(f"s3://{bucket}/src", metrics=Metrics(), endpoint_url=s3_server.endpoint_url)
    dst = open_store(f"s3://{bucket}/dst", metrics=Metrics(), endpoint_url=s3_server.endpoint_url)
    plan = plan_pack(src, dst, None, opts)
    client.put_object(Bucket=bucket, Key="src/f13", Body=b"same size, new bytes".ljust(500, b"!"))
    with pytest.raises(SourceChanged, match="f13"):
        Worker(src, dst, f"s3://{bucket}/src", opts, Progress("pack", quiet=True)).run(plan)
    with pytest.raises(NoSuchKey):
        open_index(dst)


def test_a_rerun_after_the_source_shrank_drops_the_unpublished_shards(tmp_path):
    files = make_tree(tmp_path / "src", n=80)
    with pytest.raises(KeyboardInterrupt):
        run_worker(tmp_path / "src", tmp_path / "dst", lambda s: Interrupting(s, after=70))
    written = len(list((tmp_path / "dst/shards").glob("*.tfrecord")))
    for path in sorted(files)[20:]:
        (tmp_path / "src" / path).unlink()
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "20K") == 0
    shards = json.loads((tmp_path / "dst" / MANIFEST).read_text())["shards"]
    assert shards < written
    assert len(list((tmp_path / "dst/shards").glob("*.tfrecord"))) == shards
    assert pack("--verify", tmp_path / "dst") == 0


def test_large_files_streamed_in_ranges_give_the_same_shards(tmp_path):
    make_tree(tmp_path / "src", n=60)
    write_tree(tmp_path / "src", {"huge/a.bin": random.Random(3).randbytes(50_000)})
    assert pack(tmp_path / "src", tmp_path / "whole", "--shard-size", "20K") == 0
    counted = Interrupting(None, after=None)
    run_worker(tmp_path / "src", tmp_path / "streamed", lambda s: setattr(counted, "store", s) or counted,
               stream_above=1000, range_size=700, ranges_in_flight=3)
    assert pack("--merge", tmp_path / "streamed") == 0
    assert shard_bytes(tmp_path / "streamed") == shard_bytes(tmp_path / "whole")
    assert index_rows(tmp_path / "streamed") == index_rows(tmp_path / "whole")
    assert counted.gets > 61 + 50_000 // 700           # the big files came in ranges


@pytest.mark.timeout(180)
def test_ctrl_c_exits_130_publishes_nothing_and_a_rerun_finishes_the_same_pack(tmp_path):
    import signal

    write_tree(tmp_path / "src", {f"d{i % 10}/f{i:05d}": bytes([i % 251]) * (200 + i % 700) for i in range(4000)})
    command = [sys.executable, "-c", "import sys; from cachefs.cli import main; sys.exit(main(sys.argv[1:]))",
               "pack", "--json", "--concurrency", "2", "--shard-size", "16K",
               str(tmp_path / "src"), str(tmp_path / "dst")]
    # the pack holds after its third shard until interrupted: the Ctrl-C lands mid-pack on any machine
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                            preexec_fn=interruptible, env={**os.environ, "CACHEFS_TEST_HOLD_AFTER_SHARDS": "3"})
    try:
        for line in proc.stdout:
            event = json.loads(line)
            assert event["event"] == "progress", "the pack finished before it could be interrupted"
            if event["done_shards"] >= 3:
                proc.send_signal(signal.SIGINT)
                break
        assert proc.wait(timeout=60) == PackExit.INTERRUPTED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "dst" / MANIFEST).exists()
    finished = len(list((tmp_path / "dst/work/g00000").glob("shard-*.parquet")))
    assert finished >= 3
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "16K") == 0
    assert pack(tmp_path / "src", tmp_path / "single", "--shard-size", "16K") == 0
    assert shard_bytes(tmp_path / "dst") == shard_bytes(tmp_path / "single")
    assert index_rows(tmp_path / "dst") == index_rows(tmp_path / "single")


def test_a_second_pack_of_a_destination_being_packed_is_refused_naming_the_first(tmp_path, capsys):
    """Two `cachefs pack` runs to one DST: the second finds the first's lease and refuses (exit 25)
    with a message naming the holder; once the first ends (here: interrupted), a rerun resumes."""
    import signal

    write_tree(tmp_path / "src", {f"d{i % 4}/f{i:04d}": bytes([i % 251]) * (300 + i) for i in range(400)})
    command = [sys.executable, "-c", "import sys; from cachefs.cli import main; sys.exit(main(sys.argv[1:]))",
               "pack", "--json", "--shard-size", "16K", str(tmp_path / "src"), str(tmp_path / "dst")]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                             preexec_fn=interruptible, env={**os.environ, "CACHEFS_TEST_HOLD_AFTER_SHARDS": "2"})
    try:
        for line in first.stdout:
            if json.loads(line).get("done_shards", 0) >= 2:
                break                                   # the first pack holds here, its lease fresh
        assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "16K") == PackExit.INCOMPLETE
        err = capsys.readouterr().err
        assert f"another cachefs pack is writing file://{tmp_path}/dst" in err and f"pid {first.pid}" in err
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == PackExit.INTERRUPTED
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not (tmp_path / "dst/work/lease-00000.json").exists()        # released on the way out
    assert pack(tmp_path / "src", tmp_path / "dst", "--shard-size", "16K") == 0
    assert pack(tmp_path / "src", tmp_path / "single", "--shard-size", "16K") == 0
    assert shard_bytes(tmp_path / "dst") == shard_bytes(tmp_path / "single")


def test_a_lease_left_by_a_killed_pack_expires(tmp_path):
    from packer.lease import Lease

    dst = open_store(f"file://{tmp_path}/dst", metrics=Metrics())
    (tmp_path / "dst").mkdir()
    stale = Lease(dst, 0)
    stale.record["renewed"] = time.time() - 120        # a pack killed two minutes ago
    stale._write = lambda: dst.put(stale.path, json.dumps(stale.record).encode())
    stale._write()
    with Lease(dst, 0) as fresh:                        # expired: taken over
        assert json.loads((tmp_path / "dst" / fresh.path).read_bytes())["id"] == fresh.record["id"]
        with pytest.raises(PackBusy):
            Lease(dst, 0).__enter__()                   # fresh: refused
        with Lease(dst, 1):                             # another worker index has its own lease
            pass
    assert not (tmp_path / "dst/work").exists()
