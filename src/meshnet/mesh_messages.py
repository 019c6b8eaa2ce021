"""Control-plane messages between nodes and the tracker (JSON over HTTP).

Frozen pydantic models with ``extra="forbid"``: what a node says about itself
is parsed into these at the tracker's edge and nothing else travels inward. A node
writes them as the typed dicts of ``mesh_reports`` (it never imports pydantic).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from meshnet.mesh_reports import MAX_HELD as MAX_HELD  # the limits both sides share
from meshnet.mesh_reports import MAX_ID as MAX_ID
from meshnet.mesh_reports import NODE_ID


class Frozen(BaseModel):
    # Infinity or NaN in a node's report would be stored and break every later read.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class NodeLoad(Frozen):
    """What a node reports with every heartbeat."""

    sessions: int = Field(ge=0)
    kv_bytes: int = Field(ge=0)
    queue_depth: int = Field(ge=0)
    steps: int = Field(ge=0)
    kv_peak_bytes: int = Field(default=0, ge=0)
    last_batch: int = Field(default=0, ge=0)  # sessions in the node's last forward
    max_batch: int = Field(default=0, ge=0)  # most sessions in one forward so far
    tokens_per_s: float = Field(default=0.0, ge=0.0)
    max_streams: int = Field(default=0, ge=0)  # Forward streams it can hold; 0: not said
    relayed: int = Field(default=0, ge=0)  # steps whose input came from the previous hop
    context: int = Field(default=0, ge=0)  # positions a sequence may reach there; 0: not said
    # Memory available to the node now (MemAvailable, within its cgroup's limit): what
    # placement may widen it by (tracker/serving/widening.py); 0: not said, never widened.
    free_memory_bytes: int = Field(default=0, ge=0)


class HeldShard(Frozen):
    """A layer range of a model a node holds on disk, whole and checked
    (``model_source.shard_store``): what peers may fetch from it, and what placement
    may load there without a fetch."""

    fingerprint: str = Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)
    bytes: int = Field(ge=0)  # on disk


class FetchProgress(Frozen):
    """A fetch of a range of a model by reference under way on a node."""

    ref: str = Field(min_length=1, max_length=2048)  # as the node was told it
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)
    done_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    bytes_per_s: float = Field(ge=0.0)


class Holdings(Frozen):
    """Where a node serves shards to peers, which it holds, and what it is fetching."""

    bulk_address: str | None = Field(default=None, max_length=256)  # host:port
    shards: list[HeldShard] = Field(default_factory=list, max_length=MAX_HELD)
    fetching: FetchProgress | None = None


class NodeAnnouncement(Frozen):
    """A node registering (or re-registering) with the tracker."""

    node_id: str = Field(min_length=1, max_length=MAX_ID, pattern=f"^{NODE_ID.pattern}$")
    address: str = Field(min_length=3, max_length=256)  # host:port of its gRPC server
    fingerprint: str = Field(max_length=64)  # "" when empty
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=0)  # 0 with layer_start 0 when empty
    backend: str = Field(max_length=32)
    kv_budget_bytes: int = Field(ge=0)
    pid: int = Field(ge=0)
    load: NodeLoad
    metrics_port: int | None = Field(default=None, ge=1, le=65535)  # its /metrics, if served
    holdings: Holdings = Field(default_factory=Holdings)


class Heartbeat(Frozen):
    load: NodeLoad
    fingerprint: str = Field(max_length=64)
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=0)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)  # its /metrics, if served
    holdings: Holdings = Field(default_factory=Holdings)


class HeartbeatReply(Frozen):
    known: bool  # False: the tracker lost us (restart); register again
