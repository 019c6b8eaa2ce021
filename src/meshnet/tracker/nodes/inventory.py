"""Which shards each node holds on disk and where it serves them: what its heartbeats
say (``mesh_messages.Holdings``). The tracker tells a node fetching a range which peers
hold it (``GET /mesh/manifest``), and the admin views show it (``GET /admin/inventory``).
It also keeps the fetches nodes said they were starting (``fetch=`` on that call): a
node fetching a range is told of those that began fetching it before it, and reads
from them as they go (``model_source.live``) rather than from the hub.

In memory: a restarted tracker learns it again from the next heartbeats.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import HeldShard, Holdings

MAX_NODES = 4096  # nodes remembered; the oldest report goes past it
FETCH_TTL_S = 3600.0  # a fetch said begun and never seen ended is forgotten after this


@dataclass(frozen=True)
class Holder:
    node_id: str
    bulk_address: str
    shard: HeldShard


@dataclass(frozen=True)
class Fetcher:
    """A node that said it began fetching ``layers`` of ``fingerprint``."""

    node_id: str
    bulk_address: str
    fingerprint: str
    layers: LayerRange
    since: float  # monotonic: who began first


class Inventory:
    """Node id -> its latest holdings, and the fetch it said it began. Thread-safe."""

    def __init__(self) -> None:
        self._by_node: dict[str, Holdings] = {}
        self._fetches: dict[str, Fetcher] = {}
        self._lock = threading.Lock()

    def note(self, node_id: str, holdings: Holdings) -> None:
        with self._lock:
            self._by_node.pop(node_id, None)
            self._by_node[node_id] = holdings
            while len(self._by_node) > MAX_NODES:
                del self._by_node[next(iter(self._by_node))]
            f = self._fetches.get(node_id)
            if f is not None and any(
                (s.fingerprint, s.layer_start, s.layer_end)
                == (f.fingerprint, f.layers.start, f.layers.end)
                for s in holdings.shards
            ):
                del self._fetches[node_id]  # fetched: a holder now

    def fetch_begun(
        self, node_id: str, bulk_address: str, fingerprint: str, layers: LayerRange
    ) -> list[Fetcher]:
        """``node_id`` begins fetching ``layers``; the other nodes fetching ``fingerprint``
        that began before it (a node saying it again keeps its place), oldest first."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, f in self._fetches.items() if now - f.since > FETCH_TTL_S]:
                del self._fetches[key]
            was = self._fetches.pop(node_id, None)
            kept = was is not None and (was.fingerprint, was.layers) == (fingerprint, layers)
            since = was.since if was is not None and kept else now
            mine = Fetcher(node_id, bulk_address, fingerprint, layers, since)
            self._fetches[node_id] = mine
            while len(self._fetches) > MAX_NODES:
                del self._fetches[next(iter(self._fetches))]
            earlier = [
                f
                for f in self._fetches.values()
                if f.fingerprint == fingerprint and f.since < mine.since
            ]
        return sorted(earlier, key=lambda f: f.since)

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
