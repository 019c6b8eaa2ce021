"""Failover on the tiny model with real processes: kills, healing, freezes, identical output."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import MeshFactory, SoloIds
from faults import assert_billed_once, raw_forward, wait_ledger, wait_until_up
from streams import Streamed, serving, stream_completion
from tiny_requests import PROMPT, long_completion

from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import sha256_file
from meshnet.protocol import meshnet_pb2 as pb

# Long enough that a kill after token 60 lands mid-stream: seed 3 samples 300 tokens
# without an eos on the long tiny model.
BODY = long_completion(seed=3, max_tokens=300)


@pytest.fixture(scope="module")
def expected(long_tiny: Path, solo_ids: SoloIds) -> list[int]:
    """What the request gives in-process: every faulted stream must end with it."""
    ids = solo_ids(long_tiny, BODY)
    assert len(ids) == BODY["max_tokens"]  # every kill point below lands mid-stream
    return ids


def _positions(ids: list[int]) -> int:
    """KV positions a finished generation filled: the prompt and all but the last token."""
    return len(PROMPT) + len(ids) - 1


def test_killing_a_replicated_node_mid_stream_gives_identical_output_20_times(
    mesh_factory: MeshFactory, long_tiny: Path, expected: list[int]
) -> None:
    # The kills are seen by the broken stream, not by heartbeats; on 2 busy cores the
    # restart of the last round's node (load, warm-up) can hold the replica's heartbeats
    # past the usual 2 s, and a replica marked down leaves nothing to fail over to.
    mesh = mesh_factory("0:2,2:4,2:4", model=long_tiny, heartbeat_timeout_s=8.0)
    rng = random.Random(20261203)
    for rep in range(20):
        # A replica must be live before its twin is killed.
        for node_id in mesh.nodes:
            wait_until_up(mesh, node_id)
        kill_at = rng.randint(1, 60)
        killed: list[str] = []

        def kill(n: int, s: Streamed, kill_at: int = kill_at, killed: list[str] = killed) -> None:
            if n == kill_at:
                killed.append(serving(s, (2, 4)))
                mesh.kill_node(killed[0])

        result = stream_completion(mesh, BODY, kill)
        assert result.error is None, (rep, kill_at, result.error)
        assert result.ids == expected, f"repetition {rep}: kill after token {kill_at}"
        assert result.final is not None and result.final["ids"] == expected
        (recovery,) = result.final["recoveries"]
        assert recovery["failed_node"] == killed[0]
        assert recovery["kind"] == "worker-death"
        assert recovery["method"] == "replay"  # only the failed span was recomputed
        assert recovery["replacement"] != [killed[0]]
        records = wait_ledger(mesh, result.generation_id, hops=2)
        assert_billed_once(records, 4, _positions(expected))
        failed = [r for r in records if r["status"] == "failed"]
        assert [(r["node_id"], r["kind"]) for r in failed] == [(killed[0], "worker-death")]
        mesh.start_node(killed[0], LayerRange(2, 4))  # back as a replica for the next round
        wait_until_up(mesh, killed[0])


def test_with_no_replica_an_empty_node_is_healed_into_the_route(
    mesh_factory: MeshFactory, long_tiny: Path, expected: list[int]
) -> None:
    mesh = mesh_factory("0:2,2:4,empty", model=long_tiny)

    def kill(n: int, s: Streamed) -> None:
        if n == 10:
            mesh.kill_node("node-1")

    result = stream_completion(mesh, BODY, kill)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    assert (recovery["kind"], recovery["healed"], recovery["method"]) == (
        "worker-death",
        "node-2",
        "replay",
    )
    assert [h["node_id"] for h in result.final["route"]] == ["node-0", "node-2"]
    assert_billed_once(wait_ledger(mesh, result.generation_id, hops=2), 4, _positions(expected))
    # The healed node stays in the mesh: the next request routes through it.
    again = httpx.post(
        f"{mesh.url}/v1/completions", json=BODY, headers=mesh.api_headers, timeout=60
    ).json()
    assert again["meshnet"]["ids"] == expected
    assert [h["node_id"] for h in again["meshnet"]["route"]] == ["node-0", "node-2"]


def test_a_frozen_node_is_failed_by_its_deadline_and_its_late_steps_are_stale(
    mesh_factory: MeshFactory, long_tiny: Path, expected: list[int]
) -> None:
    mesh = mesh_factory(
        "0:2,2:4,2:4",
        model=long_tiny,
        tracker_args=["--step-timeout", "1.0"],
        heartbeat_timeout_s=30.0,  # the step deadline, not the heartbeats, must catch it
    )
    # A whole run first, unfaulted: the hops are linked and warm before the 1 s deadline
    # is what the freeze is measured against.
    first = httpx.post(
        f"{mesh.url}/v1/completions", json=BODY, headers=mesh.api_headers, timeout=60
    )
    assert first.status_code == 200, first.text
    assert first.json()["meshnet"]["ids"] == expected
    frozen: list[str] = []

    def freeze(n: int, s: Streamed) -> None:
        if n == 10:
            frozen.append(serving(s, (2, 4)))
            mesh.kill_node(frozen[0], signal.SIGSTOP)

    result = stream_completion(mesh, BODY, freeze)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    # The step deadline failed it, not the (30 s) heartbeat timeout: no wall clock asked.
    assert (recovery["failed_node"], recovery["kind"]) == (frozen[0], "deadline-exceeded")

    mesh.kill_node(frozen[0], signal.SIGCONT)
    # The fence sent at failover reaches it when it wakes: the old epoch is refused.
    fingerprint = sha256_file(long_tiny)
    old = pb.Open(
        session_id=result.generation_id,
        epoch=1,
        fingerprint=fingerprint,
        layer_start=2,
        layer_end=4,
    )
    deadline = time.monotonic() + 10
    while True:
        replies = raw_forward(mesh, frozen[0], old, [])
        if replies[0].WhichOneof("kind") == "failure" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert replies[0].failure.kind == "stale-epoch"
    records = wait_ledger(mesh, result.generation_id, hops=2)
    mine = [(r["epoch"], r["status"], r["kind"]) for r in records if r["node_id"] == frozen[0]]
    assert mine == [(1, "failed", "deadline-exceeded")]
    assert_billed_once(records, 4, _positions(expected))
