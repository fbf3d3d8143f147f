"""The disk tier's fills: a block waiting to be written, and the byte budget and writer threads
of the foreground fill queue (the fills readers start; a warmup's fills wait instead, on their
own writer threads, outside this budget)."""

from dataclasses import dataclass, field

import trio

WRITER_SCALE = 8 << 20     # queued and running fill bytes per extra writer thread


@dataclass(eq=False)
class FillJob:
    digest: str
    data: bytes
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False
    cancelled: bool = False
    low: bool = False         # a warm fill: its own writer threads, outside the fill queue's budget
    exact: bool = False       # written as an exact file (the data alone: passthrough can hand it over)


class FillBudget:
    """Bytes held by queued and running foreground fills, at most ``max_bytes``, and the limiter
    of their writer threads: one, plus one for every WRITER_SCALE bytes queued and running, up to
    ``workers``. Writers beside each other contend for the GIL and the CPUs with the trio thread:
    in a cold epoch of small files (fills of 110 KiB that rarely queue), one writer against four
    gave 1.02-1.08x boto3 against 0.94-1.00x, at 1.4-1.5 ms of daemon CPU per file against 1.8;
    a cold 1 GiB file read at 400 MB/s needs more than one writer (one dropped 30% of its fills,
    queue_full)."""

    def __init__(self, max_bytes: int, workers: int) -> None:
        self.max_bytes = max_bytes
        self.workers = workers
        self.bytes = 0
        self.limiter = trio.CapacityLimiter(1)

    def full(self, more: int) -> bool:
        return self.bytes + more > self.max_bytes

    def add(self, n: int) -> None:
        self.bytes += n
        self._scale()

    def done(self, n: int) -> None:
        self.bytes -= n
        self._scale()

    def _scale(self) -> None:
        want = max(1, min(self.workers, 1 + self.bytes // WRITER_SCALE))
        if self.limiter.total_tokens != want:
            self.limiter.total_tokens = want
