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
from cachefs.packfmt.index import FILES_SCHEMA, SHARDS_SCHEMA, Entry, PackedIndex, shard_name, shard_path
from cachefs.packfmt.manifest import MANIFEST, Manifest, is_packed, read_manifest, write_manifest
from cachefs.packfmt.store_index import open_index

__all__ = ["BadName", "CorruptIndex", "CorruptRecord", "Entry", "FILES_SCHEMA", "Incomplete", "MANIFEST",
           "Manifest", "PackExit", "PackFormatError", "PackedIndex", "SHARDS_SCHEMA", "SourceChanged",
           "UnknownVersion", "is_packed", "open_index", "read_manifest", "shard_name", "shard_path",
           "write_manifest"]
