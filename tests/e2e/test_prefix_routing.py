"""Routing by prefix on real processes: the replica holding a prompt's prefix is chosen
over an idle one that does not, until its load outweighs the prefix."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _busy(mesh: LocalMesh, node_id: str, n: int) -> Iterator[None]:
    """``n`` long generations in flight on ``node_id`` (the operator's, on a named route)
    while the block runs; stopped after it."""
    started = threading.Barrier(n + 1)
    stop = threading.Event()

    def busy() -> None:
        # 700 tokens, an eos or not (whichever backend samples): in flight while the next
        # is routed
        body = {"model": "long", "prompt": [5, 17, 42, 99, 3, 64, 128, 7], "max_tokens": 700}
        body.update(seed=3, ignore_eos=True)
        body.update(temperature=0.7, meshnet={"route": [node_id]})

        def on_token(k: int, s: Streamed) -> bool | None:
            if k == 1:
                started.wait(timeout=60)
            return stop.is_set() or None

        stream_completion(_Admin(mesh.url, mesh.admin_headers), body, on_token)

    threads = [threading.Thread(target=busy) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=60)
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_the_replica_holding_the_prefix_is_chosen_until_load_outweighs_it(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    model = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory(
        "0:4,0:4", model=model, tracker_args=["--prefix-load-tokens", str(LOAD_TOKENS)]
    )
    system = _ids(1, 6 * BLOCK)
    n = 6 * BLOCK + 6
    first = _complete(mesh, _ids(2, n, system))  # both idle: ties go by node id
    assert _route(first) == ["node-0"]
    _wait_idle(mesh)
    # One generation on node-0: by load alone node-1 gets the next. Node-0 holds 96 of its
    # 102 ids: 6 + 40 tokens of work there (6 + 80 once node-0 reports the generation in
    # its heartbeat too) against 102 on node-1.
    with _busy(mesh, "node-0", 1):
        second = _complete(mesh, _ids(3, n, system))
    assert _route(second) == ["node-0"]
    assert _cached(second) == 6 * BLOCK
    _wait_idle(mesh)
    # Three: 6 + 3 * 40 tokens of work on node-0 against 102 on node-1, which gets it.
    with _busy(mesh, "node-0", 3):
        third = _complete(mesh, _ids(4, n, system))
    assert _route(third) == ["node-1"]
    assert _cached(third) == 0


def test_a_sessions_first_turn_goes_to_the_replica_holding_its_system_prompt(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    """A chat completion computed a system prompt on node-0; a session of the same
    tenant with that system prompt opens its first turn there, on the cached blocks,
    though node-0 runs a generation and by load alone it would go to node-1."""
    from session_client import new_session, turn

    model = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory(
        "0:4,0:4", model=model, tracker_args=["--prefix-load-tokens", str(LOAD_TOKENS)]
    )
    system = " ".join(f"rule {i}: answer in kind, and briefly." for i in range(16))
    body = {
        "model": "long",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
        "max_tokens": 2,
    }
    r = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers)
    assert r.status_code == 200, r.text
    assert _route(r.json()) == ["node-0"]  # both idle: ties go by node id
    _wait_idle(mesh)
    with _busy(mesh, "node-0", 1):  # worth 40 tokens (80 once reported): less than the hit
        first = turn(mesh, new_session(mesh, system), "hello", max_tokens=4)
    assert [h["node_id"] for h in first["route"]] == ["node-0"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK
