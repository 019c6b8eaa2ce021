"""A node's Prometheus metrics, in a registry the node process owns.

- **Per forward** (histograms, observed as each batched forward ends): rows and
  sessions in the batch and its seconds. ``NodeMetrics.forward`` is the engine's
  ``on_forward``, told where it already notes each forward's speed, on the engine
  thread: three observations per forward (microseconds beside a forward's
  milliseconds).
- **State** (read at scrape time by ``NodeCollector`` from ``NodeService.stats()``,
  never kept twice): steps finished, inputs relayed by the previous hop, sessions
  and parked sessions held, KV bytes (in use, peak, budget), queue depth, rows/s,
  the layers loaded.

Every series carries the node's id as ``node``: scraped through the tracker
(``/admin/nodes/{id}/metrics``), the scrape's own ``instance`` is the tracker's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshnet.kv.prefix_cache import PrefixStats
from meshnet.node.engine_types import EngineStats

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # sessions in one forward
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # rows (tokens) in one forward
_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class NodeMetrics:
    """Every metric of one node process. ``registry`` is what its ``/metrics`` serves."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry()
        r = self.registry
        self.rows = Counter(
            "meshnet_node_rows", "Rows (token positions) computed by forwards", ["node"], registry=r
        ).labels(node_id)
        self.batch_sessions = Histogram(
            "meshnet_node_batch_sessions",
            "Sessions in one batched forward",
            ["node"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        ).labels(node_id)
        self.batch_rows = Histogram(
            "meshnet_node_batch_rows",
            "Rows in one batched forward (decode steps and prefill chunks)",
            ["node"],
            buckets=_ROW_BUCKETS,
            registry=r,
        ).labels(node_id)
        self.forward_seconds = Histogram(
            "meshnet_node_forward_seconds",
            "One batched forward through the node's layers (a step of every session in it)",
            ["node"],
            buckets=_FORWARD_BUCKETS,
            registry=r,
        ).labels(node_id)

    def forward(self, rows: int, seconds: float, sessions: int) -> None:
        """One forward ended (engine thread)."""
        self.rows.inc(rows)
        self.batch_rows.observe(rows)
        self.batch_sessions.observe(sessions)
        self.forward_seconds.observe(seconds)

    def watch(self, stats: Callable[[], EngineStats]) -> None:
        """Read the node's state through ``stats`` at every scrape (call once)."""
        self.registry.register(NodeCollector(self.node_id, stats))


class NodeCollector(Collector):
    """The node's state, read from its stats when scraped."""

    def __init__(self, node_id: str, stats: Callable[[], EngineStats]) -> None:
        self._node_id = node_id
        self._stats = stats

    def describe(self) -> list[Metric]:
        return [m for m in self.collect()]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        node = [self._node_id]
        for name, help_text, value in _counters(s):
            counter = CounterMetricFamily(f"meshnet_node_{name}", help_text, labels=["node"])
            counter.add_metric(node, value)
            yield counter
        for name, help_text, value in _gauges(s):
            gauge = GaugeMetricFamily(f"meshnet_node_{name}", help_text, labels=["node"])
            gauge.add_metric(node, value)
            yield gauge
        layers = f"{s.layers.start}:{s.layers.end}" if s.layers else "empty"
        info = GaugeMetricFamily(
            "meshnet_node_shard", "The layers loaded and the model's fingerprint", labels=_SHARD
        )
        info.add_metric([self._node_id, layers, s.fingerprint[:16]], 1.0)
        yield info


_SHARD = ["node", "layers", "fingerprint"]


def _counters(s: EngineStats) -> list[tuple[str, str, float]]:
    p = s.prefix or PrefixStats(0, 0, 0, 0, 0, 0, 0)
    return [
        ("steps", "Steps finished (a session's step through this node's layers)", s.steps),
        ("relayed_inputs", "Steps whose input came straight from the previous hop", s.relayed),
        ("head_parts", "Head multiplies shared in time with the ring's first hop", s.head_parts),
        (
            "head_parts_late",
            "Head parts asked of the ring's first hop that this node did itself",
            s.head_parts_late,
        ),
        ("prefix_hits", "Sessions that started on a prefix from the prefix cache", p.hits),
        (
            "prefix_reused_tokens",
            "Prompt positions loaded from the prefix cache instead of computed",
            p.reused_tokens,
        ),
        ("prefix_stored_blocks", "Prompt blocks copied into the prefix cache", p.stored_blocks),
        (
            "prefix_evicted_blocks",
            "Prefix cache blocks let go (least recently used first)",
            p.evicted_blocks,
        ),
    ]


def _gauges(s: EngineStats) -> list[tuple[str, str, float]]:
    p = s.prefix or PrefixStats(0, 0, 0, 0, 0, 0, 0)
    return [
        ("sessions", "Sessions whose KV the node holds hot", s.sessions),
        ("parked_sessions", "Sessions whose KV is parked on the node's disk", s.parked),
        ("kv_bytes", "KV bytes held", s.kv_bytes),
        ("kv_peak_bytes", "Most KV bytes held at once since start", s.kv_peak_bytes),
        ("kv_budget_bytes", "KV bytes the node may hold (0: no limit)", s.kv_budget_bytes),
        ("queue_depth", "Steps submitted and not finished", s.queue_depth),
        ("tokens_per_second", "Rows per second over recent forwards", s.tokens_per_s),
        ("max_streams", "Forward streams the node holds at once", s.max_streams),
        ("loaded", "1 while a shard is loaded", float(s.loaded)),
        ("prefix_cache_bytes", "KV bytes the prefix cache holds", p.nbytes),
        ("prefix_cache_blocks", "Prompt blocks the prefix cache holds", p.blocks),
        (
            "prefix_cache_capacity_bytes",
            "The most the prefix cache may hold (0: off), less what sessions need",
            p.capacity_bytes,
        ),
    ]
