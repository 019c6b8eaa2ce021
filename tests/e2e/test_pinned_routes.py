"""Routes named per request (``"meshnet": {"route": [...]}``) on real processes: exactly
the named nodes serve, each kind of bad route is a 400 with its reason, a tenant naming
one is refused, and unpinned streams running beside pinned ones keep their routes and
their exact outputs."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from billing import ledger
from conftest import MeshFactory
from session_client import TrackerApi
from streams import Streamed, stream_completion

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.sampling import SamplingParams

# node-0 serves every layer, node-1 + node-2 are a chain, node-3 (a replica of
# node-1) is killed, node-4 is empty, and "alien" serves another model.
LAYOUT = "0:4,0:2,2:4,0:2,empty"


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path, tiny_factory: Any) -> Iterator[LocalMesh]:
    mesh = mesh_factory(LAYOUT, model=tiny_path)
    # A second launcher on the same data dir and tracker starts a node of another model.
    other = LocalMesh(
        data_dir=mesh.data_dir, port=mesh.port, model=str(tiny_factory("o.gguf", seed=9))
    )
    try:
        other.start_node("alien", LayerRange(0, 4))
        mesh.kill_node("node-3")
        _wait_for(mesh, lambda n: _state(n, "node-3") == "down" and _state(n, "alien") == "up")
        yield mesh
    finally:
        other.stop()


def _nodes(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=30)
    return {n["node_id"]: n for n in r.json()["nodes"]}


def _state(nodes: dict[str, dict[str, Any]], node_id: str) -> str | None:
    """A node's state; None until it has registered (a loaded machine starts it late)."""
    return nodes.get(node_id, {}).get("state")


def _wait_for(mesh: LocalMesh, ok: Callable[[dict[str, dict[str, Any]]], bool]) -> None:
    deadline = time.monotonic() + 120
    while not ok(nodes := _nodes(mesh)):
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)


def _admin(mesh: LocalMesh) -> TrackerApi:
    """The mesh's API as an operator calls it: the admin token in place of an API key."""
    return TrackerApi(mesh.url, mesh.admin_headers)


def _complete(
    mesh: LocalMesh, route: list[str] | None, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "prompt": "the cat", "max_tokens": 8, **extra}
    body["temperature"] = body.get("temperature", 0)
    if route is not None:
        body["meshnet"] = {"route": route}
    if headers is None:
        headers = mesh.admin_headers if route is not None else mesh.api_headers
    return httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=60)


def _solo(tiny: LocalModel, prompt: str, max_tokens: int, **sampling: Any) -> list[int]:
    ids = tiny.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return generate(tiny.chain, tiny.tokenizer, ids, params).ids


def _route_ids(meta: dict[str, Any]) -> list[str]:
    return [h["node_id"] for h in meta["route"]]


