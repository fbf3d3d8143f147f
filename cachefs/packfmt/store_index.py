"""Opening a packed dataset's index from a store (the mount, the packer) or a local directory
(the loader)."""

from pathlib import Path
from typing import TYPE_CHECKING

from cachefs.errors import NoSuchKey
from cachefs.packfmt.errors import CorruptIndex
from cachefs.packfmt.manifest import MANIFEST, Manifest, read_manifest

if TYPE_CHECKING:
    from cachefs.packfmt.index import PackedIndex
    from cachefs.store.base import ObjectStore

PACKED_DIR = ".cachefs-packed"   # where a cachefs mount of a packed dataset shows its layout


def read_object(store: "ObjectStore", path: str) -> bytes:
    info = store.head(path)
    return store.get(path, 0, info.size, info.etag, info.size)


def open_index(store: "ObjectStore") -> tuple[Manifest, "PackedIndex"]:
    """The manifest and validated index of the packed dataset at the store's root."""
    manifest = read_manifest(store)
    if manifest is None:
        raise NoSuchKey(f"{store.url}: no {MANIFEST}: not a packed dataset")
    try:
        files, shards = read_object(store, manifest.index_files), read_object(store, manifest.index_shards)
    except NoSuchKey as exc:
        raise CorruptIndex(f"the manifest names an index file that is missing: {exc}") from exc
    from cachefs.packfmt.index import PackedIndex  # pyarrow: only once a packed dataset is found
    return manifest, PackedIndex.from_parquet(files, shards)


def local_root(root: str | Path) -> Path:
    """The directory holding the layout: ``root`` itself, or ``root/.cachefs-packed`` when ``root`` is
    a cachefs mount of a packed dataset (it shows the original tree; the layout is found by name there)."""
    root = Path(root)
    if not (root / MANIFEST).exists() and (root / PACKED_DIR / MANIFEST).exists():
        return root / PACKED_DIR
    return root


def open_local_index(root: str | Path) -> tuple[Manifest, "PackedIndex"]:
    """The same from a directory (a local copy or a cachefs mount of the packed dataset)."""
    root = local_root(root)
    try:
        manifest = Manifest.from_json((root / MANIFEST).read_bytes(), str(root / MANIFEST))
        files, shards = (root / manifest.index_files).read_bytes(), (root / manifest.index_shards).read_bytes()
    except FileNotFoundError as exc:
        raise NoSuchKey(f"{exc.filename}: missing: not a complete packed dataset") from exc
    from cachefs.packfmt.index import PackedIndex  # pyarrow: only once a packed dataset is found
    return manifest, PackedIndex.from_parquet(files, shards)
