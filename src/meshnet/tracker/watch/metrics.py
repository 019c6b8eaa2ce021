"""The tracker's Prometheus metrics, in a registry the tracker object owns.

Two kinds of figures, each measured where it happens:

- **Events** (counters and histograms, updated as they happen): generations started
  and how they ended, prompt and generated tokens, time to first token, the time
  between tokens, admission refusals and the queue, failovers and nodes marked down.
  ``Tracker`` calls these at the few points where a generation passes
  (``GenerationMeter``).
- **State** (read at scrape time by ``TrackerCollector``, never kept twice): the
  node registry and each node's last heartbeat, layer coverage, generations in
  flight, reserved streams, sessions by state and ledger totals (both from the
  database).

No metric lives in prometheus_client's global registry: each ``TrackerMetrics`` has
its own ``CollectorRegistry``, so two trackers in one process (the tests) never mix.
Nothing here is a verifier's result: the tracker has no verifier yet, and a metric
that always reads 0 would claim a check that does not happen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshnet.errors import DatabaseUnavailable
from meshnet.model.info import ModelInfo
from meshnet.tracker.nodes.admission import Admission
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.session_data.records import SessionState

log = logging.getLogger(__name__)

# Seconds: a first token takes a prefill through every hop; a later one, one decode step.
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
MAX_SCRAPE_TARGETS = 4096  # nodes whose metrics port the tracker remembers


@dataclass(frozen=True)
class MeshEvent:
    """One failover or one node marked down, as the dashboard lists them."""

    at: float  # wall clock
    what: str  # "failover" | "node-down"
    node_id: str  # the node that failed
    kind: str  # the failure kind (docs/design.md §10)
    detail: str = ""  # what took its place, when known

    def as_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "what": self.what,
            "node_id": self.node_id,
            "kind": self.kind,
            "detail": self.detail,
        }


class TrackerView(Protocol):
    """What the scrape-time collector reads of the tracker."""

    store: Store
    model: ModelInfo

    admission: Admission

    def generations(self) -> Sequence[object]: ...


class NodeScrapeTargets:
    """Each node's metrics port, as the node said (a signed call). The host is always
    the one the node registered, so a node cannot point the tracker elsewhere. Held
    in memory: nodes say it again every few seconds, so a restarted tracker (or a
    second one) learns it soon. Thread-safe."""

    def __init__(self, limit: int = MAX_SCRAPE_TARGETS) -> None:
        self._ports: dict[str, int] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def set(self, node_id: str, port: int) -> bool:
        """Remember ``node_id``'s port; False when the table is full of other nodes."""
        with self._lock:
            if node_id not in self._ports and len(self._ports) >= self._limit:
                return False
            self._ports[node_id] = port
            return True

    def port(self, node_id: str) -> int | None:
        with self._lock:
            return self._ports.get(node_id)


class GenerationMeter:
    """Counts one generation's tokens and times as they pass; call from the event loop."""

    def __init__(self, metrics: TrackerMetrics, kind: str, prompt_tokens: int, t0: float) -> None:
        self._m = metrics
        self._kind = kind
        self._last = t0  # time.monotonic() of the request, then of the last token
        self._tokens = 0
        metrics.generations.labels(kind).inc()
        metrics.prompt_tokens.labels(kind).inc(prompt_tokens)
        # Looked up once: a label lookup per token is most of what counting it costs.
        self._ttft = metrics.ttft.labels(kind)
        self._inter_token = metrics.inter_token.labels(kind)
        self._generated = metrics.generated_tokens.labels(kind)

    def token(self) -> None:
        now = time.monotonic()
        seconds = now - self._last
        if self._tokens == 0:
            self._ttft.observe(seconds)
        else:
            self._inter_token.observe(seconds)
        self._last = now
        self._tokens += 1
        self._generated.inc()

    def ended(self, outcome: str, recoveries: Sequence[tuple[str, float]] = ()) -> None:
        """``outcome``: "completed", a failure kind, or "abandoned" (the caller left);
        ``recoveries``: (method, seconds) of each failover it survived."""
        self._m.finished.labels(self._kind, outcome).inc()
        for method, seconds in recoveries:
            self._m.recovery.labels(method).observe(seconds)


