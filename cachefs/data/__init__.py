"""The native loader for packed datasets (``cachefs pack``): see docs/packer.md.

``PackedDataset(root)``: map-style, ``ds[i]`` -> (path, bytes), ``ds.get(path)``.
``PackedIterableDataset(root, seed=...)``: whole shards sequentially, a (seed, epoch) order split
among ranks and DataLoader workers, ``set_epoch``, ``state_dict`` / ``load_state_dict``.
``root`` is a local directory or a cachefs mount holding the packed dataset. torch is optional.
"""

from cachefs.extras import missing

if missing("packer"):
    raise ImportError(f"cachefs.data needs the 'packer' extra (missing: {', '.join(missing('packer'))}): "
                      f"pip install 'cachefs[packer]'")

from cachefs.data.dataset import PackedDataset, PackedIterableDataset, open_packed  # noqa: E402
from cachefs.data.order import consumer_share, epoch_order  # noqa: E402

__all__ = ["PackedDataset", "PackedIterableDataset", "consumer_share", "epoch_order", "open_packed"]
