"""The disk tier, split by what each part owns (``tier.DiskTier`` is the facade).

``format`` one block file; ``index`` the index of block files and their layout; ``space``
capacity, the free-space watermark and eviction; ``health`` fencing a failing disk; ``reader``
the read policy (inline or worker threads); ``tier`` the fill queue, unlinks, holds and pins.
The concurrency and crash protocol is in ``cachefs/tiers/README.md``.
"""

from typing import TYPE_CHECKING

__all__ = ["BlockHeader", "DiskHealth", "DiskTier"]

if TYPE_CHECKING:
    from cachefs.tiers.disk.format import BlockHeader
    from cachefs.tiers.disk.health import DiskHealth
    from cachefs.tiers.disk.tier import DiskTier


def __getattr__(name: str):
    """Loaded at first use: the loader reads block files (``format``) without the tier's trio."""
    if name == "BlockHeader":
        from cachefs.tiers.disk.format import BlockHeader
        return BlockHeader
    if name == "DiskHealth":
        from cachefs.tiers.disk.health import DiskHealth
        return DiskHealth
    if name == "DiskTier":
        from cachefs.tiers.disk.tier import DiskTier
        return DiskTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
