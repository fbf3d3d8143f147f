"""The native loader over a local packed directory: map-style reads and lookups, the (seed, epoch)
order identical across world sizes, resume mid-epoch, no hang with fewer shards than workers,
crc mismatches raised, and torch DataLoader workers."""

import hashlib
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from cachefs.data import PackedDataset, PackedIterableDataset, consumer_share, epoch_order, shards
from cachefs.data import dataset as dataset_module
from cachefs.metrics import Metrics
from cachefs.packfmt import CorruptRecord
from cachefs.store import open_store
from packer.engine import Worker, plan_pack
from packer.merge import merge
from packer.options import PackOptions
from packer.progress import Progress
from packer.stores import to_url
from testing.s3 import s3_client


def content(path: str) -> bytes:
    return hashlib.sha256(path.encode()).digest() * (1 + len(path) % 7)


def make_packed(root: Path, n: int, shard_size: int) -> dict[str, bytes]:
    files = {f"c{i % 5}/img{i:04d}.jpg": b"" for i in range(n)}
    files = {p: content(p) for p in files}
    for path, data in files.items():
        (root / "src" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / path).write_bytes(data)
    options = PackOptions(shard_size=shard_size, concurrency=4)
    src = open_store(to_url(str(root / "src")), metrics=Metrics())
    dst = open_store(to_url(str(root / "packed")), metrics=Metrics())
    Worker(src, dst, "file://src", options, Progress("pack", quiet=True)).run(plan_pack(src, dst, None, options))
    merge(dst)
    return files


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("packed")
    files = make_packed(root, 203, shard_size=1024)
    return root / "packed", files


def paths_of(samples) -> list[str]:
    return [p for p, _ in samples]


def test_map_style_reads_every_file_in_path_order_and_by_path(packed):
    root, files = packed
    ds = PackedDataset(root)
    assert len(ds) == len(files) and ds.index.shards.num_rows > 10
    assert [ds[i] for i in range(len(ds))] == sorted(files.items())
    assert ds[-1] == sorted(files.items())[-1]
    assert ds.get("c3/img0008.jpg") == files["c3/img0008.jpg"]
    with pytest.raises(KeyError):
        ds.get("c3/nope.jpg")
    with pytest.raises(IndexError):
        ds[len(ds)]


def interleave(shares: list[list[str]]) -> list[str]:
    return [share[k] for k in range(len(shares[0])) for share in shares]


def test_order_is_identical_across_world_sizes_and_differs_across_epochs(packed):
    root, files = packed
    reference = paths_of(PackedIterableDataset(root, seed=11))
    assert sorted(reference) == sorted(files) and reference != sorted(files)
    for world in (2, 3, 7):
        shares = [paths_of(PackedIterableDataset(root, seed=11, rank=r, world_size=world)) for r in range(world)]
        assert len({len(s) for s in shares}) == 1            # equal counts: padded, nobody waits
        assert interleave(shares)[:len(files)] == reference
    other_epoch = PackedIterableDataset(root, seed=11)
    other_epoch.set_epoch(1)
    assert sorted(paths_of(other_epoch)) == sorted(files) and paths_of(other_epoch) != reference
    assert paths_of(PackedIterableDataset(root, seed=12)) != reference
    assert paths_of(PackedIterableDataset(root, seed=11)) == reference


def test_a_consumer_reads_one_shard_after_another(packed):
    root, _ = packed
    ds = PackedIterableDataset(root, seed=3)
    shards = [int(ds.files.shard[ds.index.find(p)]) for p in paths_of(ds)]
    switches = sum(1 for a, b in zip(shards, shards[1:], strict=False) if a != b)
    assert switches == ds.index.shards.num_rows - 1


def test_resume_mid_epoch_gives_exactly_the_remaining_samples(packed):
    root, files = packed
    full = paths_of(PackedIterableDataset(root, seed=5))
    first = PackedIterableDataset(root, seed=5)
    first.set_epoch(0)
    it = iter(first)
    seen = [next(it)[0] for _ in range(77)]
    state = first.state_dict()
    assert state == {"seed": 5, "epoch": 0, "consumed": 77}
    resumed = PackedIterableDataset(root, seed=999)
    resumed.load_state_dict(state)
    assert seen + paths_of(resumed) == full
    # resumed on another world size: the union of the ranks' shares is exactly the rest
    shares = []
    for r in range(3):
        ds = PackedIterableDataset(root, rank=r, world_size=3)
        ds.load_state_dict(state)
        shares.append(paths_of(ds))
    assert interleave(shares)[:len(files) - 77] == full[77:]


