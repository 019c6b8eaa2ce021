"""The placement controller: every layer range kept on ``replicas`` up nodes, no request needed.

A failover heals only inside a failing generation (``Healer.reroute``); this
loop heals the mesh itself, every ``interval_s``, so a range that lost its last
node is served again before any request asks for it. It plans in pure code
(``plan_placement``: registry records in, loads out) and acts by telling nodes
to load a span (``Tracker.load``, the same ``Configure`` a failover sends).

What it plans, in order of need (the least-covered layers first):

- **Gaps.** Layers no up node of the model serves, *that a node served
  before*: the registry keeps a down node's record, and so its layers. A gap
  is cut at the boundaries of the ranges recorded for the model (up or down),
  so a dead node's span is loaded as it was served; when there are fewer empty
  nodes than pieces, each gap is loaded whole instead, on one node. Layers no
  record ever covered are not a gap: that is a mesh still being assembled
  (nodes register one by one), and is left to its operator.
- **Replicas.** A range served by up nodes, and one of whose layers is on
  fewer than ``replicas`` of them, gets another copy.
- **Widening.** A gap no empty node takes is covered by a live node next to it
  that reports the memory for its range and the gap together (``widening.py``):
  a survivor of a 2-node mesh serves every layer until its peer returns. Of the
  nodes that fit, the one with most memory to spare widens; a node that cannot
  fit is never asked.
- **Absorbing.** A node back on a range inside a wider one, which no route can
  then use, loads that wider range (a replica) when it fits, else is emptied.

Empty nodes are preferred: a node serving a range is never taken away from it,
only widened over a gap (its sessions' KV is dropped by the T3; their steps fail
over exactly). Loads go one at a time, each holding the tracker's ``heal_lock``
and planned afresh inside it, so one gap is never loaded twice at once and no
node gets two loads (also not one from a failover). A failed load holds its span
back (exponential backoff from ``backoff_s``, capped at ``backoff_max_s``) and
the node that failed is used last until it loads something.

Several trackers on one database each run a controller, but only the one
holding the placement lease acts (``Tracker.leader``, tracker/storage/leader_lease.py):
the others plan nothing until it lapses, so one gap is never loaded by two
trackers. The lease is checked again before each load.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

from meshnet.backends.shard import kv_item_bytes
from meshnet.layer_range import LayerRange
from meshnet.model.info import ModelInfo
from meshnet.model.layer_bytes import LayerBytes, file_bytes, float32_bytes, model_layer_bytes
from meshnet.tracker.links.configure import LoadResult
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.nodes.inventory import Inventory
from meshnet.tracker.nodes.registry import NodeId, NodeRecord, NodeState
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.serving.widening import Load, Sizes, plan_absorb, plan_widening
from meshnet.tracker.storage.leader_lease import Leadership


class _Replicas(Protocol):
    @property
    def replicas(self) -> int: ...


class Mesh(Protocol):
    """What the controller needs of its model's tracker (``service.Tracker`` is one):
    the registry, the model, what nodes hold on disk, whether it leads placement, and
    ``load`` and ``unload`` under its lock."""

    @property
    def config(self) -> _Replicas: ...

    @property
    def store(self) -> Store: ...

    @property
    def model(self) -> ModelInfo: ...

    @property
    def inventory(self) -> Inventory: ...

    @property
    def heal_lock(self) -> asyncio.Lock: ...

    @property
    def leader(self) -> Leadership | None: ...

    async def load(self, node: NodeRecord, span: LayerRange) -> LoadResult: ...

    async def unload(self, node: NodeRecord) -> LoadResult: ...


log = logging.getLogger(__name__)


def plan_placement(
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    n_layers: int,
    replicas: int,
    held: Set[LayerRange] = frozenset(),
    avoid: Set[NodeId] = frozenset(),
    on_disk: Mapping[str, Set[LayerRange]] | None = None,
    sizes: Sizes | None = None,
    context: int = 0,
    busy: Set[NodeId] = frozenset(),
) -> list[Load]:
    """The loads that bring every layer range of the model to ``replicas`` up nodes.

    ``held``: spans not to load now (backing off after a failure). ``avoid``: nodes to
    use last (their last load failed). ``on_disk``: the spans of this model each node
    holds on disk (a model by reference: ``tracker/nodes/inventory.py``). The span
    whose least-covered layer has the fewest nodes (then the lowest span) is loaded first,
    by an empty node holding it on disk if one does (it fetches nothing), else by the
    first empty node in node-id order, so the result is reproducible.

    With ``sizes`` (the model's bytes as each backend holds them), a gap no empty node
    takes is then covered by widening a live node next to it, and a node that came
    back to a range no route can use is absorbed (``widening.py``; ``context``: one
    sequence's positions for a node that does not say its own; ``busy``: serving
    nodes not to ask now).
    """
    if replicas < 1:
        return []
    ours = [n for n in nodes if n.layers is not None and n.fingerprint == fingerprint]
    serving = [n.layers for n in ours if n.routable and n.layers is not None]
    known = [n.layers for n in ours if n.layers is not None]
    cover = _coverage(serving, n_layers)
    loads = _empty_loads(nodes, cover, serving, known, replicas, held, avoid, on_disk or {})
    if sizes is None:
        return loads
    taken = set(busy) | {load.node_id for load in loads}
    # What the empty nodes' loads left uncovered, less the ranges of nodes being
    # calibrated: those are about to be served, and widening would only absorb them.
    checking = [n.layers for n in ours if n.state is NodeState.CALIBRATING and n.layers]
    pending = [a + b for a, b in zip(cover, _coverage(checking, n_layers), strict=True)]
    gaps = _gaps(pending, known)
    loads += plan_widening(nodes, fingerprint, gaps, sizes, context, held, taken, avoid)
    taken |= {load.node_id for load in loads}
    return loads + plan_absorb(nodes, fingerprint, n_layers, sizes, context, taken)


def _empty_loads(
    nodes: Sequence[NodeRecord],
    cover: list[int],
    serving: Sequence[LayerRange],
    known: Sequence[LayerRange],
    replicas: int,
    held: Set[LayerRange],
    avoid: Set[NodeId],
    disk: Mapping[str, Set[LayerRange]],
) -> list[Load]:
    """Gaps and missing replicas loaded onto empty nodes; ``cover`` counts them."""
    empty = sorted(
        (n for n in nodes if n.state is NodeState.UP and n.layers is None),
        key=lambda n: (n.node_id in avoid, n.node_id),
    )
    if not empty:
        return []
    n_layers = len(cover)
    wanted = {r for r in serving if r.end <= n_layers}
    wanted |= set(_gap_spans(cover, known, len(empty)))
    wanted -= held
    loads: list[Load] = []
    while empty:
        short = [(min(cover[i] for i in r), r) for r in wanted]
        short = [(c, r) for c, r in short if c < replicas]
        if not short:
            break
        _, span = min(short)
        holders = (n for n in empty if span in disk.get(n.node_id, ()) and n.node_id not in avoid)
        node = next(holders, empty[0])
        empty.remove(node)
        loads.append(Load(node.node_id, span))
        for i in span:
            cover[i] += 1
    return loads


def _coverage(ranges: Sequence[LayerRange], n_layers: int) -> list[int]:
    """How many of ``ranges`` hold each layer of ``[0, n_layers)``."""
    cover = [0] * n_layers
    for r in ranges:
        for i in range(r.start, min(r.end, n_layers)):
            cover[i] += 1
    return cover


def _gaps(cover: Sequence[int], known: Sequence[LayerRange]) -> list[LayerRange]:
    """Runs of layers no range in ``cover`` holds and some ``known`` range held."""
    held_once = _coverage(known, len(cover))
    gaps: list[LayerRange] = []
    for i, (now, before) in enumerate(zip(cover, held_once, strict=True)):
        if now > 0 or before == 0:
            continue
        if gaps and gaps[-1].end == i:
            gaps[-1] = LayerRange(gaps[-1].start, i + 1)
        else:
            gaps.append(LayerRange(i, i + 1))
    return gaps


def _gap_spans(cover: Sequence[int], known: Sequence[LayerRange], empty: int) -> list[LayerRange]:
    """The spans to load into the gaps: cut at the recorded ranges' boundaries (or
    whole, with fewer than ``empty`` pieces)."""
    gaps = _gaps(cover, known)
    cuts = {b for r in known for b in (r.start, r.end)}
    pieces = [p for g in gaps for p in _cut(g, cuts)]
    return pieces if len(pieces) <= empty else gaps


def _cut(span: LayerRange, cuts: Set[int]) -> list[LayerRange]:
    inner = sorted(c for c in cuts if span.start < c < span.end)
    edges = [span.start, *inner, span.end]
    return [LayerRange(a, b) for a, b in itertools.pairwise(edges)]


@dataclass(frozen=True)
class PlacementConfig:
    interval_s: float = 1.0  # between passes: about a node's heartbeat
    backoff_s: float = 1.0  # a span's first wait after a failed load; doubles per failure
    backoff_max_s: float = 30.0  # the longest wait


@dataclass
class PlacementHealth(LoopHealth):
    """The loop's record (``/admin/loops``) with its loads. Written by the loop only."""

    leading: bool = True  # whether its last pass acted (another tracker leads otherwise)
    loads: int = 0  # loads that succeeded
    load_failures: int = 0  # loads a node refused or did not answer
    last_load_failure: str = ""
    backoff: dict[str, float] = field(default_factory=dict)  # span -> its current wait, s


