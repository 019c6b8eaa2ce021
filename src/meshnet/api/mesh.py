"""The control plane nodes talk to: registration and heartbeats."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request

from meshnet.mesh_messages import MAX_ID, Heartbeat, HeartbeatReply, NodeAnnouncement
from meshnet.tracker.service import Tracker

router = APIRouter()


def _tracker(request: Request) -> Tracker:
    return request.app.state.tracker  # type: ignore[no-any-return]


@router.post("/mesh/nodes")
async def register(body: NodeAnnouncement, request: Request) -> dict[str, Any]:
    _tracker(request).store.register(body, time.time())
    return {"registered": body.node_id}


@router.post("/mesh/nodes/{node_id}/heartbeat")
async def heartbeat(
    body: Heartbeat, request: Request, node_id: str = Path(max_length=MAX_ID)
) -> dict[str, Any]:
    known = _tracker(request).store.heartbeat(node_id, body, time.time())
    return HeartbeatReply(known=known).model_dump()
