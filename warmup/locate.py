"""Which cachefs mount serves a dataset argument (a path in a mount, a glob, or an s3:// URL)."""

import os
from dataclasses import dataclass

from cachefs.control.client import request
from cachefs.errors import CachefsError, NoDaemon, UsageError
from cachefs.host import cachefs_mounts

GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Target:
    mountpoint: str
    path: str           # relative to the mount root, "" for all of it
    is_glob: bool


def locate(dataset: str, base: Target | None = None) -> Target:
    """The mount and mount-relative path of ``dataset``; relative ones are taken under ``base``
    (a manifest's entries under the dataset argument) when given."""
    is_glob = any(c in dataset for c in GLOB_CHARS)
    if "://" in dataset:
        return _locate_url(dataset, is_glob)
    if base is not None and not os.path.isabs(dataset):
        return Target(base.mountpoint, _join(base.path, dataset), is_glob)
    path = os.path.abspath(dataset)
    target = _under_mount(path, is_glob)
    if target is None and os.path.realpath(_static(path)) != _static(path):
        target = _under_mount(os.path.join(os.path.realpath(_static(path)), path[len(_static(path)):].lstrip("/")),
                              is_glob)
    if target is None:
        raise NoDaemon(f"{dataset} is not inside a cachefs mount (mounted: {', '.join(cachefs_mounts()) or 'none'})")
    return target


def _under_mount(path: str, is_glob: bool) -> Target | None:
    best = None
    for mnt in cachefs_mounts():
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best)):
            best = mnt
    if best is None:
        return None
    return Target(best, path[len(best):].strip("/"), is_glob)


def _static(path: str) -> str:
    """The part of a path before its first glob component."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in GLOB_CHARS):
            return "/".join(parts[:i]) or "/"
    return path


def _locate_url(url: str, is_glob: bool) -> Target:
    wanted = url.rstrip("/")
    best = None
    for mnt in cachefs_mounts():
        try:
            served = next(request(mnt, "status")).get("url", "").rstrip("/")
        except (CachefsError, StopIteration, OSError):
            continue
        serves = served and (wanted == served or wanted.startswith(served + "/"))
        if serves and (best is None or len(served) > len(best[1])):
            best = (mnt, served)
    if best is None:
        raise NoDaemon(f"no cachefs mount on this node serves {url}")
    return Target(best[0], wanted[len(best[1]):].strip("/"), is_glob)


def _join(base: str, rel: str) -> str:
    rel = rel.strip("/")
    return f"{base}/{rel}" if base and rel else (base or rel)


def one_mount(targets: list[Target]) -> str:
    mounts = {t.mountpoint for t in targets}
    if len(mounts) != 1:
        raise UsageError(f"the datasets must all be in one cachefs mount (got {', '.join(sorted(mounts))})")
    return mounts.pop()