def _served_by(mesh: LocalMesh, generation_id: str) -> set[str]:
    """The nodes the ledger says computed the generation (its records may lag a moment)."""
    deadline = time.monotonic() + 10
    while not (records := ledger(mesh, generation_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert records and all(r["status"] == "completed" for r in records), records
    return {r["node_id"] for r in records}


@pytest.mark.parametrize("route", [["node-1", "node-2"], ["node-0"]])
def test_a_named_route_runs_on_exactly_its_nodes(
    mesh: LocalMesh, tiny: LocalModel, route: list[str]
) -> None:
    r = _complete(mesh, route)
    assert r.status_code == 200, r.text
    meta = r.json()["meshnet"]
    assert _route_ids(meta) == route and meta["recoveries"] == []
    assert meta["ids"] == _solo(tiny, "the cat", 8, temperature=0.0)
    assert _served_by(mesh, meta["generation_id"]) == set(route)
    streamed = stream_completion(_admin(mesh), {"model": "tiny", "prompt": "the cat",
                                                "max_tokens": 8, "temperature": 0,
                                                "meshnet": {"route": route}})  # fmt: skip
    assert streamed.error is None and streamed.final is not None
    assert _route_ids({"route": streamed.route}) == _route_ids(streamed.final) == route
    assert streamed.ids == meta["ids"]


def test_a_named_route_wins_over_the_global_pin_and_leaves_it_in_place(mesh: LocalMesh) -> None:
    admin = f"{mesh.url}/admin/routes"
    pinned = httpx.post(admin, json={"node_ids": ["node-0"]}, headers=mesh.admin_headers)
    assert pinned.status_code == 200, pinned.text
    try:
        named = _complete(mesh, ["node-1", "node-2"])
        assert _route_ids(named.json()["meshnet"]) == ["node-1", "node-2"]
        assert _route_ids(_complete(mesh, None).json()["meshnet"]) == ["node-0"]
        assert httpx.get(admin, headers=mesh.admin_headers).json()["pinned"] == ["node-0"]
    finally:
        httpx.delete(admin, headers=mesh.admin_headers)


def test_the_openai_client_names_a_route_with_the_admin_token(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    token = mesh.credentials.admin_token
    with openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=token, max_retries=0) as client:
        r = client.completions.create(
            model="tiny",
            prompt="the cat",
            max_tokens=8,
            temperature=0,
            extra_body={"meshnet": {"route": ["node-1", "node-2"]}},
        )
    assert r.model_extra is not None
    assert _route_ids(r.model_extra["meshnet"]) == ["node-1", "node-2"]
    assert r.model_extra["meshnet"]["ids"] == _solo(tiny, "the cat", 8, temperature=0.0)


@pytest.mark.parametrize(
    ("route", "reason"),
    [
        (["node-9"], "unknown node ids: node-9"),
        (["node-3", "node-2"], "nodes down: node-3 ("),
        (["node-4"], "node node-4 has no layers loaded"),
        (["alien"], "node alien serves another model"),
        (["node-1"], "layers [0, 2) do not cover [0, 4) exactly once in order"),
        (["node-0", "node-2"], "layers [0, 4), [2, 4) do not cover [0, 4)"),
        (["node-2", "node-1"], "layers [2, 4), [0, 2) do not cover [0, 4)"),
        (["node-1", "node-1", "node-2"], "nodes named more than once: node-1"),
    ],
)
def test_each_kind_of_bad_route_is_400_with_its_reason(
    mesh: LocalMesh, route: list[str], reason: str
) -> None:
    for stream in (False, True):
        r = _complete(mesh, route, stream=stream)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "bad-request" and error["type"] == "invalid_request_error"
        assert error["message"].startswith(reason), error


def test_a_malformed_route_is_400(mesh: LocalMesh) -> None:
    for meshnet in ({"route": []}, {"route": "node-0"}, {"route": ["node-0"], "x": 1}):
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 2, "meshnet": meshnet}
        r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.admin_headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("meshnet"), r.text


def test_only_the_admin_token_names_a_route(mesh: LocalMesh) -> None:
    refused = _complete(mesh, ["node-0"], headers=mesh.api_headers)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "permission-denied"
    assert "admin token" in refused.json()["error"]["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    chat["meshnet"] = {"route": ["node-0"]}
    url = f"{mesh.url}/v1/chat/completions"
    assert httpx.post(url, json=chat, headers=mesh.api_headers).status_code == 403
    assert httpx.post(url, json=chat, headers=mesh.admin_headers).status_code == 200
    anonymous = httpx.post(url, json=chat, headers={"Authorization": "Bearer nope"})
    assert anonymous.status_code == 401
    del chat["meshnet"]  # the admin token is still no API key
    assert httpx.post(url, json=chat, headers=mesh.admin_headers).status_code == 401


PROMPTS = ["the cat", "a b c", "once upon", "hello there", "x y", "one two three", "go", "dog"]


def _unpinned(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 40}
    body.update(temperature=0) if i % 2 == 0 else body.update(temperature=0.8, seed=100 + i)
    return body


def test_unpinned_streams_beside_pinned_ones_keep_their_routes_and_outputs(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    unpinned = [_unpinned(i) for i in range(8)]
    routes = [["node-1", "node-2"], ["node-0"]] * 2
    pinned = [{**_unpinned(i), "meshnet": {"route": r}} for i, r in enumerate(routes)]
    jobs = [(mesh, b) for b in unpinned] + [(_admin(mesh), b) for b in pinned]
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(len(jobs)) as pool:
        done: list[Streamed] = list(pool.map(lambda j: stream_completion(*j, client=client), jobs))
    for body, s in zip(unpinned + pinned, done, strict=True):
        assert s.error is None and s.final is not None, s.error
        sampling = {k: body[k] for k in ("temperature", "seed") if k in body}
        assert s.ids == _solo(tiny, body["prompt"], body["max_tokens"], **sampling), body
        assert s.final["recoveries"] == [] and s.final["route"] == s.route  # kept its route
    for body, s in zip(pinned, done[8:], strict=True):
        assert _route_ids({"route": s.route}) == body["meshnet"]["route"]
    planned = {tuple(_route_ids({"route": s.route})) for s in done[:8]}
    assert planned <= {("node-0",), ("node-1", "node-2")}  # the planner's, as always
    pin = httpx.get(f"{mesh.url}/admin/routes", headers=mesh.admin_headers).json()
    assert pin["pinned"] is None  # nothing global was set


def test_a_named_route_that_loses_a_node_fails_rather_than_move(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    """A replica stands by, but the request asked for the dead node: its stream ends with
    the node's failure, and no other node computes any of it."""
    mesh = mesh_factory("0:4,0:4", model=Path(tiny_factory("long.gguf", context_length=1024)))
    body = {"model": "long", "prompt": "the cat", "max_tokens": 900, "temperature": 0}
    body["meshnet"] = {"route": ["node-1"]}

    def kill_after_three(n: int, s: Streamed) -> None:
        if n == 3:
            mesh.kill_node("node-1", signal.SIGKILL)

    s = stream_completion(_admin(mesh), body, on_token=kill_after_three)
    assert s.error is not None and s.final is None, s
    assert "named route" in s.error["message"], s.error
    assert _route_ids({"route": s.route}) == ["node-1"]
    deadline = time.monotonic() + 10
    while not (records := ledger(mesh, s.generation_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {r["node_id"] for r in records} == {"node-1"}, records
