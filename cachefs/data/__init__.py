"""The native loader for packed datasets (``cachefs pack``): see docs/packer.md.

``PackedDataset(root)``: map-style, ``ds[i]`` -> (path, bytes), ``ds.get(path)``.
``PackedIterableDataset(root, seed=...)``: whole shards sequentially, a (seed, epoch) order split
among ranks and DataLoader workers, ``set_epoch``, ``state_dict`` / ``load_state_dict``.
``root`` is a local directory or a cachefs mount holding the packed dataset. torch is optional.
"""

from cachefs.data.dataset import PackedDataset, PackedIterableDataset, open_packed
from cachefs.data.order import consumer_share, epoch_order

__all__ = ["PackedDataset", "PackedIterableDataset", "consumer_share", "epoch_order", "open_packed"]
