"""A ring's last hop shares its tied head with the first (node/head_assist.py), real
processes on loopback: on the bundled model (a 49k-row head) the first hop answers
head parts over its relay port and the tokens are the in-process engine's on the
nodes' backend (q8); on the tiny model
(a head too small to pay for a turnaround) the last hop soon multiplies alone, the
tokens exact either way; a node told ``--head-assist off`` asks nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory, SoloIds
from solo import solo_completion_ids
from streams import stream_completion
from tiny_requests import long_completion

from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh

BODY = long_completion(seed=11)


@pytest.fixture(scope="module")
def model(long_tiny: Path) -> Path:
    return long_tiny


@pytest.fixture(scope="module")
def expected(model: Path, solo_ids: SoloIds) -> list[int]:
    return solo_ids(model, BODY)


def _counter(mesh: LocalMesh, node: str, name: str) -> float:
    url = f"{mesh.url}/admin/nodes/{node}/metrics"
    text = httpx.get(url, headers=mesh.admin_headers, timeout=10).text
    found = re.search(rf"^meshnet_node_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{node} reports no {name}"
    return float(found.group(1))


@pytest.mark.bundled
def test_the_last_hop_shares_its_head_and_the_tokens_are_the_engines(
    mesh_factory: MeshFactory, oracle: dict[str, Any], bundled: LocalModel
) -> None:
    case = next(c for c in oracle["cases"] if c["name"] == "raw_completion")
    assert bundled.chain.shards[0].backend.name == "q8"  # the default, as the nodes'
    mesh = mesh_factory("0:10,10:20,20:30", node_args=["--backend", "q8"])
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": case["prompt_text"], "temperature": 0, "max_tokens": 48}
    want = solo_completion_ids(bundled, body)
    for _ in range(2):  # the first run links the hops; the second asks from its start
        s = stream_completion(mesh, body)
        assert s.error is None, s.error
        assert s.ids == want
    # How many of the 96 steps share depends on the first hop's turnaround: a busy host
    # pauses the peer (late parts, too little saved), as head_assist.py means it to;
    # test_head_assist_peer.py holds those rules to a fake clock.
    shared = _counter(mesh, "node-2", "head_parts")
    assert shared >= 1, "no head part shared over two runs of 48 tokens"
    assert _counter(mesh, "node-0", "head_parts") == 0  # the first hop only answers


def test_a_head_too_small_to_share_is_soon_multiplied_alone_and_exactly(
    mesh_factory: MeshFactory, model: Path, expected: list[int]
) -> None:
    mesh = mesh_factory("0:1,1:3,3:4", model=model)
    for _ in range(2):
        s = stream_completion(mesh, BODY)
        assert s.error is None, s.error
        assert s.ids == expected
    asked = _counter(mesh, "node-2", "head_parts") + _counter(mesh, "node-2", "head_parts_late")
    assert asked < len(expected) / 2  # not asked again for a while once it did not pay


def test_a_node_told_off_multiplies_its_head_alone(
    mesh_factory: MeshFactory, model: Path, expected: list[int]
) -> None:
    mesh = mesh_factory("0:2,2:4", model=model, node_args=["--head-assist", "off"])
    s = stream_completion(mesh, BODY)
    assert s.error is None, s.error
    assert s.ids == expected
    assert _counter(mesh, "node-1", "head_parts") == 0