@dataclass
class _Backoff:
    failures: int  # in a row
    until: float  # monotonic time before which the span is not loaded


_Key = LayerRange | NodeId  # what backs off: a span to load, or a node to empty


class Placement:
    """The controller of one tracker; ``run_forever`` is its loop (the event loop's)."""

    def __init__(
        self,
        tracker: Mesh,
        config: PlacementConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        sizes: Sizes | None = None,
    ) -> None:
        self.tracker = tracker
        self.config = config or PlacementConfig()
        self.health = PlacementHealth("placement")
        self._clock = clock
        self._backoff: dict[_Key, _Backoff] = {}
        self._avoid: set[NodeId] = set()  # nodes whose last load failed
        self._sizes: dict[str, LayerBytes] = {}  # per backend: read once from the header
        self._size_of = sizes or self._sizes_of  # a backend's name -> the model's bytes

    async def run_forever(self) -> None:
        """A pass every ``interval_s``; a failed pass is logged and counted, the next runs."""
        while True:
            try:
                await self.pass_once()
            except Exception as e:
                self.health.failed(e)
            else:
                self.health.passed()
            await asyncio.sleep(self.config.interval_s)

    async def pass_once(self) -> list[Load]:
        """Make the loads the registry needs now, one at a time, each node at most once;
        the loads that succeeded."""
        if self.tracker.config.replicas < 1:
            return []
        self.health.leading = self._leads()
        if not self.health.leading:
            return []
        self._forget(self._plan(self.tracker.store.nodes(), held=frozenset()))
        made: list[Load] = []
        tried: set[NodeId] = set()
        while True:
            async with self.tracker.heal_lock:
                if not self._leads():  # the lease lapsed during this pass
                    break
                # A node tried this pass and still empty failed its load: not again now.
                nodes = [
                    n
                    for n in self.tracker.store.nodes()
                    if n.node_id not in tried or n.layers is not None
                ]
                now = self._clock()
                held = {s for s, b in self._backoff.items() if b.until > now}
                load = next(iter(self._plan(nodes, held, tried)), None)
                if load is None:
                    break
                tried.add(load.node_id)
                node = next(n for n in nodes if n.node_id == load.node_id)
                if load.span is None:
                    result = await self.tracker.unload(node)
                else:
                    result = await self.tracker.load(node, load.span)
            if self._settle(load, result):
                made.append(load)
        self.health.backoff = {str(s): self._delay(b.failures) for s, b in self._backoff.items()}
        return made

    def _leads(self) -> bool:
        leader = self.tracker.leader
        return leader is None or leader.leads()

    def _plan(
        self, nodes: Sequence[NodeRecord], held: Set[_Key], busy: Set[NodeId] = frozenset()
    ) -> list[Load]:
        model, replicas = self.tracker.model, self.tracker.config.replicas
        fingerprint, spec = model.fingerprint, model.spec
        on_disk = self.tracker.inventory.spans(fingerprint)
        spans = {k for k in held if isinstance(k, LayerRange)}
        busy = set(busy) | {k for k in held if isinstance(k, str)}  # nodes whose unload waits
        return plan_placement(
            nodes,
            fingerprint,
            spec.n_layers,
            replicas,
            spans,
            self._avoid,
            on_disk,
            self._size_of,
            spec.context_length,
            busy,
        )

    def _sizes_of(self, backend: str) -> LayerBytes:
        """The model's bytes as a node on ``backend`` holds them (numpy: float32), and
        its KV per position."""
        if backend not in self._sizes:
            held = float32_bytes if backend == "numpy" else file_bytes
            model = self.tracker.model
            item = kv_item_bytes(backend)
            self._sizes[backend] = model_layer_bytes(model.file, model.spec, held, item)
        return self._sizes[backend]

    def _forget(self, needed: Sequence[Load]) -> None:
        """Drop the backoff of loads no longer needed: a later need starts afresh."""
        wanted = {_key(load) for load in needed}
        for key in [k for k in self._backoff if k not in wanted]:
            del self._backoff[key]

    def _settle(self, load: Load, result: LoadResult) -> bool:
        """Record a load's outcome; True when it succeeded."""
        key = _key(load)
        if result.ok:
            self.health.loads += 1
            self._backoff.pop(key, None)
            self._avoid.discard(load.node_id)
            return True
        what = load.span if load.span is not None else "empty"
        self.health.load_failures += 1
        self.health.last_load_failure = f"node {load.node_id}, {what}: {result.failure}"
        failures = self._backoff[key].failures + 1 if key in self._backoff else 1
        delay = self._delay(failures)
        self._backoff[key] = _Backoff(failures, self._clock() + delay)
        self._avoid.add(load.node_id)
        log.info("placement: %s waits %.1f s for its next try", key, delay)
        return False

    def _delay(self, failures: int) -> float:
        return float(min(self.config.backoff_s * 2 ** (failures - 1), self.config.backoff_max_s))


def _key(load: Load) -> _Key:
    return load.span if load.span is not None else load.node_id
