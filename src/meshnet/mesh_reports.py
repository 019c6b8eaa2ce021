"""What a node sends the tracker about itself, as the JSON it posts: typed, pydantic-free.

The tracker parses these bodies into the frozen pydantic models of
``mesh_messages`` at its edge, where a report is checked. A node only writes them,
so it builds them as typed dicts and never imports pydantic: its validators and the
schemas built for every model kept ~9 MB resident in every node. The keys are those
models' fields (``tests/unit/test_mesh_reports.py`` holds the two together), and the
limits both sides share are here.
"""

from __future__ import annotations

import re
from typing import NotRequired, TypedDict

MAX_ID = 128  # characters of a node id
MAX_HELD = 64  # shards one node reports holding
NODE_ID = re.compile(r"[A-Za-z0-9._-]+")  # what a node may call itself


def check_node_id(text: str) -> str:
    """``text`` when it is a node id (1 to ``MAX_ID`` of letters, digits, '.', '_', '-');
    ``ValueError`` saying so otherwise."""
    if not (0 < len(text) <= MAX_ID and NODE_ID.fullmatch(text)):
        raise ValueError(
            f"not a node id: {text!r} (1 to {MAX_ID} of letters, digits, '.', '_', '-')"
        )
    return text


class LoadReport(TypedDict):
    """``mesh_messages.NodeLoad``: what a node reports with every heartbeat."""

    sessions: int
    kv_bytes: int
    queue_depth: int
    steps: int
    kv_peak_bytes: int
    last_batch: int
    max_batch: int
    tokens_per_s: float
    max_streams: int
    relayed: int
    context: int
    free_memory_bytes: int


class HeldShardReport(TypedDict):
    """``mesh_messages.HeldShard``: a whole shard in the node's cache."""

    fingerprint: str
    layer_start: int
    layer_end: int
    bytes: int


class FetchReport(TypedDict):
    """``mesh_messages.FetchProgress``: a fetch by reference under way."""

    ref: str
    layer_start: int
    layer_end: int
    done_bytes: int
    total_bytes: int
    bytes_per_s: float


class HoldingsReport(TypedDict):
    """``mesh_messages.Holdings``: the bulk port, the shards held, the fetch under way."""

    bulk_address: str | None
    shards: list[HeldShardReport]
    fetching: NotRequired[FetchReport]


class HeartbeatReport(TypedDict):
    """``mesh_messages.Heartbeat``; registering adds ``AnnouncementReport``'s keys."""

    load: LoadReport
    fingerprint: str
    layer_start: int
    layer_end: int
    metrics_port: int | None
    holdings: HoldingsReport


class AnnouncementReport(HeartbeatReport):
    """``mesh_messages.NodeAnnouncement``: a node registering with the tracker."""

    node_id: str
    address: str
    backend: str
    kv_budget_bytes: int
    pid: int


def no_holdings() -> HoldingsReport:
    """Holdings of a node that serves no shards to peers and fetches nothing."""
    return {"bulk_address": None, "shards": []}


def heartbeat_known(reply: object) -> bool:
    """The ``known`` of the tracker's ``HeartbeatReply`` body; ``ValueError`` for a body
    that is not one (the announcer treats it as a tracker it cannot talk to)."""
    if not isinstance(reply, dict) or set(reply) != {"known"}:
        raise ValueError(f"not a heartbeat reply: {reply!r:.200}")
    known = reply["known"]
    if not isinstance(known, bool):
        raise ValueError(f"not a heartbeat reply: {reply!r:.200}")
    return known
