"""Serving, replacing and releasing models while the tracker runs (the admin's use cases).

- **serve**: read the model file (as the tracker sees it), choose the nodes —
  the operator's assignment (node ids with layer ranges that cover the model's
  layers exactly once) or, given a count, that many empty nodes in id order
  with the layers split by their bytes (the largest range as light as it can
  be, ``LayerBytes.split``) — and tell each, by a T3 ``Configure`` naming
  the file as the nodes see it, to load its range. Only empty, up nodes are
  used. All load, or none: the nodes that loaded are emptied again and the
  typed reason is raised, so a refused serve changes nothing. Once all have
  loaded, the model is served (its route is complete) and its placement
  controller runs.
- **release**: the model stops taking new requests at once (``draining``); the
  generations already running on it finish (waited for up to ``drain_s``, then
  cancelled); then each of its nodes is told to unload (T3 to empty) and the
  model is forgotten. Its nodes are empty again, free for placement or a serve.
- **replace** A by B: B is served as above; then A drains as in a release,
  and A's name leads to B from now on (requests and sessions naming A run on
  B; a session's next turn re-prefills its conversation there, ``model_turns``).

Loads and unloads hold the tracker's ``heal_lock`` (one Configure at a time,
as failover heals and the placement controllers do). Everything runs on the
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from meshnet.errors import MeshnetError, RequestError
from meshnet.layer_range import LayerRange
from meshnet.model.info import ModelInfo, load_model_info
from meshnet.model.layer_bytes import LayerBytes, model_layer_bytes
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.configure import configure_span
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.placement import Placement, PlacementConfig
from meshnet.tracker.serving.served import ModelState, ServedModel, ServedModels, model_tracker
from meshnet.tracker.serving.served_store import ServedRow, ServedStore
from meshnet.tracker.serving.widening import Load

log = logging.getLogger(__name__)

MAX_DRAIN_S = 3600.0
_UNLOAD_TIMEOUT_S = 120.0
_CANCEL_WAIT_S = 10.0  # cancelled generations given this long to end before the unload


@dataclass(frozen=True)
class ServeRequest:
    """What to serve and where. ``node_path``: the file as the nodes see it ("": the
    same path as the tracker's). ``assignments`` empty: ``nodes`` empty nodes chosen."""

    path: str
    node_path: str = ""
    assignments: tuple[Load, ...] = ()
    nodes: int = 1


def empty_nodes(nodes: Sequence[NodeRecord]) -> list[NodeRecord]:
    """The up nodes holding no layers, in id order (the order a serve takes them in)."""
    return sorted(
        (n for n in nodes if n.state is NodeState.UP and n.layers is None),
        key=lambda n: n.node_id,
    )


def choose_assignments(nodes: Sequence[NodeRecord], sizes: LayerBytes, count: int) -> list[Load]:
    """``count`` empty nodes, the layers split among them by their bytes (``sizes``);
    ``RequestError`` when there are fewer empty nodes (or more nodes than layers)."""
    n_layers = sizes.n_layers
    if not 1 <= count <= n_layers:
        raise RequestError(f"nodes must be in [1, {n_layers}] (the model's layers), not {count}")
    free = empty_nodes(nodes)
    if len(free) < count:
        raise RequestError(f"{count} empty nodes are needed and {len(free)} are up")
    ranges = sizes.split(count)
    return [Load(n.node_id, r) for n, r in zip(free, ranges, strict=False)]


def check_assignments(
    assignments: Sequence[Load], nodes: Sequence[NodeRecord], n_layers: int
) -> None:
    """``RequestError`` unless every node is known, up and empty, none is named twice,
    and the ranges cover ``[0, n_layers)`` exactly once (a complete route)."""
    if not assignments:
        raise RequestError("name at least one node")
    ids = [a.node_id for a in assignments]
    if len(set(ids)) != len(ids):
        raise RequestError("a node is named twice")
    known = {n.node_id: n for n in nodes}
    spans: list[LayerRange] = []
    for a in assignments:
        node = known.get(a.node_id)
        if node is None:
            raise RequestError(f"no node {a.node_id!r} is registered")
        if node.state is not NodeState.UP:
            raise RequestError(f"node {a.node_id} is {node.state.value}")
        if node.layers is not None:
            raise RequestError(f"node {a.node_id} serves layers {node.layers}: it is not empty")
        if a.span is None:
            raise RequestError(f"node {a.node_id} is given no layers")
        spans.append(a.span)
    end = 0
    for span in sorted(spans):
        if span.start != end:
            raise RequestError(f"the ranges do not cover layer {end} exactly once")
        end = span.end
    if end != n_layers:
        raise RequestError(f"the ranges end at layer {end}, not at the model's {n_layers}")


class ModelAdmin:
    """Serves, replaces and releases the models of one tracker; runs their placement
    loops (``run_forever``, the app's lifespan task). Call from the event loop only."""

    def __init__(
        self,
        models: ServedModels,
        placement: PlacementConfig | None = None,
        record: ServedStore | None = None,
        load_info: Callable[[str], ModelInfo] = load_model_info,
    ) -> None:
        self.models = models
        self._load_info = load_info  # a path or a reference (model_source.info) to its info
        self.record = record  # where the served set is kept across restarts (None: nowhere)
        self._base: Tracker = models.first.tracker  # what every later model's tracker shares
        self._placement = placement or models.first.placement.config
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        """Run every served model's placement controller, and the renewal of the
        placement lease they act under (if any), until cancelled."""
        leader = self._base.leader
        lease = [asyncio.create_task(leader.run_forever())] if leader is not None else []
        for model in self.models:
            self._start(model)
        try:
            await asyncio.Event().wait()
        finally:
            tasks = [*self._loops.values(), *self._retiring, *lease]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, model: ServedModel) -> None:
        if model.name not in self._loops:
            self._loops[model.name] = asyncio.create_task(model.placement.run_forever())

    async def _stop(self, model: ServedModel) -> None:
        task = self._loops.pop(model.name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def restore(self) -> None:
        """Serve what the database recorded (``served_store``): each model served through
        the admin calls, then each replacement. Call once, before ``run_forever``; a
        recorded model whose file cannot be read is logged and left out."""
        if self.record is None:
            return
        rows = self.record.rows()
        for row in rows:
            if row.replaced_by is not None or self.models.holds(row.name):
                continue
            try:
                info = self._load_info(row.path)
                self.models.add(self.new_model(info, row.node_path))
            except (MeshnetError, OSError) as e:
                log.warning("model %s (%s) is not served again: %s", row.name, row.path, e)
                continue
            log.info("serving %s again, as recorded", row.name)
        for row in rows:
            if row.replaced_by is not None and self.models.restore_alias(row.name, row.replaced_by):
                log.info("%s leads to %s, as recorded", row.name, row.replaced_by)

    def new_model(self, info: ModelInfo, node_path: str) -> ServedModel:
        """A served model for ``info`` whose nodes load ``node_path``."""
        tracker = model_tracker(self._base, info, node_path)
        return ServedModel(info, tracker, Placement(tracker, self._placement), node_path)

    async def serve(self, request: ServeRequest) -> ServedModel:
        """Load the model onto its nodes and serve it; the typed reason and nothing
        changed when it cannot (a bad file, a name taken, nodes not empty, a refusal)."""
        info = await asyncio.to_thread(self._load_info, request.path)
        self.models.check_new(info)
        sizes = model_layer_bytes(info.file, info.spec)  # what the admin views report
        node_path = request.node_path or request.path
        async with self._base.heal_lock:
            nodes = self._base.store.nodes()
            plan = list(request.assignments) or choose_assignments(nodes, sizes, request.nodes)
            check_assignments(plan, nodes, sizes.n_layers)
            self.models.check_new(info)  # again: a serve may have finished meanwhile
            await self._load_all(plan, nodes, info, node_path)
            model = self.new_model(info, node_path)
            self.models.add(model)
            if self.record is not None:
                self.record.served(model.name, request.path, node_path)
        self._start(model)
        log.info("serving %s on %s", info.name, ", ".join(a.node_id for a in plan))
        return model

    async def _load_all(
        self, plan: Sequence[Load], nodes: Sequence[NodeRecord], info: ModelInfo, path: str
    ) -> None:
        by_id = {n.node_id: n for n in nodes}
        timeout = self._base.config.heal_timeout_s
        spans = [a.span for a in plan if a.span is not None]
        assert len(spans) == len(plan)  # check_assignments: a plan gives every node layers
        results = await asyncio.gather(
            *(
                configure_span(
                    self._base.channels, by_id[a.node_id], span, info.fingerprint, timeout, path
                )
                for a, span in zip(plan, spans, strict=True)
            )
        )
        failed = [
            f"node {a.node_id}: {r.failure}"
            for a, r in zip(plan, results, strict=True)
            if r.hop is None
        ]
        loaded = [by_id[a.node_id] for a, r in zip(plan, results, strict=True) if r.hop is not None]
        if failed:
            await asyncio.gather(*(self._unload(n) for n in loaded))
            raise RequestError(f"{info.name} was not served ({'; '.join(failed)}); nothing changed")
        for a in plan:
            self._base.store.set_layers(a.node_id, a.span, info.fingerprint)

    async def release(self, name: str, drain_s: float) -> ServedModel:
        """Stop routing new requests to ``name``; its generations finish (``drain_s`` at
        most, then they are cancelled), then its nodes are emptied and it is forgotten."""
        self._check_drain(drain_s)
        model = self.models.get(name)
        others = [m for m in self.models if m.state is ModelState.SERVING and m is not model]
        if model.state is ModelState.SERVING and not others:
            raise RequestError(f"{name!r} is the only model served: replace it instead")
        self.models.drain(name)
        if self.record is not None:
            self.record.released(name)
        self._retire_later(model, drain_s)
        return model

    async def replace(self, name: str, request: ServeRequest, drain_s: float) -> ServedModel:
        """Serve the model ``request`` names, then drain ``name`` as ``release`` does; its
        name leads to the new model from now on. The new model."""
        self._check_drain(drain_s)
        old = self.models.get(name)
        if old.state is not ModelState.SERVING:
            raise RequestError(f"model {name!r} is {old.state.value}: it cannot be replaced")
        new = await self.serve(request)
        if old.state is not ModelState.SERVING:  # released while the new one loaded
            return new
        self.models.drain(name, replaced_by=new.name)
        if self.record is not None:
            row = ServedRow(name, str(old.info.path), old.node_path, None)
            self.record.replaced(row, new.name)
        self._retire_later(old, drain_s)
        return new

    @staticmethod
    def _check_drain(drain_s: float) -> None:
        if not 0 <= drain_s <= MAX_DRAIN_S:
            raise RequestError(f"drain_s must be in [0, {MAX_DRAIN_S:.0f}], not {drain_s}")

    def _retire_later(self, model: ServedModel, drain_s: float) -> None:
        task = asyncio.create_task(self._retire(model, drain_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, model: ServedModel, drain_s: float) -> None:
        await self._stop(model)
        tracker = model.tracker
        await _until(lambda: not tracker.generations(), drain_s)
        for gen in tracker.generations():
            tracker.cancel(gen.id, f"model {model.name} was released")
        await _until(lambda: not tracker.generations(), _CANCEL_WAIT_S)
        async with self._base.heal_lock:
            ours = [
                n
                for n in self._base.store.nodes()
                if n.state is NodeState.UP and n.fingerprint == model.info.fingerprint
            ]
            await asyncio.gather(*(self._unload(n) for n in ours))
        self.models.forget(model.name)
        log.info("released %s: %d nodes emptied", model.name, len(ours))

    async def _unload(self, node: NodeRecord) -> bool:
        """Tell ``node`` to unload (T3 to empty); False (logged) when it did not."""
        request = pb.ConfigureRequest(load=pb.LoadShard())
        channels = self._base.channels
        try:
            reply = await channels.stub(node.address).Configure(
                request,
                timeout=_UNLOAD_TIMEOUT_S,
                metadata=channels.signed(node.node_id, "Configure"),
            )
        except grpc.aio.AioRpcError as e:
            log.warning("node %s did not unload: %s", node.node_id, e.code().name)
            return False
        if not reply.applied:
            log.warning("node %s did not unload: %s", node.node_id, reply.failure.message)
            return False
        return True


async def _until(done: Callable[[], bool], timeout_s: float) -> None:
    """Wait until ``done()`` is true or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def model_json(model: ServedModel, nodes: Sequence[NodeRecord]) -> dict[str, object]:
    """A served model as ``GET /admin/models`` shows it: its state, whether a route is
    complete, the layers no up node serves, its tensor bytes, and its nodes with their
    layers and the bytes those hold (from the header the tracker read: no weights)."""
    ours = [n for n in nodes if n.fingerprint == model.info.fingerprint and n.layers is not None]
    sizes = model_layer_bytes(model.info.file, model.info.spec)
    covered = [0] * model.info.spec.n_layers
    for n in ours:
        if n.routable:
            for i in n.layers or ():
                if i < len(covered):
                    covered[i] += 1
    return {
        "name": model.name,
        "fingerprint": model.info.fingerprint,
        "state": model.state.value,
        "replaced_by": model.replaced_by,
        "n_layers": model.info.spec.n_layers,
        "bytes": sizes.total,
        "node_path": model.node_path or None,
        "complete": model.complete(),
        "uncovered_layers": [i for i, c in enumerate(covered) if c == 0],
        "nodes": [
            {
                "node_id": n.node_id,
                "layers": [n.layers.start, n.layers.end] if n.layers else None,
                "bytes": _range_bytes(sizes, n.layers),
                "state": n.state.value,
            }
            for n in sorted(ours, key=lambda n: (n.layers, n.node_id))
        ],
        "generations": len(model.tracker.generations()),
    }


def _range_bytes(sizes: LayerBytes, layers: LayerRange | None) -> int | None:
    """The bytes a node serving ``layers`` holds; None for no layers or a range the model
    does not have (a record from before a file changed)."""
    if layers is None or layers.end > sizes.n_layers:
        return None
    return sizes.range_bytes(layers)
