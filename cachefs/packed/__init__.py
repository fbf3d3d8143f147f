"""The packed wing: everything a mounted packed dataset (``cachefs pack``) adds to a mount.

- ``view``: the packed view: the dataset's index as the mount's listing, packed files read as
  ranges of their shards through the tiers, records checked by their crc32c as blocks arrive;
- ``channel``: the loader channel, the daemon's side: a local loader (``cachefs.data``) gets the
  disk-tier files holding a shard, and asks for shard warms;
- ``wire``: the channel's versioned wire format, the one module the daemon and the loader share
  (stdlib only: the loader imports it in every training process).

The shard and index formats are ``cachefs.packfmt`` (shared with ``packer/``).
Importing this package loads nothing: import the module you need.
"""
