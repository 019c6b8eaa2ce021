"""OpenAI's sampling controls (presence / frequency penalties, logit bias, min-p) on
real processes with the tiny model: a failover mid-generation gives the same ids (the
replacement last hop rebuilds the penalties from the ids it is sent), an honest mesh at
verification rate 1.0 fails no check of its picks, and a last hop that samples as if
the request asked for none of them is caught by the verifier."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory, SoloIds
from faults import nodes, wait_kv_idle, wait_until_up
from streams import Streamed, serving, stream_completion
from verification_views import ledger, wait_state

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7] * 5  # > 32 positions: a whole chunk is checked
PLAIN: dict[str, Any] = {
    "model": "long",
    "prompt": PROMPT,
    "max_tokens": 120,
    "temperature": 0.9,
    "seed": 3,
}
CONTROLLED: dict[str, Any] = {
    **PLAIN,
    "presence_penalty": 0.8,
    "frequency_penalty": 1.5,
    "logit_bias": {"7": -100, "42": 2.5},
    "min_p": 0.02,
}
LAUNCHER = str(Path(__file__).parent / "dishonest_node.py")


@pytest.fixture(scope="module")
def two_nodes(mesh_factory: MeshFactory, long_tiny: Path) -> LocalMesh:
    """A -> B, no other option: the tests that kill nothing and configure nothing share it."""
    return mesh_factory("0:2,2:4", model=long_tiny)


def _ids(mesh: LocalMesh, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["meshnet"]["ids"])


@pytest.mark.parametrize("layout", ["0:4", "0:2,2:4"], ids=["one-node", "two-nodes"])
def test_the_mesh_gives_the_in_process_ids(
    mesh_factory: MeshFactory,
    long_tiny: Path,
    solo_ids: SoloIds,
    request: pytest.FixtureRequest,
    layout: str,
) -> None:
    """The last hop samples with the controls as the in-process engine does; a node
    holding every layer runs its steps by itself (autorun), carrying the ids on."""
    if layout == "0:2,2:4":
        mesh: LocalMesh = request.getfixturevalue("two_nodes")
    else:
        mesh = mesh_factory(layout, model=long_tiny)
    assert _ids(mesh, CONTROLLED) == solo_ids(long_tiny, CONTROLLED)


def test_a_failover_mid_generation_with_penalties_gives_the_same_ids(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    mesh = mesh_factory("0:2,2:4,2:4", model=long_tiny, heartbeat_timeout_s=8.0)
    expected = _ids(mesh, CONTROLLED)
    assert expected != _ids(mesh, PLAIN)  # the controls change this answer
    assert 7 not in expected
    for kill_at in (5, 40):
        for node_id in mesh.nodes:
            if node_id not in mesh.killed:
                wait_until_up(mesh, node_id)
        killed: list[str] = []

        def kill(n: int, s: Streamed, kill_at: int = kill_at, killed: list[str] = killed) -> None:
            if n == kill_at:
                killed.append(serving(s, (2, 4)))  # the last hop: it samples
                mesh.kill_node(killed[0])

        result = stream_completion(mesh, CONTROLLED, kill)
        assert result.error is None, (kill_at, result.error)
        assert result.ids == expected, f"kill after token {kill_at}"
        assert result.final is not None
        (recovery,) = result.final["recoveries"]
        assert recovery["failed_node"] == killed[0]
        mesh.start_node(killed[0], LayerRange(2, 4))
        wait_until_up(mesh, killed[0])


def test_an_honest_mesh_with_penalties_fails_no_check(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=long_tiny, tracker_args=["--verify-rate", "1.0"])
    first = _ids(mesh, CONTROLLED)
    assert first == _ids(mesh, CONTROLLED)
    time.sleep(2.0)  # the verifier's queue drains
    for node_id in ("node-0", "node-1"):
        assert nodes(mesh)[node_id]["state"] == "up"
        records = ledger(mesh, node_id)
        assert records and all(r["status"] != "rejected" for r in records)


def test_a_last_hop_that_ignores_the_penalties_is_caught(
    mesh_factory: MeshFactory, long_tiny: Path
) -> None:
    args = ["--verify-rate", "1.0"]
    mesh = mesh_factory("0:2", model=long_tiny, tracker_args=args, need_route=False)
    prefix = [sys.executable, LAUNCHER, "unpenalised", "0", "--"]
    mesh.start_node("cheater", LayerRange(2, 4), prefix=prefix)
    wait_state(mesh, "cheater", "up")  # calibration samples nothing: it passes
    mesh.wait_ready(expected_nodes=2, timeout_s=180)
    httpx.post(  # caught mid-generation with no other last hop: a 502, or an answer
        f"{mesh.url}/v1/completions", json=CONTROLLED, headers=mesh.api_headers, timeout=120
    )
    node = wait_state(mesh, "cheater", "quarantined")
    assert "sampled other ids" in node["down_reason"], node
    assert not any(r["billable"] for r in ledger(mesh, "cheater"))


def test_n_choices_equal_solo_runs_and_a_hang_up_frees_them_all(two_nodes: LocalMesh) -> None:
    mesh = two_nodes
    body = {**CONTROLLED, "max_tokens": 40}
    r = httpx.post(
        f"{mesh.url}/v1/completions", json={**body, "n": 3}, headers=mesh.api_headers, timeout=120
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for i, choice in enumerate(choices):
        assert choice["meshnet"]["ids"] == _ids(mesh, {**body, "seed": body["seed"] + i})
    streamed = stream_completion(mesh, {**CONTROLLED, "n": 3}, lambda n, s: n == 15)
    assert streamed.hung_up and streamed.final is None
    wait_kv_idle(mesh, ["node-0", "node-1"], within_s=10.0)
