"""Routing by prefix on real processes: the replica holding a prompt's prefix is chosen
over an idle one that does not, until its load outweighs the prefix."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from conftest import MeshFactory
from streams import Streamed, stream_completion

from meshnet.local_mesh import LocalMesh

BLOCK = 16
LOAD_TOKENS = 40  # a generation in flight is worth 40 prompt tokens (--prefix-load-tokens)


@dataclass(frozen=True)
class _Admin:
    """The tracker's API with the admin token: a request may name its route."""

    url: str
    api_headers: dict[str, str]


def _ids(seed: int, n: int, shared: list[int] | None = None) -> list[int]:
    head = list(shared or [])
    return head + [(seed * 7919 + 31 * i) % 90 + 10 for i in range(n - len(head))]


def _complete(mesh: LocalMesh, prompt: list[int], route: list[str] | None = None) -> Any:
    body: dict[str, Any] = {"model": "long", "prompt": prompt, "temperature": 0, "max_tokens": 4}
    headers = mesh.api_headers
    if route is not None:
        body["meshnet"] = {"route": route}
        headers = mesh.admin_headers
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _route(reply: Any) -> list[str]:
    return [h["node_id"] for h in reply["meshnet"]["route"]]


def _cached(reply: Any) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def _wait_idle(mesh: LocalMesh) -> None:
    """Until every node's heartbeat reports no sessions (the loads tie)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=30)
        if all(n["load"]["sessions"] == 0 for n in r.json()["nodes"]):
            return
        time.sleep(0.1)
    raise AssertionError("the nodes never went idle")


def test_the_replica_holding_the_prefix_is_chosen_until_load_outweighs_it(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    model = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory(
        "0:4,0:4", model=model, tracker_args=["--prefix-load-tokens", str(LOAD_TOKENS)]
    )
    system = _ids(1, 4 * BLOCK)
    first = _complete(mesh, _ids(2, 70, system), route=["node-1"])  # node-1 computes it
    assert _route(first) == ["node-1"]
    _wait_idle(mesh)
    # Both idle: by load alone node-0 (ties go by node id); node-1 holds 64 of 70 ids.
    second = _complete(mesh, _ids(3, 70, system))
    assert _route(second) == ["node-1"]
    assert _cached(second) == 4 * BLOCK
    # Three long generations on node-1: 70 - 64 + 3 * 40 tokens of work there against
    # 70 on node-0, which gets the next one.
    started = threading.Barrier(4)
    stop = threading.Event()

    def busy() -> None:
        # 700 tokens without an eos on the long tiny model: in flight while the next is routed
        body = {"model": "long", "prompt": [5, 17, 42, 99, 3, 64, 128, 7], "max_tokens": 700}
        body.update(seed=3)
        body.update(temperature=0.7, meshnet={"route": ["node-1"]})

        def on_token(n: int, s: Streamed) -> bool | None:
            if n == 1:
                started.wait(timeout=60)
            return stop.is_set() or None

        stream_completion(_Admin(mesh.url, mesh.admin_headers), body, on_token)

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=60)
        third = _complete(mesh, _ids(4, 70, system))
        assert _route(third) == ["node-0"]
        assert _cached(third) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_a_sessions_first_turn_goes_to_the_replica_holding_its_system_prompt(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    """A chat completion computed a system prompt on node-1; a session with that system
    prompt opens its first turn there (by load alone it would go to node-0), on the
    cached blocks."""
    from session_client import new_session, turn

    model = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory("0:4,0:4", model=model)
    system = " ".join(f"rule {i}: answer in kind." for i in range(4))
    body = {
        "model": "long",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
        "max_tokens": 2,
        "meshnet": {"route": ["node-1"]},
    }
    r = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.admin_headers)
    assert r.status_code == 200, r.text
    assert _route(r.json()) == ["node-1"]
    _wait_idle(mesh)
    first = turn(mesh, new_session(mesh, system), "hello", max_tokens=4)
    assert [h["node_id"] for h in first["route"]] == ["node-1"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
