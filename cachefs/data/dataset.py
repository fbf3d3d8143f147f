"""The native loader: a packed dataset read without FUSE's per-file cost.

``PackedDataset`` is map-style (``len``, ``ds[i]`` -> (path, bytes), ``ds.get(path)``);
``PackedIterableDataset`` reads whole shards sequentially in an order from (seed, epoch) that does
not depend on the number of ranks or workers, splits it among ranks and DataLoader workers with
padding (equal counts, no hang), and resumes with ``state_dict`` / ``load_state_dict``. Both
subclass torch's Dataset / IterableDataset when torch is installed, and work without it. A raw
sample a DataLoader worker yields reaches the training process by reference (``by_reference``,
``shards.SampleBytes``): read again there, checked again, never pickled through the pipe.
"""

import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from cachefs.packfmt import PackedIndex
from cachefs.packfmt.store_index import local_root, open_local_index

from .order import consumer_share, epoch_order
from .shards import ShardFiles, register_reader


def _torch_bases() -> tuple[type, type]:
    if importlib.util.find_spec("torch") is None:
        return object, object
    from torch.utils.data import Dataset, IterableDataset
    return Dataset, IterableDataset


_MapBase, _IterableBase = _torch_bases()
Sample = tuple[str, bytes]


class _Packed:
    def __init__(self, root: str | Path, transform: Callable[[str, bytes], object] | None = None,
                 by_reference: bool = True) -> None:
        self.root = local_root(root)       # a mount of a packed dataset: its .cachefs-packed
        self.manifest, self.index = open_local_index(self.root)
        self.files = ShardFiles(self.root, self.index)
        register_reader(self.files)
        self.transform = transform
        self.by_reference = by_reference

    def close(self) -> None:
        """Close the shard files this process opened (reopened on the next read)."""
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sample(self, row: int, data: bytes):
        path = self.index.path(row)
        if self.transform:
            return self.transform(path, data)
        if self.by_reference and _in_worker():        # to the main process by reference (shards.py)
            data = self.files.reference(row, data)
        return path, data


class PackedDataset(_Packed, _MapBase):
    """Map-style: sample ``i`` is the i-th file in path order."""

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        row = i % len(self)
        return self._sample(row, self.files.read(row))

    def get(self, path: str) -> bytes:
        """The bytes of the original file ``path``; KeyError if it is not in the dataset."""
        row = self.index.find(path)
        if row is None:
            raise KeyError(path)
        return self.files.read(row)


class PackedIterableDataset(_Packed, _IterableBase):
    """Whole shards in a seeded order, split among ranks and workers, resumable mid-epoch."""

    def __init__(self, root: str | Path, *, seed: int = 0, shuffle: bool = True, rank: int | None = None,
                 world_size: int | None = None, transform: Callable[[str, bytes], object] | None = None,
                 lookahead: int = 2, by_reference: bool = True) -> None:
        super().__init__(root, transform, by_reference)
        self.lookahead = max(0, lookahead)   # shards fetched ahead of the one being read
        self.seed, self.epoch, self.shuffle = seed, 0, shuffle
        self.rank, self.world_size = _distributed(rank, world_size)
        self._groups = self.index.rows_by_shard()
        self._start = 0          # samples of this epoch consumed before this iteration (resume)
        self._yielded = 0        # samples this process yielded in this epoch since _start
        self._consumers = self.world_size
        self._resuming = False   # a loaded position not yet iterated from

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample, unless it is the epoch a ``load_state_dict``
        just restored: then it resumes there (a training loop may call this after loading)."""
        if self._resuming and epoch == self.epoch:
            return
        if self._resuming and self._start:
            warnings.warn(f"set_epoch({epoch}) drops the resume position loaded for epoch {self.epoch} "
                          f"({self._start} samples consumed): epoch {epoch} starts from its first sample",
                          stacklevel=2)
        self.epoch, self._start, self._yielded, self._resuming = epoch, 0, 0, False

    def order(self):
        """This epoch's global sample order (identical for every rank and worker count)."""
        return epoch_order(self._groups, self.seed, self.epoch, self.shuffle)

    def samples_per_consumer(self, num_workers: int = 1) -> int:
        """What each rank x worker yields this epoch (the same for all: the tail is padded)."""
        remaining = max(0, len(self.index) - self._start)
        consumers = self.world_size * max(1, num_workers)
        return -(-remaining // consumers)

    def __iter__(self) -> Iterator:
        self._resuming = False
        consumer, consumers = self._consumer()
        share = consumer_share(self.order(), self._start, consumer, consumers)
        self._consumers = consumers
        ahead = _shards_in_order(self.files.shard[share]) if self.lookahead else []
        worker, workers = _worker()
        current, position = -1, 0
        try:
            for row in share:
                row = int(row)
                shard = int(self.files.shard[row])
                if shard != current and ahead:          # entering a shard: fetch the next ones ahead
                    current = shard
                    while position < len(ahead) and ahead[position] != shard:
                        position += 1
                    if self.files.in_mount and shard % workers == worker:   # one worker per shard
                        self.files.touch(shard, whole=True)
                    for nxt in ahead[position + 1:position + 1 + self.lookahead]:
                        self.files.touch(nxt)
                data = self.files.read_mapped(row)
                self._yielded += 1
                yield self._sample(row, data)
        finally:
            self.files.release()

    def _consumer(self) -> tuple[int, int]:
        worker, workers = _worker()
        return self.rank * workers + worker, self.world_size * workers

    def state_dict(self, consumed: int | None = None) -> dict:
        """(seed, epoch, samples consumed by all ranks and workers). ``consumed`` defaults to what this
        process yielded times the number of consumers (consumers advance in lockstep); with DataLoader
        workers the main process does not see their counts: pass ``consumed`` (e.g. step x global batch)."""
        if consumed is None:
            consumed = self._start + self._yielded * self._consumers
        return {"seed": self.seed, "epoch": self.epoch, "consumed": min(int(consumed), len(self.index))}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (from ``state_dict``): the next iteration, or the next one after a
        ``set_epoch`` of the same epoch, yields exactly the samples not consumed yet."""
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self._start, self._yielded, self._resuming = int(state["consumed"]), 0, True


def _shards_in_order(shards) -> list[int]:
    """The distinct shards of a share, in the order it first reaches them."""
    seen: dict[int, None] = {}
    for shard in shards.tolist():
        seen.setdefault(shard, None)
    return list(seen)


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return rank, world_size


def _in_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def _worker() -> tuple[int, int]:
    """(worker id, workers) of the DataLoader worker process running this, or (0, 1)."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return (info.id, info.num_workers) if info is not None else (0, 1)


def open_packed(root: str | Path) -> tuple[object, PackedIndex]:
    """The manifest and index of a local packed dataset (for tools that want the table itself)."""
    return open_local_index(root)
