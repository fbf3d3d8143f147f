"""The disk tier, split by what each part owns (``tier.DiskTier`` is the facade).

``format`` one block file; ``index`` the index of block files and their layout; ``space``
capacity, the free-space watermark and eviction; ``health`` fencing a failing disk; ``reader``
the read policy (inline or worker threads); ``tier`` the fill queue, unlinks, holds and pins.
The concurrency and crash protocol is in ``cachefs/tiers/README.md``.
"""

from cachefs.tiers.disk.format import BlockHeader
from cachefs.tiers.disk.health import DiskHealth
from cachefs.tiers.disk.tier import DiskTier

__all__ = ["BlockHeader", "DiskHealth", "DiskTier"]
