"""A node's reports (``mesh_reports``, typed dicts) are what the tracker's models
(``mesh_messages``, pydantic) take: the same keys, and every report a node builds parses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import (
    FetchProgress,
    Heartbeat,
    HeartbeatReply,
    HeldShard,
    Holdings,
    NodeAnnouncement,
    NodeLoad,
)
from meshnet.mesh_reports import (
    AnnouncementReport,
    FetchReport,
    HeartbeatReport,
    HeldShardReport,
    HoldingsReport,
    LoadReport,
    check_node_id,
    heartbeat_known,
    no_holdings,
)
from meshnet.node.announce import _heartbeat
from meshnet.node.engine_types import EngineStats

FP = "ab" * 32

PAIRS: list[tuple[Any, type[BaseModel]]] = [
    (LoadReport, NodeLoad),
    (HeldShardReport, HeldShard),
    (FetchReport, FetchProgress),
    (HoldingsReport, Holdings),
    (HeartbeatReport, Heartbeat),
    (AnnouncementReport, NodeAnnouncement),
]


@pytest.mark.parametrize(("report", "model"), PAIRS, ids=[m.__name__ for _, m in PAIRS])
def test_a_report_has_its_models_fields(report: Any, model: type[BaseModel]) -> None:
    assert set(report.__annotations__) == set(model.model_fields)


def _stats(layers: LayerRange | None) -> EngineStats:
    return EngineStats(
        loaded=layers is not None,
        layers=layers,
        fingerprint=FP if layers else "",
        sessions=2,
        parked=1,
        kv_bytes=4096,
        kv_peak_bytes=8192,
        kv_budget_bytes=1 << 20,
        queue_depth=3,
        steps=17,
        last_batch=2,
        max_batch=4,
        tokens_per_s=12.345,
        max_streams=64,
        relayed=9,
        context=4096,
    )


def _holdings() -> HoldingsReport:
    shard: HeldShardReport = {"fingerprint": FP, "layer_start": 0, "layer_end": 4, "bytes": 9}
    fetching: FetchReport = {
        "ref": "hf:org/model",
        "layer_start": 4,
        "layer_end": 8,
        "done_bytes": 10,
        "total_bytes": 100,
        "bytes_per_s": 2.5,
    }
    return {"bulk_address": "127.0.0.1:9000", "shards": [shard], "fetching": fetching}


@pytest.mark.parametrize("layers", [LayerRange(0, 4), None], ids=["serving", "empty"])
def test_the_heartbeat_and_announcement_a_node_builds_parse_as_the_tracker_takes_them(
    layers: LayerRange | None,
) -> None:
    for holdings in (_holdings(), no_holdings()):
        beat = _heartbeat(_stats(layers), 9100, holdings, free_memory=1 << 30)
        parsed = Heartbeat.model_validate(beat)
        assert parsed.model_dump(exclude_none=True) == {
            k: v for k, v in beat.items() if v is not None
        } | {"holdings": Holdings.model_validate(holdings).model_dump(exclude_none=True)}
        announcement: AnnouncementReport = {
            "node_id": "node-1",
            "address": "127.0.0.1:50051",
            "backend": "q8",
            "kv_budget_bytes": 1 << 20,
            "pid": 1234,
            **beat,
        }
        NodeAnnouncement.model_validate(announcement)


def test_the_trackers_reply_is_read_strictly() -> None:
    assert heartbeat_known(HeartbeatReply(known=True).model_dump()) is True
    assert heartbeat_known(HeartbeatReply(known=False).model_dump()) is False
    for bad in ({"known": "yes"}, {"known": True, "more": 1}, [], None):
        with pytest.raises(ValueError, match="not a heartbeat reply"):
            heartbeat_known(bad)


def test_node_ids_are_checked_as_the_announcement_checks_them() -> None:
    assert check_node_id("node-a.1_b") == "node-a.1_b"
    for bad in ("", "x" * 129, "node 1", "nödé"):
        with pytest.raises(ValueError, match="not a node id"):
            check_node_id(bad)
