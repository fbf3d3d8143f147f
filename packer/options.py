"""What one `cachefs pack` run is asked to do, in one frozen dataclass (the CLI only fills it)."""

from dataclasses import dataclass

DEFAULT_SHARD_SIZE = 256 << 20
PART_SIZE = 8 << 20          # multipart part size while a shard streams out (S3's minimum is 5 MiB)


@dataclass(frozen=True)
class StoreOptions:
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None


@dataclass(frozen=True)
class PackOptions:
    shard_size: int = DEFAULT_SHARD_SIZE
    concurrency: int = 32
    worker_index: int = 0
    worker_count: int = 1
    append: bool = False
    part_size: int = PART_SIZE
    stream_above: int = 1 << 20     # larger files are fetched in ranges and streamed, never held whole
    range_size: int = 8 << 20       # one ranged GET of a streamed file
    ranges_in_flight: int = 8       # so at most 2 x concurrency small files + 64 MiB of ranges in memory
