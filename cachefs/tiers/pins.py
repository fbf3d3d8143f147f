"""Pinned datasets of the disk tier, persisted in the cache dir so pins survive a restart.

One file per pin under ``DIR``: ``<blake2b(name)>.pin``, a JSON header line ``{"name": ...}``
then one block digest per line. Written to a temp name, fsynced and renamed (a crash leaves
the old pin or the new one). Only the trio thread calls ``add``/``remove`` (rare and small
next to reads); ``load`` runs at start.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class PinSet:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.pins: dict[str, set[str]] = {}

    def load(self) -> dict[str, set[str]]:
        """Read every pin file (blocking: call at start, in a worker thread)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.glob("*.pin")):
            try:
                header, *digests = path.read_text().splitlines()
                self.pins[json.loads(header)["name"]] = set(digests)
            except (OSError, ValueError, KeyError) as exc:
                log.info("ignoring unreadable pin file %s: %s", path, exc)
        return self.pins

    def add(self, name: str, digests: set[str]) -> None:
        self.pins[name] = set(digests)
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        body = json.dumps({"name": name}) + "\n" + "".join(f"{d}\n" for d in sorted(digests))
        with open(tmp, "w") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def remove(self, name: str) -> set[str]:
        digests = self.pins.pop(name, set())
        self._path(name).unlink(missing_ok=True)
        return digests

    def _path(self, name: str) -> Path:
        return self.dir / (hashlib.blake2b(name.encode(), digest_size=12).hexdigest() + ".pin")
