"""What the tracker knows about a node, and the liveness rule.

Node states: ``up`` (heartbeating; routable when it has layers), ``down``
(missed heartbeats, or failed a call; never routed), and with verification on
``calibrating`` and ``quarantined`` (heartbeating, never routed). A node that
registers again comes back ``up`` (or ``calibrating``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeLoad

NodeId = str


class NodeState(StrEnum):
    UP = "up"  # heartbeating
    DOWN = "down"  # missed heartbeats or failed a call; not routed until it registers again
    # Verification on (tracker/trust/calibration.py): a node with layers runs a calibration
    # input before it is routed; a node that failed one, or failed a verifier's check,
    # is quarantined (``down_reason`` says why) until it serves another range or model,
    # or an operator readmits it (it calibrates again).
    CALIBRATING = "calibrating"
    QUARANTINED = "quarantined"


@dataclass(frozen=True)
class NodeRecord:
    node_id: NodeId
    address: str  # host:port of its gRPC server
    fingerprint: str  # "" while empty
    layers: LayerRange | None  # None while empty
    backend: str
    kv_budget_bytes: int
    pid: int
    state: NodeState
    last_seen: float  # tracker's wall clock at the last register or heartbeat
    load: NodeLoad
    down_reason: str = ""

    @property
    def routable(self) -> bool:
        return self.state is NodeState.UP and self.layers is not None


def is_stale(record: NodeRecord, now: float, timeout_s: float) -> bool:
    """True when an up node has not been heard from for ``timeout_s``."""
    return record.state is NodeState.UP and now - record.last_seen > timeout_s


def node_json(n: NodeRecord) -> dict[str, Any]:
    """A node's registry record as the admin API shows it."""
    return {
        "node_id": n.node_id,
        "address": n.address,
        "layers": [n.layers.start, n.layers.end] if n.layers else None,
        "state": n.state.value,
        "down_reason": n.down_reason or None,
        "pid": n.pid,
        "backend": n.backend,
        "fingerprint": n.fingerprint,
        "kv_budget_bytes": n.kv_budget_bytes,
        "last_seen": n.last_seen,
        "load": n.load.model_dump(),
    }
