"""`--prefetch-dataset`: when a job reads many distinct files of one dataset on an immutable
mount, warm the rest of it in the background (a detached warmup of the lowest common
directory of those files), unless it exceeds the byte budget or the room in the cache.

The hook runs in the trio thread on the first read of each open file (``Tiers.read``
at offset 0) and only counts; the warm job itself runs in the ``Warmer``'s nursery, below
readers in priority like any warmup. ("prefetch" here is only the option's name, kept for
compatibility; the work is a detached warm.)
"""

import logging
import posixpath
import time
from collections import OrderedDict

from cachefs.errors import CachefsError
from cachefs.tiers.cache import FileVersion
from cachefs.warm.job import WarmSpec

log = logging.getLogger(__name__)


class DatasetWatcher:
    def __init__(self, warmer, budget: int, *, min_files: int = 32, window: float = 120.0,
                 concurrency: int = 32) -> None:
        self.warmer = warmer
        self.budget = budget
        self.min_files = min_files
        self.window = window
        self.concurrency = concurrency
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._tried: dict[str, str] = {}       # dataset dir -> what happened

    def on_first_read(self, f: FileVersion) -> None:
        if any(_within(f.path, root) for root in self._tried):
            return
        now = time.monotonic()
        self._seen[f.path] = now
        self._seen.move_to_end(f.path)
        while self._seen and next(iter(self._seen.values())) < now - self.window:
            self._seen.popitem(last=False)
        if len(self._seen) >= self.min_files:
            self._trigger(_common_dir(list(self._seen)))

    def _trigger(self, root: str) -> None:
        self._seen.clear()
        self._tried[root] = "started"
        try:
            job = self.warmer.start(WarmSpec(paths=(root,)), concurrency=self.concurrency, detach=True,
                                     label=f"dataset warm of /{root}", budget=self.budget)
        except CachefsError as exc:         # e.g. the dataset does not fit: recorded, shown in status
            self._tried[root] = f"not started: {exc}"
            log.info("dataset warm of /%s not started: %s", root, exc)
            return
        except Exception as exc:            # a bug: logged, but never fails the read that triggered it
            self._tried[root] = f"not started: {exc}"
            log.exception("dataset warm of /%s failed to start", root)
            return
        log.info("--prefetch-dataset: warming /%s in the background (budget %d bytes)", root, self.budget)
        self.warmer.start_soon(self._record, root, job)

    async def _record(self, root: str, job) -> None:
        await job.done.wait()
        self._tried[root] = job.state if not job.error else f"{job.state}: {job.error}"
        if job.state == "refused":
            log.info("dataset warm of /%s is off: %s", root, job.error)

    def status(self) -> dict:
        return {"budget": self.budget, "datasets": dict(self._tried)}


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + "/")


def _common_dir(paths: list[str]) -> str:
    parents = [posixpath.dirname(p) for p in paths]
    common = posixpath.commonpath(parents) if all(parents) else ""
    return common
