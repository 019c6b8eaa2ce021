"""Node records as the registry holds them, for unit tests of what reads them
(placement, served models, metrics)."""

from __future__ import annotations

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeLoad
from meshnet.tracker.nodes.registry import NodeRecord, NodeState

FP = "f" * 64


def node_record(
    node_id: str,
    layers: str | None = None,
    *,
    up: bool = True,
    fingerprint: str | None = None,
    address: str | None = None,
) -> NodeRecord:
    """An idle node on ``numpy``: serving ``layers`` ("start:end") of the model ``FP``
    (or ``fingerprint``), or empty; up or down."""
    return NodeRecord(
        node_id=node_id,
        address=address or f"{node_id}:1",
        fingerprint=fingerprint if fingerprint is not None else FP if layers else "",
        layers=LayerRange.parse(layers) if layers else None,
        backend="numpy",
        kv_budget_bytes=0,
        pid=1,
        state=NodeState.UP if up else NodeState.DOWN,
        last_seen=0.0,
        load=NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0),
    )
