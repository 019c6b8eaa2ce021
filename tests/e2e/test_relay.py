"""Activations flow node to node: in a 3-node route every hop after the first takes
its input from the previous hop, not from the tracker, the first hop is relayed each
next token by the last (the decode steps go round a ring), and the output is
exactly the one the tracker-carried path (``--no-relay``) and a single process
give, whether the ring's inputs go over the nodes' relay ports (raw TCP) or, where
those are off, over gRPC relay streams."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from solo import solo_chat_ids

from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh

pytestmark = pytest.mark.bundled

BODY: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 16,
    "temperature": 0.8,
    "seed": 11,
}


def _relayed(mesh: LocalMesh, want: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Each node's count of relayed steps, once heartbeats report counts within ``want``'s
    bounds (or 10 s)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
        seen = {n["node_id"]: n["load"]["relayed"] for n in nodes}
        if seen.keys() == want.keys() and all(lo <= seen[k] <= hi for k, (lo, hi) in want.items()):
            break
        time.sleep(0.2)
    return seen


def _linked(mesh: LocalMesh) -> list[str]:
    """The nodes whose relay port (their log names it) holds a connection from a
    previous hop."""
    ports: dict[int, str] = {}
    for name in ("node-0", "node-1", "node-2"):
        text = (mesh.data_dir / "logs" / f"{name}.log").read_text()
        found = re.search(r"takes relayed inputs on port (\d+)", text)
        if found:
            ports[int(found.group(1))] = name
    linked = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        port = int(local.rsplit(":", 1)[1], 16)
        if state == "01" and port in ports:  # ESTABLISHED, on the listening side
            linked.add(ports[port])
    return sorted(linked)


@pytest.mark.parametrize("path", ["socket", "grpc", "tracker"])
def test_hops_relay_to_each_other_with_the_same_output(
    mesh_factory: MeshFactory, bundled: LocalModel, path: str
) -> None:
    relay = path != "tracker"
    mesh = mesh_factory(
        "0:10,10:20,20:30",
        tracker_args=[] if relay else ["--no-relay"],
        node_args=["--relay-port", "off"] if path == "grpc" else [],
    )
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=BODY, headers=mesh.api_headers, timeout=120
    )
    assert r.status_code == 200, r.text
    ids = r.json()["meshnet"]["ids"]
    assert ids == solo_chat_ids(bundled, BODY)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    steps = len(ids)  # the prefill, then one step per token after the first
    # Every hop after the first is relayed each step's input; the first, the token of
    # every decode step but the ring's first (the tracker starts the ring with it). A
    # run ends at the generation's last step: no hop runs past it.
    want = (
        {"node-0": (steps - 2, steps - 2), "node-1": (steps, steps), "node-2": (steps, steps)}
        if relay
        else dict.fromkeys(("node-0", "node-1", "node-2"), (0, 0))
    )
    seen = _relayed(mesh, want)
    assert all(lo <= seen[k] <= hi for k, (lo, hi) in want.items()), seen
    # Each hop's first inputs go by stream, which offers the relay port; the rest by it.
    assert _linked(mesh) == (["node-0", "node-1", "node-2"] if path == "socket" else [])
