"""The tracker's use cases: start a generation on a route, account it, cancel it.

The route is chosen, and its capacity (a tracker slot, a stream on every node
of it) reserved, before it is opened (the tracker's ``RoutePlanner``, planning.py,
and ``admission``); what does not fit waits briefly or gets ``Overloaded``.
Failures met while opening a route (a dead or misconfigured node) mark that node
down and the route is planned again, so a node killed between requests costs the
next request nothing but a retry. Failures mid-generation come back from the
driver as a ``reroute``, and nodes are marked down, probed and healed, by the
tracker's ``Healer`` (healing.py). Generations can be cancelled by id, and a node
whose heartbeats stop fails the steps waiting on it at once.

The ``Tracker`` holds its parts as the route driver holds its relay and failover:
the planner and the healer are objects of their own, given what they use when
the tracker is made. The parts every model's tracker of one process shares
(admission, ledger spool, Configure lock, metrics, inventory) come in one
``Shared``, made by the first model's tracker (tracker/serving/served.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from meshnet.engine.request import check_request
from meshnet.errors import (
    HeartbeatLost,
    KVBudgetExhausted,
    MeshnetError,
    NoRoute,
    Overloaded,
    StreamReset,
    VerificationFailed,
)
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import Heartbeat, NodeAnnouncement
from meshnet.model.info import ModelInfo
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.accounting.ledger import LedgerRecord, LedgerSpool
from meshnet.tracker.healing import Healer
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.configure import LoadResult, configure_span, unload_node
from meshnet.tracker.nodes.admission import Admission, AdmissionConfig, Reservation
from meshnet.tracker.nodes.inventory import Inventory
from meshnet.tracker.nodes.prefix_routes import PrefixRouting, PromptBlocks
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.nodes.routes import (
    Hop,
    Route,
)
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.planning import RoutePlanner
from meshnet.tracker.routing.driver import DoneEvent, RouteDriver, TokenEvent
from meshnet.tracker.routing.failover import Fabric, Reroute
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.storage.leader_lease import Leadership
from meshnet.tracker.trust.verification import Verification
from meshnet.tracker.trust.verifier import TrustedModel
from meshnet.tracker.watch.metrics import GenerationMeter, TrackerMetrics

log = logging.getLogger(__name__)

_OPEN_ATTEMPTS = 4


@dataclass(frozen=True)
class TrackerConfig:
    heartbeat_timeout_s: float = 3.0  # silence after which a node is probed, and if gone, down
    sweep_interval_s: float = 0.5
    heal_timeout_s: float = 120.0  # an empty node loading a failed span
    replicas: int = 1  # up nodes kept on every layer range by placement.py; 0: no placement
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # capacity, queue
    prefix: PrefixRouting = field(default_factory=PrefixRouting)  # routing by cached prefix


@dataclass(frozen=True)
class Started:
    """A generation whose route is open; iterate ``events`` to run it."""

    generation_id: str
    route: Route
    epoch: int
    events: AsyncGenerator[TokenEvent | DoneEvent, None]


@dataclass(frozen=True)
class Shared:
    """What every model's tracker in one tracker process shares: capacity is the
    nodes' whatever model they serve, and so is the one Configure at a time."""

    admission: Admission  # tracker slots and every node's streams
    # Ledger records the database refuses wait here: a finished generation is
    # answered whatever its ledger write meets, and is billed once it is written.
    ledger: LedgerSpool
    # One Configure at a time: two failovers, or a failover and the placement
    # controller (placement.py), must not load one empty node twice.
    heal_lock: asyncio.Lock
    metrics: TrackerMetrics  # what /metrics and the dashboard read
    # The shards of models by reference each node holds on disk (its heartbeats):
    # placement prefers a node holding a span, a fetching node is told its peers.
    inventory: Inventory


