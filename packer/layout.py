"""Where `cachefs pack` writes below DST (the published names the readers use are in the manifest)."""

from cachefs.packfmt.sidecar import idx_name

WORK = "work"
#: the directories a pack writes below DST before its manifest.json (written last)
PACK_DIRS = ("shards/", "index/", f"{WORK}/")


def work_dir(generation: int) -> str:
    return f"{WORK}/g{generation:05d}"


def fragment_path(generation: int, shard: int) -> str:
    """A finished shard's index rows: written after the shard and its .idx, so it marks the shard done."""
    return f"{work_dir(generation)}/shard-{shard:05d}.parquet"


def marker_path(generation: int, index: int, count: int) -> str:
    """A worker's commit marker: all its shards are done."""
    return f"{work_dir(generation)}/worker-{index:05d}-of-{count:05d}.json"


def index_files_path(generation: int) -> str:
    return f"index/files-g{generation:05d}.parquet"


def index_shards_path(generation: int) -> str:
    return f"index/shards-g{generation:05d}.parquet"


def tombstones_path(generation: int) -> str:
    return f"index/tombstones-g{generation:05d}.parquet"


def idx_path(shard_path: str) -> str:
    return idx_name(shard_path)
