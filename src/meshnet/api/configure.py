"""``POST /admin/nodes/{node_id}/configure``: one tier of a node's live configuration.

The body names exactly one tier (docs/design.md §11, node/configure.py):

- ``t1`` — limits, applied at once: ``max_streams``, ``max_queued_steps``, ``log_level``;
- ``t2`` — batching, applied at the node's next step boundary with no prompt half-run:
  ``max_batch_tokens``, ``prefill_chunk``, ``kv_budget_bytes``;
- ``t3`` — the shard (``model_path``, ``layer_start``, ``layer_end``): the node drains,
  swaps and drops its sessions' KV (the same model and layers again park it on the
  node instead). With ``handoff: "snapshot"`` (the default) the tracker first checks
  that the node can load it, then, unless the node keeps the KV, evicts every idle or
  parked session whose route holds the node to the snapshot store, so their next turn
  resumes from the snapshot on any node serving those layers (re-prefilled where none
  does; the same tokens either way). ``handoff: "none"`` lets those turns re-prefill.
  No ``model_path`` and layers ``[0, 0)`` unload: the node becomes empty.

The tracker calls the node's ``Configure``, signed as every tracker call is, and
answers what the node now runs with, or the node's typed reason (the error's ``code``)
when nothing was applied. ``check_only`` asks the node to check and change nothing.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import grpc
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshnet.api.auth import require_admin
from meshnet.api.state import sessions_of, tracker_of, tracker_serving
from meshnet.errors import MeshnetError, NodeFailure, NotFound, RequestError, error_for_kind
from meshnet.layer_range import LayerRange
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.service import Tracker
from meshnet.tracker.session_data.records import SessionState
from meshnet.tracker.sessions.sessions import Sessions

log = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(require_admin)])

_TIMEOUT_S = {"t1": 30.0, "t2": 90.0, "t3": 600.0}  # T2/T3 wait for a drain; T3 loads
U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]  # the node checks the exact bounds
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsIn(_Body):
    """Tier 1; a field left out keeps the node's value."""

    max_streams: U32 | None = None
    max_queued_steps: U32 | None = None
    log_level: LogLevel | None = None


class BatchingIn(_Body):
    """Tier 2; a field left out keeps the node's value."""

    max_batch_tokens: U32 | None = None
    prefill_chunk: U32 | None = None
    kv_budget_bytes: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None  # 0: unlimited


class ShardIn(_Body):
    """Tier 3: layers ``[layer_start, layer_end)`` of a model file in the node's model
    dirs (left out: the model it started with)."""

    model_path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    layer_start: U32
    layer_end: U32
    handoff: Literal["snapshot", "none"] = "snapshot"


class ConfigureBody(_Body):
    t1: LimitsIn | None = None
    t2: BatchingIn | None = None
    t3: ShardIn | None = None
    check_only: bool = False

    @model_validator(mode="after")
    def _one_tier(self) -> ConfigureBody:
        if sum(t is not None for t in (self.t1, self.t2, self.t3)) != 1:
            raise ValueError("name exactly one tier: t1, t2 or t3")
        return self

    def request(self, check_only: bool | None = None) -> pb.ConfigureRequest:
        """The node's ``ConfigureRequest`` for this body."""
        check = self.check_only if check_only is None else check_only
        if self.t1 is not None:
            return pb.ConfigureRequest(limits=pb.Limits(**_set(self.t1)), check_only=check)
        if self.t2 is not None:
            return pb.ConfigureRequest(batching=pb.Batching(**_set(self.t2)), check_only=check)
        assert self.t3 is not None  # _one_tier
        load = pb.LoadShard(
            model_path=self.t3.model_path or "",
            layer_start=self.t3.layer_start,
            layer_end=self.t3.layer_end,
        )
        return pb.ConfigureRequest(load=load, check_only=check)

    @property
    def tier(self) -> str:
        return "t1" if self.t1 else "t2" if self.t2 else "t3"


