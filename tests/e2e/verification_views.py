"""What the verification tests read off a tracker: a node's state as it settles, and
its ledger records."""

from __future__ import annotations

import time
from typing import Any

import httpx
from faults import nodes

from meshnet.local_mesh import LocalMesh


def wait_state(mesh: LocalMesh, node_id: str, state: str, within_s: float = 180) -> dict[str, Any]:
    """The node's record once it is in ``state``; fails after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        node = nodes(mesh).get(node_id, {})
        if node.get("state") == state or time.monotonic() > deadline:
            assert node.get("state") == state, node
            return node
        time.sleep(0.2)


def ledger(mesh: LocalMesh, node_id: str = "", **params: str) -> list[dict[str, Any]]:
    """``/admin/ledger``'s records, of ``node_id`` when given."""
    if node_id:
        params["node_id"] = node_id
    r = httpx.get(f"{mesh.url}/admin/ledger", params=params, headers=mesh.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return list(r.json()["records"])