@pytest.mark.parametrize("order", ["load-then-set-epoch", "set-epoch-then-load"])
def test_resume_survives_the_training_loops_set_epoch_in_either_order(packed, order):
    """A training loop restores the loader's state, then calls set_epoch(start_epoch) at the top of
    its epoch loop (or the other way round): either way the epoch resumes, it does not replay."""
    root, files = packed
    first = PackedIterableDataset(root, seed=3)
    first.set_epoch(2)
    it = iter(first)
    seen = [next(it)[0] for _ in range(50)]
    state = first.state_dict()
    full = PackedIterableDataset(root, seed=3)
    full.set_epoch(2)
    expected = paths_of(full)
    resumed = PackedIterableDataset(root, seed=3)
    if order == "load-then-set-epoch":
        resumed.load_state_dict(state)
        resumed.set_epoch(state["epoch"])
    else:
        resumed.set_epoch(state["epoch"])
        resumed.load_state_dict(state)
    rest = paths_of(resumed)
    assert seen + rest == expected and len(rest) == len(files) - 50
    resumed.set_epoch(3)                          # the next epoch starts from its first sample
    assert len(paths_of(resumed)) == len(files)


def test_set_epoch_to_another_epoch_after_a_load_warns_that_the_position_is_dropped(packed):
    root, _ = packed
    ds = PackedIterableDataset(root, seed=3)
    ds.load_state_dict({"seed": 3, "epoch": 4, "consumed": 10})
    with pytest.warns(UserWarning, match="drops the resume position loaded for epoch 4"):
        ds.set_epoch(5)


def test_order_helpers_pad_evenly_when_consumers_outnumber_samples():
    order = epoch_order([np.array([0, 1]), np.array([2])], seed=1, epoch=0)
    shares = [consumer_share(order, 0, c, 8).tolist() for c in range(8)]
    assert all(len(s) == 1 for s in shares) and sorted({x for s in shares for x in s}) == [0, 1, 2]
    assert [consumer_share(order, 3, c, 4).tolist() for c in range(4)] == [[], [], [], []]


def test_open_shard_files_are_bounded_and_closed(packed):
    root, files = packed
    ds = PackedDataset(root)
    ds.files.max_open = 3
    assert [ds[i] for i in range(len(ds))] == sorted(files.items())
    assert len(ds.files._fds) == 3
    ds.close()
    assert not ds.files._fds and ds[0] == sorted(files.items())[0]


def test_close_stops_a_whole_shard_read_and_closes_its_file(packed, tmp_path):
    """In a mount the helper thread reads the entered shard whole; close() must leave no file of
    the dataset open (else the mount cannot be unmounted: EBUSY), even mid-read. A shard made an
    8 GiB sparse file stands in for a slow one."""
    import time
    root, _ = packed
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    ds = PackedDataset(copy)
    ds.files.in_mount = True                      # take the mount's path: the whole-shard read
    shard = copy / "shards" / ds.index.shards.column("name")[0].as_py()
    os.truncate(shard, 8 << 30)

    def open_on_shard() -> bool:
        fds = Path("/proc/self/fd")
        return any(os.path.realpath(fd) == str(shard.resolve()) for fd in fds.iterdir() if fd.is_symlink())

    ds.files.touch(0, whole=True)
    deadline = time.monotonic() + 10
    while not open_on_shard():                    # the helper has the shard open and is reading it
        assert time.monotonic() < deadline
        time.sleep(0.001)
    ds.close()
    assert not open_on_shard()


def test_a_corrupted_shard_raises_instead_of_yielding_wrong_bytes(packed, tmp_path):
    root, files = packed
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    ds = PackedDataset(copy)
    row = ds.index.find("c1/img0011.jpg")
    shard = copy / "shards" / ds.index.shards.column("name")[int(ds.files.shard[row])].as_py()
    data = bytearray(shard.read_bytes())
    data[int(ds.files.offset[row]) + 3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord, match="crc32c"):
        PackedDataset(copy)[row]
    with pytest.raises(CorruptRecord, match="crc32c"):
        list(PackedIterableDataset(copy, seed=0))


def collate(batch):
    return batch