class TrackerMetrics:
    """Every metric of one tracker. ``registry`` is what ``/metrics`` exposes."""

    def __init__(self, recent_events: int = 64) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.generations = Counter(
            "meshnet_generations", "Generations started", ["kind"], registry=r
        )
        self.finished = Counter(
            "meshnet_generations_finished",
            "Generations ended, by outcome (completed, a failure kind, or abandoned)",
            ["kind", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "meshnet_prompt_tokens", "Input tokens of generations started", ["kind"], registry=r
        )
        self.cached_prompt_tokens = Counter(
            "meshnet_prompt_tokens_cached",
            "Input tokens whose KV the route's nodes reused from their prefix caches",
            ["kind"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "meshnet_generated_tokens", "Tokens generated", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "meshnet_time_to_first_token_seconds",
            "From the request (a completion) or the open route (a session turn) to its first token",
            ["kind"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "meshnet_inter_token_seconds",
            "Between one generated token and the next",
            ["kind"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "meshnet_admission_refusals",
            "Generations refused for capacity (429 overloaded, or a node's full KV budget)",
            ["kind"],
            registry=r,
        )
        self.waiting = Gauge(
            "meshnet_admission_waiting",
            "Requests in the admission queue, waiting for capacity",
            registry=r,
        )
        self.failovers = Counter(
            "meshnet_failovers", "Failovers started, by failure kind", ["kind"], registry=r
        )
        self.recovery = Histogram(
            "meshnet_failover_recovery_seconds",
            "From a failure to the next token, of failovers that recovered",
            ["method"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.nodes_down = Counter(
            "meshnet_nodes_marked_down", "Nodes marked down, by reason", ["reason"], registry=r
        )
        self.http = Counter(
            "meshnet_http_requests",
            "HTTP requests answered, by route template and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.scrape_targets = NodeScrapeTargets()
        self._events: deque[MeshEvent] = deque(maxlen=recent_events)
        # Every served model's tracker, when the tracker serves several (set by the app,
        # tracker/serving/served.py): their layers' coverage and generations are scraped too.
        self.served: Callable[[], Sequence[TrackerView]] | None = None

    def watch(self, tracker: TrackerView) -> None:
        """Read ``tracker``'s state at every scrape (call once)."""
        self.registry.register(TrackerCollector(tracker, self))

    def generation(self, kind: str, prompt_tokens: int, t0: float) -> GenerationMeter:
        return GenerationMeter(self, kind, prompt_tokens, t0)

    def failover(self, node_id: str, kind: str, detail: str = "") -> None:
        self.failovers.labels(kind).inc()
        self._events.append(MeshEvent(time.time(), "failover", node_id, kind, detail))

    def node_down(self, node_id: str, reason: str) -> None:
        self.nodes_down.labels(reason).inc()
        self._events.append(MeshEvent(time.time(), "node-down", node_id, reason))

    def events(self) -> list[MeshEvent]:
        """The most recent failovers and nodes marked down, newest first."""
        return list(reversed(self._events))


class TrackerCollector(Collector):
    """The tracker's state, read when scraped. Database-backed families are left out
    of a scrape the database cannot serve (logged), the rest still answer."""

    def __init__(self, tracker: TrackerView, metrics: TrackerMetrics | None = None) -> None:
        self._t = tracker
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # names are not checked for clashes: reading them costs a database query

    def collect(self) -> Iterator[Metric]:
        nodes = self._t.store.nodes()
        served = self._metrics.served if self._metrics is not None else None
        trackers = list(served()) if served is not None else [self._t]
        yield from node_families(nodes, self._t.admission.streams, time.time())
        yield coverage_family([t.model for t in trackers], nodes)
        yield GaugeMetricFamily(
            "meshnet_generations_in_flight",
            "Generations this tracker drives now",
            value=sum(len(t.generations()) for t in trackers),
        )
        try:
            yield session_family(self._t.store)
            yield from ledger_families(self._t.store)
        except DatabaseUnavailable as e:
            log.warning("metrics: sessions and ledger left out of this scrape: %s", e)


def node_families(
    nodes: Sequence[NodeRecord], reserved: Mapping[str, int], now: float
) -> Iterator[Metric]:
    """Per node: up, the layers it serves and what its last heartbeat said."""
    up = GaugeMetricFamily("meshnet_node_up", "1 while the node is up", labels=["node"])
    info = GaugeMetricFamily(
        "meshnet_node_info", "The node's layers, state and backend", labels=_INFO_LABELS
    )
    gauges = {
        field: GaugeMetricFamily(f"meshnet_node_reported_{name}", help_text, labels=["node"])
        for field, (name, help_text) in _LOAD_GAUGES.items()
    }
    age = GaugeMetricFamily(
        "meshnet_node_heartbeat_age_seconds", "Since the node was last heard", labels=["node"]
    )
    streams = GaugeMetricFamily(
        "meshnet_node_streams_reserved",
        "Streams this tracker's generations hold on the node",
        labels=["node"],
    )
    for n in nodes:
        layers = f"{n.layers.start}:{n.layers.end}" if n.layers else "empty"
        up.add_metric([n.node_id], float(n.state is NodeState.UP))
        info.add_metric([n.node_id, layers, n.state.value, n.backend], 1.0)
        load = n.load.model_dump()
        for field, family in gauges.items():
            family.add_metric([n.node_id], float(load[field]))
        age.add_metric([n.node_id], max(0.0, now - n.last_seen))
        streams.add_metric([n.node_id], float(reserved.get(n.node_id, 0)))
    yield from (up, info, *gauges.values(), age, streams)


_INFO_LABELS = ["node", "layers", "state", "backend"]
# NodeLoad field -> (metric name, help), as the node's last heartbeat said. "reported":
# the node's own /metrics has the same figures live, under meshnet_node_<name>.
_LOAD_GAUGES = {
    "sessions": ("sessions", "Sessions whose KV the node holds, at its last heartbeat"),
    "kv_bytes": ("kv_bytes", "KV bytes the node holds, at its last heartbeat"),
    "queue_depth": ("queue_depth", "Steps queued on the node, at its last heartbeat"),
    "tokens_per_s": ("tokens_per_second", "The node's rows per second, at its last heartbeat"),
}


def coverage_family(models: Sequence[ModelInfo], nodes: Sequence[NodeRecord]) -> Metric:
    """Per layer of each served model: how many routable nodes of that model serve it."""
    family = GaugeMetricFamily(
        "meshnet_layer_replicas",
        "Routable nodes serving each layer of the model",
        labels=["model", "layer"],
    )
    for model in models:
        replicas = layer_replicas(model.fingerprint, model.spec.n_layers, nodes)
        for layer, count in enumerate(replicas):
            family.add_metric([model.name, str(layer)], float(count))
    return family


def layer_replicas(fingerprint: str, n_layers: int, nodes: Sequence[NodeRecord]) -> list[int]:
    """For each of a model's ``n_layers``, the routable nodes of its ``fingerprint``
    serving it."""
    counts = [0] * n_layers
    for n in nodes:
        if n.routable and n.layers is not None and n.fingerprint == fingerprint:
            for layer in range(n.layers.start, min(n.layers.end, len(counts))):
                counts[layer] += 1
    return counts


_SESSION_COUNTS = "SELECT state, COUNT(*) FROM sessions GROUP BY state"


def session_counts(store: Store) -> dict[str, int]:
    """Sessions per state (every state, 0 when none)."""
    counts = {s.value: 0 for s in SessionState}
    for state, count in store.db.query(_SESSION_COUNTS):
        if state in counts:
            counts[state] = int(count)
    return counts


def session_family(store: Store) -> Metric:
    family = GaugeMetricFamily("meshnet_sessions", "Sessions by state", labels=["state"])
    for state, count in session_counts(store).items():
        family.add_metric([state], float(count))
    return family


def ledger_families(store: Store) -> Iterator[Metric]:
    """The ledger's totals per node and status (rows past retention are gone, so these
    are gauges: they may fall)."""
    attempts = GaugeMetricFamily(
        "meshnet_ledger_attempts", "Ledger attempts", labels=["node", "status"]
    )
    tokens = GaugeMetricFamily(
        "meshnet_ledger_tokens", "Tokens of ledger attempts", labels=["node", "status"]
    )
    billable = GaugeMetricFamily(
        "meshnet_ledger_billable_layer_tokens",
        "Tokens times layers of billable work",
        labels=["node"],
    )
    for node_id, totals in store.ledger_totals().items():
        billable.add_metric([node_id], float(totals.get("billable_layer_tokens", 0)))
        for key, value in totals.items():
            status, _, what = key.rpartition("_")
            if what == "attempts":
                attempts.add_metric([node_id, status], float(value))
            elif what == "tokens" and status != "billable_layer":
                tokens.add_metric([node_id, status], float(value))
    yield from (attempts, tokens, billable)


def counter_total(counter: Counter) -> float:
    """A counter's value summed over all its label sets."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