@router.post("/admin/nodes/{node_id}/configure")
async def configure_node(node_id: str, body: ConfigureBody, request: Request) -> dict[str, Any]:
    tracker = tracker_of(request)
    node = _node(tracker, node_id)
    handed: list[str] = []
    failures: list[dict[str, str]] = []
    if body.t3 is not None and body.t3.handoff == "snapshot" and not body.check_only:
        checked = await _call(tracker, node, body.request(check_only=True), body.tier)
        if not checked.keeps_kv:  # a reload of the shard served parks the KV on the node
            handed, failures = await _hand_off(sessions_of(request), node_id)
    reply = await _call(tracker, node, body.request(), body.tier)
    if reply.applied and body.t3 is not None and reply.fingerprint:  # not an unload
        layers = LayerRange(reply.layer_start, reply.layer_end)
        tracker.store.set_layers(node.node_id, layers, reply.fingerprint)
        serving = tracker_serving(request, reply.fingerprint)
        if serving.verification is not None:  # routed on its new layers once it calibrated
            serving.verification.reconsider(node.node_id)
    return _result(node_id, body, reply, handed, failures)


def _node(tracker: Tracker, node_id: str) -> NodeRecord:
    node = tracker.store.node(node_id)
    if node is None:
        raise NotFound(f"no node {node_id!r} is registered")
    if node.state is not NodeState.UP:
        raise RequestError(f"node {node_id} is {node.state.value}: it cannot be configured")
    return node


async def _call(
    tracker: Tracker, node: NodeRecord, message: pb.ConfigureRequest, tier: str
) -> pb.ConfigureResponse:
    """The node's answer; its typed failure raised when it applied (or checked) nothing."""
    try:
        reply: pb.ConfigureResponse = await tracker.channels.stub(node.address).Configure(
            message,
            timeout=_TIMEOUT_S[tier],
            metadata=tracker.channels.signed(node.node_id, "Configure"),
        )
    except grpc.aio.AioRpcError as e:
        raise NodeFailure(
            f"node {node.node_id} did not answer Configure: {e.code().name} {e.details()}",
            node.node_id,
        ) from None
    if reply.HasField("failure"):
        f = reply.failure
        log.info("node %s refused a %s configure: %s: %s", node.node_id, tier, f.kind, f.message)
        raise error_for_kind(f.kind, f"node {node.node_id}: {f.message}")
    return reply


async def _hand_off(sessions: Sessions, node_id: str) -> tuple[list[str], list[dict[str, str]]]:
    """Evict every idle or parked session whose route holds the node to the snapshot
    store; the sessions evicted, and those that could not be (with why: they re-prefill)."""
    handed: list[str] = []
    failures: list[dict[str, str]] = []
    for s in sessions.store.sessions((SessionState.IDLE, SessionState.PARKED)):
        if not any(hop.node_id == node_id for hop in s.route):
            continue
        try:
            await sessions.evict(s.id)
        except MeshnetError as e:
            log.warning("session %s could not be handed off from %s: %s", s.id, node_id, e)
            failures.append({"session_id": s.id, "kind": e.kind, "message": e.message})
            continue
        handed.append(s.id)
    return handed, failures


def _result(
    node_id: str,
    body: ConfigureBody,
    reply: pb.ConfigureResponse,
    handed: list[str],
    failures: list[dict[str, str]],
) -> dict[str, Any]:
    s = reply.settings
    return {
        "node_id": node_id,
        "tier": body.tier,
        "applied": reply.applied,
        "check_only": body.check_only,
        "detail": reply.detail,
        "layers": [reply.layer_start, reply.layer_end] if reply.fingerprint else None,
        "fingerprint": reply.fingerprint or None,
        "sessions_ended": reply.sessions_ended,
        "keeps_kv": reply.keeps_kv,
        "handed_off": handed,
        "handoff_failures": failures,
        "settings": {
            "max_streams": s.max_streams,
            "max_queued_steps": s.max_queued_steps,
            "log_level": s.log_level,
            "max_batch_tokens": s.max_batch_tokens,
            "prefill_chunk": s.prefill_chunk,
            "kv_budget_bytes": s.kv_budget_bytes,
        },
    }


def _set(model: BaseModel) -> dict[str, Any]:
    """The fields a body set (what a node leaves unchanged is what it was not sent)."""
    return model.model_dump(exclude_none=True)
