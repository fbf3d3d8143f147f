"""A mount that may be stuck: where its daemon sleeps in the kernel, and how to unstick it
(shared by the load soak and the tests of deadlocks)."""

from pathlib import Path


def blocked_in_kernel(pid: int) -> str | None:
    """The kernel function the daemon sleeps in uninterruptibly (state D), else None."""
    with open(f"/proc/{pid}/stat") as fh:
        state = fh.read().rsplit(")", 1)[1].split()[0]
    if state != "D":
        return None
    with open(f"/proc/{pid}/wchan") as fh:
        return fh.read() or "?"


def abort_fuse_connection(mountpoint: Path) -> None:
    """Unstick a deadlocked mount: every waiter gets ECONNABORTED (the soak then ends and reports)."""
    with open("/proc/self/mountinfo") as fh:
        device = next(line.split()[2] for line in fh if line.split()[4] == str(mountpoint))
    Path(f"/sys/fs/fuse/connections/{device.split(':')[1]}/abort").write_text("1\n")
