"""Admin endpoints: the node registry, pinned routes, generations, the ledger, health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request

from meshnet.api.schemas import PinRouteRequest
from meshnet.api.state import tracker_of
from meshnet.errors import MeshnetError, NotFound
from meshnet.tracker.registry import NodeState
from meshnet.tracker.routes import route_json

router = APIRouter()


@router.get("/admin/nodes")
async def list_nodes(request: Request) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "node_id": n.node_id,
                "address": n.address,
                "layers": [n.layers.start, n.layers.end] if n.layers else None,
                "state": n.state.value,
                "down_reason": n.down_reason or None,
                "pid": n.pid,
                "backend": n.backend,
                "fingerprint": n.fingerprint,
                "last_seen": n.last_seen,
                "load": n.load.model_dump(),
            }
            for n in tracker_of(request).store.nodes()
        ]
    }


@router.get("/admin/routes")
async def current_route(request: Request) -> dict[str, Any]:
    tracker = tracker_of(request)
    pinned = tracker.store.pinned()
    try:
        route: list[dict[str, Any]] | None = route_json(tracker.route())
        reason = None
    except MeshnetError as e:
        route, reason = None, e.message
    return {"pinned": pinned, "route": route, "reason": reason}


@router.post("/admin/routes")
async def pin_route(body: PinRouteRequest, request: Request) -> dict[str, Any]:
    route = tracker_of(request).pin(body.node_ids)
    return {"pinned": body.node_ids, "route": route_json(route)}


@router.delete("/admin/routes")
async def unpin_route(request: Request) -> dict[str, Any]:
    tracker_of(request).store.unpin()
    return {"pinned": None}


@router.get("/admin/generations")
async def list_generations(request: Request) -> dict[str, Any]:
    return {
        "generations": [
            {
                "id": g.id,
                "epoch": g.epoch,
                "route": route_json(g.route),
                "recoveries": len(g.recoveries),
            }
            for g in tracker_of(request).generations()
        ]
    }


@router.post("/admin/generations/{generation_id}/cancel")
async def cancel_generation(generation_id: str, request: Request) -> dict[str, Any]:
    """Stop a running generation; every shard of its route frees its KV and queued steps."""
    if not tracker_of(request).cancel(generation_id, "cancelled by an admin"):
        raise NotFound(f"no running generation {generation_id}")
    return {"id": generation_id, "cancelled": True}


@router.get("/admin/ledger")
async def ledger(
    request: Request,
    generation_id: str | None = None,
    node_id: str | None = None,
    limit: int = Query(1000, ge=1, le=100_000),
) -> dict[str, Any]:
    """Attempts per shard, oldest first, and per-node totals (only completed work bills)."""
    store = tracker_of(request).store
    records = store.ledger(generation_id, node_id, limit)
    return {
        "records": [{**asdict(r), "tokens": r.tokens, "billable": r.billable} for r in records],
        "totals": store.ledger_totals(generation_id),
    }


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    tracker = tracker_of(request)
    try:
        route_json(tracker.route())
        complete, reason = True, None
    except MeshnetError as e:
        complete, reason = False, e.message
    nodes = tracker.store.nodes()
    return {
        "status": "ok",
        "model": tracker.model.name,
        "route_complete": complete,
        "reason": reason,
        "nodes_up": sum(n.state is NodeState.UP for n in nodes),
        "nodes_routable": sum(n.routable for n in nodes),
    }
