"""Opening SRC / DST: a store URL (s3://, any fsspec scheme) or a plain local path."""

import os

from cachefs.metrics import Metrics
from cachefs.store import ObjectStore, open_store, parse_url

from .options import StoreOptions


def to_url(location: str) -> str:
    """``s3://b/p`` stays; ``./data`` becomes ``file:///abs/data``."""
    if "://" in location:
        return location.rstrip("/")
    return "file://" + os.path.abspath(location)


def open_location(location: str, options: StoreOptions, metrics: Metrics | None = None) -> ObjectStore:
    return open_store(to_url(location), metrics=metrics or Metrics(), endpoint_url=options.endpoint_url,
                      region=options.region, profile=options.profile)


def local_root(location: str) -> str | None:
    """The directory behind a local location (plain path or file://), else None."""
    parsed = parse_url(to_url(location))
    return "/" + parsed.prefix if parsed.scheme in ("file", "local") else None
