"""Churn is waited out, not turned into errors (tiny model, real processes): a generation
whose failed range no node serves waits for one and replays exactly; a request that finds
no complete route waits for one before its 503."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory, SoloIds
from faults import wait_until_up
from streams import Streamed, stream_completion
from tiny_requests import long_completion

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh

BODY = long_completion(seed=3)
WAITS = ["--route-wait", "60"]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, long_tiny: Path) -> LocalMesh:
    """No replica, no empty node, and no memory offered for more layers (no survivor is
    widened): a dead node's range is served again only when it comes back."""
    return mesh_factory("0:2,2:4", model=long_tiny, tracker_args=WAITS, node_args=NO_ROOM)


@pytest.fixture(scope="module")
def expected(long_tiny: Path, solo_ids: SoloIds) -> list[int]:
    return solo_ids(long_tiny, BODY)


def _complete(mesh: LocalMesh, body: dict[str, Any] = BODY) -> httpx.Response:
    url = f"{mesh.url}/v1/completions"
    return httpx.post(url, json=body, headers=mesh.api_headers, timeout=120)


def test_a_generation_waits_for_its_only_node_to_return_and_ends_exact(
    mesh: LocalMesh, expected: list[int]
) -> None:
    def restart(n: int, s: Streamed) -> None:
        if n == 10:
            mesh.kill_node("node-1")  # the only node of [2, 4): no replacement now
            mesh.start_node("node-1", LayerRange(2, 4))  # back in a few seconds

    result = stream_completion(mesh, BODY, restart)
    assert result.error is None, result.error
    assert result.ids == expected
    (recovery,) = result.final["recoveries"] if result.final else [None]
    assert recovery is not None and recovery["failed_node"] == "node-1"
    wait_until_up(mesh, "node-1")


def test_a_request_with_no_complete_route_waits_for_one(
    mesh: LocalMesh, expected: list[int]
) -> None:
    mesh.kill_node("node-1")
    answers: list[httpx.Response] = []
    sent = threading.Thread(target=lambda: answers.append(_complete(mesh)))
    sent.start()
    sent.join(1.0)
    assert sent.is_alive()  # waiting for a route, not refused
    mesh.start_node("node-1", LayerRange(2, 4))
    sent.join(120)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else None
    assert answers[0].json()["meshnet"]["ids"] == expected
    wait_until_up(mesh, "node-1")