class Tracker:
    """Routes generations over the registered nodes. Call from the event loop only.

    It holds its route planning (``planner``, a ``RoutePlanner``: planning.py) and its
    failure handling (``healer``, a ``Healer``: healing.py)."""

    def __init__(
        self,
        store: Store,
        model: ModelInfo,
        channels: ChannelPool,
        driver: RouteDriver,
        config: TrackerConfig,
        shared: Shared | None = None,
    ) -> None:
        """``shared``: the first model's tracker's ``shared``, for another model's tracker
        (tracker/serving/served.py); None: a first tracker, whose metrics read it."""
        self.store = store
        self.model = model
        self.channels = channels
        self.driver = driver
        self.config = config
        if shared is None:
            admission, ledger = Admission(config.admission), LedgerSpool(store.record_attempts)
            shared = Shared(admission, ledger, asyncio.Lock(), TrackerMetrics(), Inventory())
            shared.metrics.watch(self)
        self.shared = shared
        self.admission = shared.admission
        self.ledger = shared.ledger
        self.heal_lock = shared.heal_lock
        self.metrics = shared.metrics
        self.inventory = shared.inventory
        self.planner = RoutePlanner(store, model, self.admission, config.prefix)
        self.healer = Healer(store, channels, self.planner, self.metrics, self.heal_lock, self.load)
        self._generations: dict[str, Generation] = {}
        self.verification: Verification | None = None  # when on (--verify-rate)
        self.trusted_nodes: frozenset[str] = frozenset()  # by configuration (--trusted-node)
        # The file ``load`` tells nodes to load, as they see it ("": each node's start
        # model); another served model's tracker names its file (tracker/serving/served.py).
        self.node_model_path = ""
        # Trackers sharing a database take turns at placement (tracker/storage/leader_lease.py):
        # the placement controllers act only while this holds the lease. None: always.
        self.leader: Leadership | None = None

    async def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        top_logprobs: int = -1,
        named: Route | None = None,
        scope: bytes = b"",
    ) -> Started:
        """Open a route for a generation; ``NoRoute`` or ``Overloaded`` when impossible.

        Capacity is reserved first (waiting in the admission queue for it); a node
        that fails the open is routed around, one that is only slow to open makes
        this request ``Overloaded`` rather than that node dead. ``top_logprobs``:
        alternatives reported with each token's log-probability (-1: none).
        ``named``: the route the request named (``requested_route``); the generation
        runs on exactly its nodes, and fails (``NoRoute``) rather than leave them.
        ``scope``: whose prefix cache entries the prompt may reuse and fills
        (``prefix_scope``: its tenant's; empty, the unscoped cache of internal callers).
        """
        check_request(self.model.spec, prompt_ids, params, self.planner.context_limit())
        t0 = time.monotonic()
        try:
            return await self._start(prompt_ids, params, top_logprobs, named, scope, t0)
        except (KVBudgetExhausted, Overloaded) as e:
            self.metrics.refusals.labels(e.kind).inc()
            raise

    async def _start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        top_logprobs: int,
        named: Route | None,
        scope: bytes,
        t0: float,
    ) -> Started:
        last: Exception | None = None
        blocks = PromptBlocks(prompt_ids, scope)  # once, not per admission poll
        for _ in range(_OPEN_ATTEMPTS):
            with self.metrics.waiting.track_inprogress():
                if named is None:
                    reserve = functools.partial(self.planner.reserve, None, blocks)
                    route, held = await self.admission.acquire(reserve)
                else:
                    route = named
                    held = await self.admission.acquire(
                        functools.partial(self.planner.reserve_named, named)
                    )
            gen = self.driver.new_generation(uuid.uuid4().hex, route, params, top_logprobs)
            gen.prefix_scope = scope
            try:
                await self.driver.open(gen, prompt_ids)
            except (KVBudgetExhausted, Overloaded):
                held.release()
                raise  # the node is healthy, only full: the client should come back later
            except MeshnetError as e:
                held.release()
                if not e.node_id:
                    raise
                last = e
                met_at = next((h.address for h in route if h.node_id == e.node_id), "")
                if await self.healer.node_failed(e.node_id, e.kind, met_at):
                    if named is not None:
                        raise NoRoute(f"node {e.node_id} of the named route failed: {e}") from None
                    continue  # a dead or misbehaving node: route around it
                if e.kind == StreamReset.kind:
                    continue  # alive, its stream broke: open again on a fresh channel
                raise self.admission.overloaded(f"node {e.node_id} is slow to open") from None
            except BaseException:
                held.release()
                raise
            self.metrics.cached_prompt_tokens.labels("completion").inc(gen.reused)
            self.planner.routed(route, blocks)  # its nodes keep the prompt's full blocks
            reroute = self.healer.reroute if named is None else self.healer.keep_route
            fabric: Fabric = _Fabric(reroute, self.ledger)
            run = self.driver.run(gen, prompt_ids, params, fabric)
            meter = self.metrics.generation("completion", len(prompt_ids), t0)
            return Started(gen.id, route, gen.epoch, self._accounted(gen, held, run, meter))
        raise NoRoute(f"could not open a route: {last}")

    def prefix_scope(self, tenant: str, salt: str = "") -> bytes:
        """The scope of ``tenant``'s prompts in the nodes' prefix caches (narrowed by a
        request's ``cache_salt``): a keyed hash under the mesh secret, so a node learns no
        tenant id from it, and no tenant's prompt is another's cache hit."""
        return self.channels.keys.prefix_scope(tenant, salt)

    def drive(
        self,
        gen: Generation,
        held: Reservation,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        history: Sequence[int] = (),
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        """Run an opened generation (a session's turn) on capacity ``held``: accounted,
        cancellable, failed over; the capacity is given back when it ends."""
        fabric: Fabric = _Fabric(self.healer.reroute, self.ledger)
        run = self.driver.run(gen, prompt_ids, params, fabric, history)
        meter = self.metrics.generation("turn", len(prompt_ids), time.monotonic())
        return self._accounted(gen, held, run, meter)

    def cancel(self, generation_id: str, reason: str = "cancelled by request") -> bool:
        """Cancel a running generation on every hop; False when none has that id."""
        gen = self._generations.get(generation_id)
        if gen is None:
            return False
        log.info("generation %s: %s", generation_id, reason)
        gen.cancel(reason)
        return True

    def generations(self) -> list[Generation]:
        return list(self._generations.values())

    async def _accounted(
        self,
        gen: Generation,
        held: Reservation,
        events: AsyncGenerator[TokenEvent | DoneEvent, None],
        meter: GenerationMeter,
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        self._generations[gen.id] = gen
        outcome = "abandoned"  # the caller stopped iterating (a client that hung up)
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    meter.token()
                else:
                    outcome = "completed"
                yield event
        except MeshnetError as e:
            outcome = e.kind
            raise
        except Exception:
            outcome = "internal"
            raise
        finally:
            meter.ended(outcome, [(r.method, r.ms / 1000) for r in gen.recoveries])
            del self._generations[gen.id]
            held.release()
            await events.aclose()  # ends the route's streams now, also when abandoned
            for link in gen.links:  # and when the driver never started
                link.close()

    async def load(self, node: NodeRecord, span: LayerRange) -> LoadResult:
        """Tell ``node`` (an empty one, or one placement widens) to load ``span`` of this
        model; on success it is routable at once. Hold ``heal_lock``: this tracker
        configures one node at a time (failover heals and the placement controller alike)."""
        result = await configure_span(
            self.channels,
            node,
            span,
            self.model.fingerprint,
            self.config.heal_timeout_s,
            self.node_model_path,
        )
        if result.hop is None:
            log.warning("node %s did not load layers %s: %s", node.node_id, span, result.failure)
            return result
        self.store.set_layers(node.node_id, span, self.model.fingerprint)
        self.planner.forget(node.node_id)  # a T3 drops what the node had cached
        if self.verification is not None:  # routed only once it calibrated on the span
            self.verification.reconsider(node.node_id)
            if not await self.verification.calibrated(node.node_id):
                return LoadResult(None, f"node {node.node_id} did not calibrate on {span}")
        log.info("healed: node %s now serves layers %s", node.node_id, span)
        return result

    async def unload(self, node: NodeRecord) -> LoadResult:
        """Tell ``node`` to empty itself (a T3 to nothing: its sessions' KV dropped);
        on success it is empty in the registry at once. Hold ``heal_lock``."""
        result = await unload_node(self.channels, node, self.config.heal_timeout_s)
        if not result.ok:
            log.warning("node %s did not empty itself: %s", node.node_id, result.failure)
            return result
        self.store.set_layers(node.node_id, None, "")
        self.planner.forget(node.node_id)
        log.info("emptied: node %s serves nothing", node.node_id)
        return result

    # --- verification (tracker/trust/verification.py) -----------------------------------

    def verify(
        self, model: TrustedModel, rate: float, trusted: frozenset[str] = frozenset()
    ) -> None:
        """Turn verification on: nodes calibrate before they are routed, and a fraction
        ``rate`` of every node's committed chunks is re-run on chains of ``trusted`` nodes
        where one fits (tracker/trust/trusted_capacity.py), else on ``model``. Trusted nodes are
        neither calibrated nor checked, and their work is billable at once."""
        self.trusted_nodes = trusted
        self.verification = Verification(
            self.store, self.channels, self.model, model, rate, trusted, self._quarantined
        )
        self.driver.claims = self.verification.offer
        self.driver.withheld = self.verification.withheld
        self.ledger.verifying = True  # completed work waits for its checks (ledger.py)
        self.ledger.trusted |= trusted  # one spool for every model's tracker (served.py)

    def register(self, a: NodeAnnouncement) -> None:
        """A node registered (again): up, or with verification on, calibrating."""
        before = self.store.node(a.node_id)
        self.store.register(a, time.time())
        self.planner.forget(a.node_id)  # a node registers afresh with an empty cache
        if self.verification is not None:
            self.verification.registered(a.node_id, before)

    def heartbeat(self, node_id: str, hb: Heartbeat) -> bool:
        """A node's heartbeat; False when it is unknown or down (it registers again)."""
        known = self.store.heartbeat(node_id, hb, time.time())
        if known and self.verification is not None:
            self.verification.reconsider(node_id)  # it may serve other layers (a T3 configure)
        return known

    def _quarantined(self, node_id: str, reason: str) -> None:
        """Fail over every generation running on a quarantined node, at once."""
        self.metrics.node_down(node_id, VerificationFailed.kind)
        verdict = VerificationFailed(f"node {node_id} quarantined: {reason}", node_id)
        for gen in self.generations():
            gen.node_lost(node_id, verdict)

    async def sweep(self) -> list[str]:
        """Mark down nodes that went silent and do not answer a probe, and fail the
        steps waiting on them (``heartbeat-lost``)."""
        lost = await self.healer.silent_gone(self.config.heartbeat_timeout_s)
        for node_id in lost:
            verdict = HeartbeatLost(f"node {node_id} stopped heartbeating", node_id)
            for gen in self.generations():
                gen.node_lost(node_id, verdict)
        return lost


@dataclass(frozen=True)
class _Fabric:
    """The driver's fabric for one generation: its failover is ``heal``'s (the healer's
    ``reroute``, or ``keep_route`` for a generation on the route its request named:
    failover stays on those nodes), its ledger records go to the tracker's spool."""

    heal: Callable[[Route, Hop | None, MeshnetError], Awaitable[Reroute]]
    ledger: LedgerSpool

    async def reroute(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute:
        return await self.heal(route, failed, error)

    def record(self, records: Iterable[LedgerRecord]) -> None:
        self.ledger.submit(records)
