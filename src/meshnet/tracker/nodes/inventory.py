"""Which shards each node holds on disk and where it serves them: what its heartbeats
say (``mesh_messages.Holdings``). The tracker tells a node fetching a range which peers
hold it (``GET /mesh/manifest``), and the admin views show it (``GET /admin/inventory``).

In memory: a restarted tracker learns it again from the next heartbeats.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import HeldShard, Holdings

MAX_NODES = 4096  # nodes remembered; the oldest report goes past it


@dataclass(frozen=True)
class Holder:
    node_id: str
    bulk_address: str
    shard: HeldShard


class Inventory:
    """Node id -> its latest holdings. Thread-safe."""

    def __init__(self) -> None:
        self._by_node: dict[str, Holdings] = {}
        self._lock = threading.Lock()

    def note(self, node_id: str, holdings: Holdings) -> None:
        with self._lock:
            self._by_node.pop(node_id, None)
            self._by_node[node_id] = holdings
            while len(self._by_node) > MAX_NODES:
                del self._by_node[next(iter(self._by_node))]

    def nodes(self) -> dict[str, Holdings]:
        with self._lock:
            return dict(self._by_node)

    def holders(self, fingerprint: str, nodes: set[str]) -> list[Holder]:
        """The shards of ``fingerprint`` that the ``nodes`` (the up ones, the caller left
        out) hold and serve to peers, in node order."""
        out = []
        for node_id, h in sorted(self.nodes().items()):
            if node_id not in nodes or h.bulk_address is None:
                continue
            out += [
                Holder(node_id, h.bulk_address, s) for s in h.shards if s.fingerprint == fingerprint
            ]
        return out

    def spans(self, fingerprint: str) -> dict[str, set[LayerRange]]:
        """Node id -> the spans of ``fingerprint`` it holds on disk."""
        out: dict[str, set[LayerRange]] = {}
        for node_id, h in self.nodes().items():
            for s in h.shards:
                if s.fingerprint == fingerprint:
                    out.setdefault(node_id, set()).add(LayerRange(s.layer_start, s.layer_end))
        return out
