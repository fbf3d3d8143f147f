"""``manifest.json``: the versioned description of a packed dataset, written last.

A packed dataset is published by its manifest: the shards and index files it names exist before it
is written (one atomic PUT), so a failed or interrupted pack leaves no manifest a mount could use.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from cachefs.errors import NoSuchKey
from cachefs.packfmt.errors import CorruptIndex, UnknownVersion

if TYPE_CHECKING:                   # the loader reads manifests without the store layer's trio
    from cachefs.store.base import ObjectStore

FORMAT = "cachefs-pack"
VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class Manifest:
    source: str
    tool_version: str
    created: float
    generation: int          # the newest generation (0 = the first pack; each --append adds one)
    files: int               # live files in the index
    bytes: int               # their total size
    shards: int
    shard_bytes: int         # the shards' total size (dead records of replaced files included)
    index_files: str         # paths of the Parquet tables below the dataset root
    index_shards: str
    tombstones: list[str] = field(default_factory=list)   # Parquet tables of deleted paths, one per generation
    generations: list[dict] = field(default_factory=list)  # {generation, created, first_shard, shards, added, deleted}
    version: int = VERSION
    format: str = FORMAT

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = MANIFEST) -> "Manifest":
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptIndex(f"{where}: not JSON ({exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CorruptIndex(f"{where}: not a cachefs pack manifest")
        if raw.get("version") != VERSION:
            raise UnknownVersion(f"{where}: format version {raw.get('version')!r} is unknown to this cachefs "
                                 f"(it reads version {VERSION})")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise CorruptIndex(f"{where}: malformed manifest ({exc})") from exc


def read_manifest(store: "ObjectStore") -> Manifest | None:
    """The store's manifest, None if there is none; CorruptIndex / UnknownVersion if unreadable."""
    try:
        info = store.head(MANIFEST)
    except NoSuchKey:
        return None
    return Manifest.from_json(store.get(MANIFEST, 0, info.size, info.etag, info.size), MANIFEST)


def write_manifest(store: "ObjectStore", manifest: Manifest) -> None:
    """Publish: one atomic PUT (a temporary name then a move on file systems)."""
    store.put(MANIFEST, manifest.to_json())


def is_packed(store: "ObjectStore") -> bool:
    """Whether the store's root is a packed dataset (its manifest exists and is ours)."""
    try:
        return read_manifest(store) is not None
    except CorruptIndex:
        return False
