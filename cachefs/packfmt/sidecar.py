"""The per-shard ``.idx`` sidecar: one ``offset length`` line per record (whole frames), the index
format the ``tfrecord`` package and DALI's TFRecord reader take."""

from collections.abc import Iterable


def idx_name(shard_name: str) -> str:
    return f"{shard_name}.idx"


def render_idx(records: Iterable[tuple[int, int]]) -> bytes:
    """``offset length\\n`` for each (record offset, record length)."""
    return "".join(f"{offset} {length}\n" for offset, length in records).encode()


def parse_idx(text: bytes) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (line.split() for line in text.decode().splitlines() if line.strip())]
