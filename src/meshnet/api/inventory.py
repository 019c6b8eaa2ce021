"""``GET /admin/inventory``: the shards of referenced models each node holds on disk.

What the nodes' heartbeats last said (``tracker/nodes/inventory.py``): each node's bulk
address (where peers read its shards) and its shards, with the served model's name
where a served model has that fingerprint.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from meshnet.api.auth import require_admin
from meshnet.api.state import models_of, tracker_of
from meshnet.tracker.nodes.inventory import Inventory

admin = APIRouter(dependencies=[Depends(require_admin)])


def inventory_of(request: Request) -> Inventory:
    """The tracker's inventory (every served model's tracker shares it)."""
    return tracker_of(request).inventory


@admin.get("/admin/inventory")
async def inventory(request: Request) -> dict[str, Any]:
    names = {m.info.fingerprint: m.name for m in models_of(request)}
    nodes = [
        {
            "node_id": node_id,
            "bulk_address": held.bulk_address,
            "fetching": held.fetching.model_dump() if held.fetching else None,
            "shards": [
                {
                    "fingerprint": s.fingerprint,
                    "model": names.get(s.fingerprint),
                    "layers": [s.layer_start, s.layer_end],
                    "bytes": s.bytes,
                }
                for s in held.shards
            ],
        }
        for node_id, held in sorted(inventory_of(request).nodes().items())
    ]
    return {"nodes": nodes}
