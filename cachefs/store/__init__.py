"""Object stores: one interface (``base``), URLs (``url``) and ``open_store``, a registry by scheme.

``s3://`` opens the S3 / Ceph RGW store (``s3/``); every other scheme fsspec knows opens the
fsspec adapter. The store modules import ``base`` and ``url``, never this registry, so there is
no import circle.
"""

from cachefs.config import parse_endpoint
from cachefs.metrics import Metrics
from cachefs.store.base import Listing, ObjectInfo, ObjectStore
from cachefs.store.url import StoreURL, parse_url

__all__ = ["Listing", "ObjectInfo", "ObjectStore", "StoreURL", "open_store", "parse_endpoint", "parse_url", "store_of"]


def _open_s3(url: str, parsed: StoreURL, metrics: Metrics, options: dict, max_attempts: int) -> ObjectStore:
    from cachefs.store.s3.store import S3Options, S3Store
    return S3Store(parsed.bucket, parsed.prefix, metrics=metrics,
                   options=S3Options(max_attempts=max_attempts, **options))


def _open_fsspec(url: str, parsed: StoreURL, metrics: Metrics, options: dict, max_attempts: int) -> ObjectStore:
    from cachefs.store.fsspec_store import FsspecStore
    return FsspecStore(url, metrics=metrics, max_attempts=max_attempts)


_OPENERS = {"s3": _open_s3}


def store_of(cfg, *, metrics: Metrics) -> ObjectStore:
    """The store a mount's configuration (``cfg``: a MountConfig) names, with its store options."""
    return open_store(cfg.url, metrics=metrics, endpoint_url=cfg.endpoint_url, region=cfg.region,
                      profile=cfg.profile, max_connections=cfg.max_connections,
                      connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
                      max_attempts=cfg.max_attempts, lean_requests=cfg.lean_requests)


def open_store(url: str, *, metrics: Metrics, endpoint_url: str | None = None, region: str | None = None,
               profile: str | None = None, max_connections: int = 64, connect_timeout: float = 5.0,
               read_timeout: float = 30.0, max_attempts: int = 5, lean_requests: bool = True) -> ObjectStore:
    """The store for ``url``: S3Store for ``s3://``, FsspecStore for any other fsspec scheme."""
    parsed = parse_url(url)
    if endpoint_url is not None:
        endpoint_url = parse_endpoint(endpoint_url)
    options = dict(endpoint_url=endpoint_url, region=region, profile=profile, max_connections=max_connections,
                   connect_timeout=connect_timeout, read_timeout=read_timeout, lean_requests=lean_requests)
    opener = _OPENERS.get(parsed.scheme, _open_fsspec)
    return opener(url, parsed, metrics, options, max_attempts)