@pytest.mark.timeout(120)
def test_dataloader_workers_read_everything(packed):
    torch_data = pytest.importorskip("torch.utils.data")
    root, files = packed
    mapped = torch_data.DataLoader(PackedDataset(root), batch_size=16, num_workers=2, collate_fn=collate)
    assert sorted(s for batch in mapped for s in batch) == sorted(files.items())
    iterable = torch_data.DataLoader(PackedIterableDataset(root, seed=2), batch_size=None, num_workers=2)
    got = list(iterable)
    per_worker = -(-len(files) // 2)
    assert len(got) == 2 * per_worker and dict(got) == files


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by_reference", [True, False])
def test_dataloader_samples_reach_the_main_process_by_reference(packed, by_reference):
    """From DataLoader workers a sample travels as its place in a shard, and the main process reads
    it there: plain bytes, the right ones; with by_reference=False, as pickled bytes."""
    torch_data = pytest.importorskip("torch.utils.data")
    root, files = packed
    before = shards.reference_loads
    with PackedIterableDataset(root, seed=5, by_reference=by_reference) as ds:
        got = list(torch_data.DataLoader(ds, batch_size=None, num_workers=2))
    assert dict(got) == files and all(type(data) is bytes for _, data in got)
    assert shards.reference_loads - before == (len(got) if by_reference else 0)


def test_a_sample_pickled_in_a_worker_is_its_place_and_is_checked_again(packed, tmp_path, monkeypatch):
    import pickle
    root, files = packed
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    monkeypatch.setattr(dataset_module, "_in_worker", lambda: True)
    ds = PackedDataset(copy)
    row = ds.index.find("c2/img0017.jpg")
    path, data = ds[row]
    assert path == "c2/img0017.jpg" and data == files[path] and isinstance(data, bytes)
    blob = pickle.dumps(data)
    assert b"load_reference" in blob and bytes(data) not in blob     # where it lives, not its bytes
    back = pickle.loads(blob)
    assert type(back) is bytes and back == files[path]
    assert type(PackedDataset(copy, by_reference=False)[row][1]) is bytes
    shard = copy / "shards" / ds.index.shards.column("name")[int(ds.files.shard[row])].as_py()
    torn = bytearray(shard.read_bytes())
    torn[int(ds.files.offset[row]) + 1] ^= 0x01              # the shard changed after the worker read it
    shard.write_bytes(bytes(torn))
    ds.close()                                                # (a fresh descriptor: the new file)
    with pytest.raises(CorruptRecord, match="crc32c"):
        pickle.loads(blob)


@pytest.mark.timeout(120)
def test_dataloader_does_not_hang_with_fewer_shards_than_workers(tmp_path):
    torch_data = pytest.importorskip("torch.utils.data")
    files = make_packed(tmp_path, 3, shard_size=1 << 20)
    ds = PackedIterableDataset(tmp_path / "packed", seed=0, rank=1, world_size=3)
    assert ds.index.shards.num_rows == 1
    got = list(torch_data.DataLoader(ds, batch_size=None, num_workers=2))   # 6 consumers, 3 samples, 1 shard
    assert len(got) == 2 and set(dict(got)) <= set(files)     # one each: padded by wrapping around


@pytest.mark.fuse
@pytest.mark.timeout(240)
def test_the_loader_reads_a_packed_dataset_through_a_cachefs_mount(s3_server, bucket, mount_factory, tmp_path):
    """Shards read through FUSE (mapped or pread) give the same, crc-checked bytes."""
    files = make_packed(tmp_path, 150, shard_size=4096)
    client = s3_client(s3_server.endpoint_url)
    for path in sorted((tmp_path / "packed").rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"packed/{path.relative_to(tmp_path / 'packed')}",
                              Body=path.read_bytes())
    mnt = mount_factory(f"s3://{bucket}/packed", "--endpoint-url", s3_server.endpoint_url).start()
    with PackedDataset(mnt.path) as ds:
        assert [ds[i] for i in range(len(files))] == sorted(files.items())
    with PackedIterableDataset(mnt.path, seed=4) as ds:
        got = paths_of(ds)
    assert got == paths_of(PackedIterableDataset(tmp_path / "packed", seed=4))
    torch_data = pytest.importorskip("torch.utils.data")
    before = shards.reference_loads
    with PackedIterableDataset(mnt.path, seed=4) as ds:      # samples by reference: the main reads the mount
        assert dict(torch_data.DataLoader(ds, batch_size=None, num_workers=2)) == files
    assert shards.reference_loads - before >= len(files)
    mnt.umount()      # the datasets closed their files: the mount is not busy


def test_each_shard_is_fetched_ahead_and_in_a_mount_read_whole_ahead(packed, monkeypatch):
    """Entering a shard starts (in a helper thread) the next two of the order; in a mount the
    shard being entered is also read whole into the page cache (by one worker per shard)."""
    root, _files = packed
    sizes = {p.name: p.stat().st_size for p in (root / "shards").iterdir() if p.suffix == ".tfrecord"}
    with PackedIterableDataset(root, seed=5, shuffle=True) as ds:
        order = list(dict.fromkeys(ds.files.shard[ds.order()].tolist()))
        assert len(order) >= 4
        calls = []
        monkeypatch.setattr(ds.files, "touch", lambda shard, whole=False: calls.append((shard, whole)))
        for _ in ds:
            pass
        # entering order[0] starts order[1] and order[2]; entering order[1], order[2] and order[3]
        assert [s for s, whole in calls if not whole][:4] == [order[1], order[2], order[2], order[3]]
        assert not any(whole for _, whole in calls)                 # a local directory: no whole read
        calls.clear()
        ds.files.in_mount = True
        for _ in ds:
            pass
        assert [s for s, whole in calls if whole] == order          # one worker: every shard, in order
        monkeypatch.undo()
        read = []
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(n := real(fd, bufs, off)) or n)
        ds.files._touch(order[0], True, threading.Event())
        assert sum(read) == sizes[ds.files.names[order[0]]] > 0      # read to the end
