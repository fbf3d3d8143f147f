"""The packed-dataset format, shared by the mount, `cachefs pack` (``packer/``) and the loader
(``cachefs.data``): TFRecord shards of ``tf.train.Example`` {path, data} records, a Parquet index
sorted by path, per-shard ``.idx`` sidecars, and ``manifest.json`` written last.

Layout below the dataset root::

    manifest.json                      written last: publishes everything below
    index/files-gNNNNN.parquet         one row per live file (generation NNNNN's full index)
    index/shards-gNNNNN.parquet        one row per shard
    index/tombstones-gNNNNN.parquet    paths deleted or replaced by generation NNNNN (appends)
    shards/NNNNN.tfrecord              records; NNNNN.tfrecord.idx beside each
    work/...                           per-shard fragments and worker commit markers while packing
"""

from cachefs.packfmt.errors import (
    BadName,
    CorruptIndex,
    CorruptRecord,
    Incomplete,
    PackExit,
    PackFormatError,
    SourceChanged,
    UnknownVersion,
)
from cachefs.packfmt.manifest import MANIFEST, Manifest, is_packed, read_manifest, write_manifest

# The index needs pyarrow and numpy (the `packer` extra, not core dependencies): its names load on
# first use, so a plain mount (which only asks "is there a manifest?") never imports them.
_LAZY = {"FILES_SCHEMA": "index", "SHARDS_SCHEMA": "index", "Entry": "index", "PackedIndex": "index",
         "shard_name": "index", "shard_path": "index", "open_index": "store_index"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["BadName", "CorruptIndex", "CorruptRecord", "Entry", "FILES_SCHEMA", "Incomplete", "MANIFEST",
           "Manifest", "PackExit", "PackFormatError", "PackedIndex", "SHARDS_SCHEMA", "SourceChanged",
           "UnknownVersion", "is_packed", "open_index", "read_manifest", "shard_name", "shard_path",
           "write_manifest"]
