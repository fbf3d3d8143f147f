"""The shard plan: which files go into which shard, decided from the sorted listing alone.

Record sizes follow from (path, size), so every worker computes the same plan and the same global
shard numbers; ``--worker-index i --worker-count n`` then takes a contiguous run of shards. A
resumed, a partitioned and a single pack therefore write byte-identical shards.
"""

import hashlib
from dataclasses import dataclass

from cachefs.packfmt.tfrecord import record_layout

from .source import SourceFile


@dataclass(frozen=True)
class ShardPlan:
    number: int
    files: tuple[SourceFile, ...]
    bytes: int


@dataclass(frozen=True)
class Plan:
    generation: int
    first_shard: int
    shards: tuple[ShardPlan, ...]
    deleted: tuple[str, ...]       # paths of the previous generation gone from the source
    fingerprint: str

    def for_worker(self, index: int, count: int) -> tuple[ShardPlan, ...]:
        total = len(self.shards)
        return self.shards[total * index // count: total * (index + 1) // count]


def make_plan(files: list[SourceFile], *, shard_size: int, generation: int = 0, first_shard: int = 0,
              deleted: tuple[str, ...] = ()) -> Plan:
    shards = tuple(_split(files, shard_size, first_shard))
    return Plan(generation, first_shard, shards, deleted, _fingerprint(files, shard_size, generation, deleted))


def _split(files: list[SourceFile], shard_size: int, first: int):
    current, used, number = [], 0, first
    for f in files:
        length, _ = record_layout(f.path.encode(), f.size)
        if current and used + length > shard_size:
            yield ShardPlan(number, tuple(current), used)
            current, used, number = [], 0, number + 1
        current.append(f)
        used += length
    if current:
        yield ShardPlan(number, tuple(current), used)


def _fingerprint(files: list[SourceFile], shard_size: int, generation: int, deleted: tuple[str, ...]) -> str:
    digest = hashlib.sha256(f"{shard_size}\n{generation}\n".encode())
    for f in files:
        digest.update(f"{f.path}\0{f.size}\0{f.etag}\0{f.mtime!r}\0{f.mode}\n".encode())
    for path in deleted:
        digest.update(f"-{path}\n".encode())
    return digest.hexdigest()[:32]
