"""Admin endpoints: the node registry, pinned routes, health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from meshnet.api.openai import route_json
from meshnet.api.schemas import PinRouteRequest
from meshnet.api.state import tracker_of
from meshnet.errors import MeshnetError
from meshnet.tracker.registry import NodeState

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
