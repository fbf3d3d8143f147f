"""The block cache: ``cache.Tiers`` is the one entry point, over ``memory.MemoryTier`` and
``disk.DiskTier`` (see README.md here for the map and the disk tier's crash protocol)."""
