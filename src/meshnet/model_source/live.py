"""A fetch under way, as its peers may read it: the bytes it has checked so far.

Two nodes fetching the same range at once would both go to the hub. Instead the
tracker names the first to the second (``GET /mesh/manifest`` with ``fetch=``), and
the second reads each tensor from the first as soon as the first has checked it: a
single flight. ``LiveFetch`` is the first node's record of what it has checked (the
headers and whole tensors, by file and byte span); a peer asking for bytes it has
not checked yet is told ``PeerNotYet`` and asks again (``sources``: bounded by
``SourceConfig.peer_wait_s``, then the hub). Only checked bytes are given, so the
second node's own check of them against the manifest passes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from meshnet.model_source.peers import PeerNotYet, PeerRefused


class LiveFetch:
    """The checked byte spans of a shard being fetched into ``paths`` (one per file of
    the model, each written as ``NAME.partial`` first). Thread-safe."""

    def __init__(self, paths: tuple[Path, ...]) -> None:
        self.paths = paths
        self._spans: list[list[tuple[int, int]]] = [[] for _ in paths]
        self._lock = threading.Lock()

    def checked(self, part: int, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of file ``part`` are written and match their hash."""
        with self._lock:
            self._spans[part].append((start, end))

    def path_for(self, part: int, offset: int, length: int) -> Path:
        """The file to read ``length`` bytes at ``offset`` of file ``part`` from;
        ``PeerNotYet`` when they are not all checked yet."""
        if not 0 <= part < len(self.paths):
            raise PeerRefused(f"no part {part}")
        with self._lock:
            ready = any(a <= offset and offset + length <= b for a, b in self._spans[part])
        if not ready:
            raise PeerNotYet(f"bytes {offset}+{length} of part {part} are not fetched yet")
        final = self.paths[part]
        partial = final.with_name(final.name + ".partial")
        return partial if partial.exists() else final  # renamed once the fetch ended
