"""``/healthz``: whether the tracker serves and a route of its first model is complete, and
the models it serves (no credential needed; it says nothing about who uses the mesh)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from meshnet.api.state import models_of, tracker_of
from meshnet.errors import MeshnetError
from meshnet.tracker.nodes.registry import NodeState
from meshnet.tracker.nodes.routes import route_json

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    tracker = tracker_of(request)
    try:
        route_json(tracker.planner.route())
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
        # Every model served (the first is "model"): what a node's doctor compares with.
        "models": [{"name": m.name, "fingerprint": m.info.fingerprint} for m in models_of(request)],
    }
