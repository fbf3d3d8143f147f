"""Volume capabilities: cachefs serves filesystem (mount) volumes only, in every access mode; the
writer modes need a writable volume (write-back), the reader modes are what datasets use."""

from csi.errors import invalid
from csi.proto import pb

Mode = pb.VolumeCapability.AccessMode
READER_MODES = (Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY)


def checked(capability, field: str = "volume_capability"):
    """INVALID_ARGUMENT for a missing, block or unknown-mode capability; returns it."""
    if capability is None or capability.ByteSize() == 0:
        raise invalid(f"{field} is required")
    if capability.HasField("block"):
        raise invalid(f"{field}: cachefs volumes are filesystems, not block devices")
    if capability.access_mode.mode == Mode.UNKNOWN:
        raise invalid(f"{field}: access_mode is required")
    return capability


def reader_only(capability) -> bool:
    return capability.access_mode.mode in READER_MODES


def unsupported(capability, writable: bool) -> str:
    """Why this capability cannot be served ("" when it can)."""
    if capability.HasField("block"):
        return "cachefs volumes are filesystems, not block devices"
    if capability.access_mode.mode == Mode.UNKNOWN:
        return "access_mode is required"
    if not writable and not reader_only(capability):
        return "the volume is read-only (readOnly or immutable): only reader access modes"
    return ""
