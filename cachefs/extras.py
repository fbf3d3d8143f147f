"""The optional extras of the distribution, checked before a feature that needs one runs.

A plain ``pip install cachefs`` mounts, warms and writes back; packing, the native loader, the
demo's S3 server and the CSI driver need an extra. A missing one is a one-line error naming it
(exit code 2), never a ModuleNotFoundError traceback.
"""

import importlib.util

from cachefs.errors import UsageError

EXTRAS = {
    "packer": ("pyarrow", "numpy", "crc32c"),
    "server": ("moto", "flask"),
    "csi": ("grpc", "google.protobuf"),
}


class MissingExtra(UsageError):
    """A feature's extra is not installed."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this Python cannot import."""
    return [name for name in EXTRAS[extra] if not _importable(name)]


def require(extra: str, feature: str) -> None:
    """Raise MissingExtra when ``feature`` cannot run for want of ``extra``."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(f"{feature} needs the '{extra}' extra (missing: {', '.join(absent)}): "
                           f"pip install 'cachefs[{extra}]'")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
