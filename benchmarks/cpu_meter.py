"""Where a benchmark row's CPU went, and the rate that CPU allows.

Every row of the benchmarks runs the whole pipeline on one machine: the FUSE daemon
(cachefs or a peer), the S3 server, the latency proxy and the readers share its
CPUs. A rate that is bound by CPU, not by the store's latency, is capped at
``cpus / (CPU seconds per file)``; this module measures the terms:

- the box: busy time of all CPUs from ``/proc/stat`` (user, system, irq, steal),
  which also holds kernel threads such as ext4's journal and the page-cache
  writeback that belong to no process;
- named processes: user + system time of each PID (all its threads) from
  ``/proc/PID/stat``;
- the client: this process and the children it waited for (the forked readers,
  the ``cachefs warmup`` CLI), from ``getrusage``.

``other`` is the box's busy time less all of these: kernel threads, and anything
else that ran on the machine meanwhile (noise, so the figure is an upper bound).
A named process must outlive the measured block (daemons and servers do): once
it has exited and been reaped, its CPU time is gone from ``/proc`` and lands in
``other``.
The clock tick is 10 ms, so rows shorter than a second or two are rough.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Self

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def box_busy_s() -> float:
    """CPU-seconds all CPUs have been busy since boot (not idle, not waiting for I/O)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) * TICK_S


def process_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of ``pid`` (all its threads); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()   # the command name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) * TICK_S


def client_cpu_s() -> float:
    """This process's CPU-seconds plus those of the children it has waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def with_children(pid: int | None) -> list[int | None]:
    """``pid`` and its children (a daemon's request loop processes), as the meter names them."""
    if pid is None:
        return [None]
    found: list[int | None] = [pid]
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/children") as fh:
                found.extend(int(child) for child in fh.read().split())
    except OSError:
        pass
    return found


def pids_with_arg(arg: str | Path) -> list[int]:
    """PIDs whose command line has ``arg`` as one whole argument (a peer's daemon, by its mountpoint)."""
    want = os.fsencode(str(arg))
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if want in argv:
            found.append(int(entry.name))
    return found


class CpuMeter:
    """CPU spent between ``__enter__`` and ``__exit__``, split by named process groups.

    ``groups`` maps a name ("daemon", "store") to the PIDs to charge to it. After the
    block, ``per_file(n)`` gives milliseconds per file for each group, the client and
    ``other``, plus ``cores`` (the box's mean busy CPUs) and ``cap_files_s`` (the rate
    at which this row's CPU per file would fill every CPU of the machine).
    """

    def __init__(self, **groups: Iterable[int | None]) -> None:
        me = os.getpid()      # an in-process server (moto's threaded one) is the client's CPU
        self.groups = {name: [pid for pid in pids if pid and pid != me] for name, pids in groups.items()}
        self.spent: dict[str, float] = {}
        self.seconds = 0.0
        self._start: tuple[float, float, float, dict[str, float]] | None = None

    def _groups_s(self) -> dict[str, float]:
        return {name: sum(process_cpu_s(pid) for pid in pids) for name, pids in self.groups.items()}

    def __enter__(self) -> Self:
        self._start = (time.monotonic(), box_busy_s(), client_cpu_s(), self._groups_s())
        return self

    def __exit__(self, *exc) -> None:
        wall0, box0, client0, groups0 = self._start
        groups1 = self._groups_s()
        self.seconds = time.monotonic() - wall0
        self.spent = {name: max(0.0, groups1[name] - groups0[name]) for name in self.groups}
        self.spent["client"] = max(0.0, client_cpu_s() - client0)
        box = max(0.0, box_busy_s() - box0)
        self.spent["other"] = max(0.0, box - sum(self.spent.values()))
        self.spent["total"] = box

    def per_file(self, files: int) -> dict[str, float]:
        """``cpu_<group>_ms`` per file, ``cpu_cores`` busy on average, ``cap_files_s``."""
        if not files or not self.seconds:
            return {}
        out = {f"cpu_{name}_ms": round(seconds * 1e3 / files, 3) for name, seconds in self.spent.items()}
        out["cpu_cores"] = round(self.spent["total"] / self.seconds, 2)
        total_ms = out["cpu_total_ms"]
        out["cap_files_s"] = round((os.cpu_count() or 1) * 1e3 / total_ms, 1) if total_ms else 0.0
        return out


#: the groups the benchmarks report, in their order (``other``: kernel threads and noise; see above)
CPU_GROUPS = ("daemon", "store", "client", "other", "total")


def cpu_text(row: dict) -> str:
    """One line: a row's CPU ms per file by group, the busy CPUs and the CPU cap."""
    parts = " ".join(f"{name} {row[f'cpu_{name}_ms']:.2f}" for name in CPU_GROUPS if f"cpu_{name}_ms" in row)
    return f"CPU ms/file: {parts}; {row['cpu_cores']:.2f} CPUs busy; cap {row['cap_files_s']:.0f} files/s"
