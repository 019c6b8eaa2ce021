"""A node's resident memory follows the KV it holds, back down when sessions end.

A node keeps what a step frees for the next step (memory.py), so a decode step reuses
its buffers instead of faulting them in again; what it frees for good must still go
back to the system, or a node that served long sessions would keep their KV's worth
of memory for its life and report it as taken (its heartbeats' free memory, which
placement reads). A real node serves the bundled model; two sessions' long prompts
make KV resident (tens of MB: the resident set grows by what the node says it
holds); once the sessions are deleted and the node has nothing to do, its resident
set falls by all of it, but for the heap top the policy keeps for the next step.
"""

from __future__ import annotations

import time

import httpx
from conftest import MeshFactory
from faults import info
from session_client import new_session, turn
from streams import rss_bytes

from meshnet.local_mesh import LocalMesh

# ~600 tokens: 26 MB of float32 KV a session on the bundled model (30 layers, 3 KV heads)
LONG = "The quick brown fox jumps over the lazy dog. " * 60
SESSIONS = 2
KEPT = 8 << 20  # free heap top the policy keeps for the next step (memory.KEEP_UNDER)
SLACK = 4 << 20  # the interpreter's own heap moving as requests come and go
WAIT_S = 60.0  # for the node to go idle and hand memory back; ends early when it has


def _long_sessions(mesh: LocalMesh) -> list[str]:
    """Sessions whose long first turns leave their KV hot on the node."""
    sids = [new_session(mesh, system=None) for _ in range(SESSIONS)]
    for sid in sids:
        turn(mesh, sid, LONG, max_tokens=4)
    return sids


def _delete(mesh: LocalMesh, sids: list[str]) -> None:
    for sid in sids:
        r = httpx.delete(f"{mesh.url}/v1/sessions/{sid}", headers=mesh.api_headers, timeout=30)
        assert r.status_code == 200, r.text


def _settled_rss(pid: int, at_most: int) -> int:
    """The node's resident bytes once they are ``at_most``, or after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while (rss := rss_bytes(pid)) > at_most and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


def test_a_node_hands_back_the_kv_of_ended_sessions(mesh_factory: MeshFactory) -> None:
    # No prefix cache: the prompts' blocks would stay, rightly, as held KV.
    mesh = mesh_factory("0:30", node_args=["--prefix-cache-mb", "0"])
    node_id, proc = next(iter(mesh.nodes.items()))
    before = rss_bytes(proc.pid)
    sids = _long_sessions(mesh)
    held = info(mesh, node_id)
    holding = rss_bytes(proc.pid)
    assert held.sessions == SESSIONS and held.kv_bytes > 40 << 20
    assert holding - before >= 0.9 * held.kv_bytes  # the KV is resident

    _delete(mesh, sids)
    bound = holding - held.kv_bytes + KEPT + SLACK
    after = _settled_rss(proc.pid, bound)
    assert info(mesh, node_id).kv_bytes == 0
    assert after <= bound, (before, holding, after, held.kv_bytes)
