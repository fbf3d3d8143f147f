"""Keep the daemon's memory predictable (DESIGN invariant 3).

Blocks are 4 MiB bytes objects allocated in worker threads and freed in the trio
thread. With glibc's defaults the mmap threshold grows to the largest freed chunk
(so 4 MiB blocks land in heap arenas and fragment them) and every thread may get
its own arena: freed blocks stay in RSS, spread over many arenas. Two arenas cap the
spread; a fixed 16 MiB mmap threshold (above any block) stops the threshold from drifting
and keeps block-sized buffers in reused heap memory instead of a fresh mmap (zero-filled
page faults) per read.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_malloc(mmap_threshold: int = 16 << 20, arenas: int = 2) -> bool:
    """Apply the settings through mallopt(3); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = libc.mallopt(_M_ARENA_MAX, arenas) == 1 and ok
    except (OSError, AttributeError):
        return False
    if not ok:
        log.info("mallopt refused the memory settings; RSS may exceed the memory budget")
    return ok
