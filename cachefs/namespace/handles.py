"""Open file handles: the version a reader pinned, its readahead stream, the staged file a writer holds."""

from cachefs.namespace.nodes import Node
from cachefs.tiers.cache import FileVersion, Stream
from cachefs.writeback.staged import StagedFile


class Handle:
    __slots__ = ("fh", "node", "file", "stream", "entry", "writable")

    def __init__(self, fh: int, node: Node, file: FileVersion | None, entry: StagedFile | None = None,
                 writable: bool = False) -> None:
        self.fh = fh
        self.node = node
        self.file = file
        self.stream = Stream()
        self.entry = entry          # the staged file this handle opened (kept open while it lives)
        self.writable = writable
