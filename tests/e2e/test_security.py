"""An attacker's view of a running mesh (real processes on loopback): every call below was
open before the planes were authenticated. Each is now refused with a typed error, changes
nothing, and the mesh still answers exactly what it answered before."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from conftest import MeshFactory
from solo import solo_chat_ids

from meshnet.auth.keys import new_secret, node_key
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.auth.signing import METADATA_KEY, PREFIX_KEY, sign_request
from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello there"}],
    "temperature": 0,
    "max_tokens": 8,
}
JSON = {"Content-Type": "application/json"}
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:2,2:4", model=tiny_path)


def _ids(mesh: LocalMesh, headers: dict[str, str] | None = None) -> list[int]:
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions",
        json=CHAT,
        headers=headers or mesh.api_headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return list(r.json()["meshnet"]["ids"])


def _serves_exactly(mesh: LocalMesh, tiny: LocalModel) -> None:
    assert _ids(mesh) == solo_chat_ids(tiny, CHAT)


def _nodes(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return {n["node_id"]: n for n in r.json()["nodes"]}


def _stub(mesh: LocalMesh, node_id: str) -> pb_grpc.NodeStub:
    channel = grpc.insecure_channel(_nodes(mesh)[node_id]["address"])
    return pb_grpc.NodeStub(channel)


def _code(call: Any) -> grpc.StatusCode | None:
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return None


def _session_with_kv(mesh: LocalMesh, headers: dict[str, str] | None = None) -> str:
    headers = headers or mesh.api_headers
    r = httpx.post(f"{mesh.url}/v1/sessions", json={"system": "be brief"}, headers=headers)
    assert r.status_code == 200, r.text
    sid = str(r.json()["id"])
    turn = {"content": "hello", "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{mesh.url}/v1/sessions/{sid}/turns", json=turn, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return sid


def _describe(mesh: LocalMesh, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{mesh.url}/v1/sessions/{sid}", headers=mesh.api_headers, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_stranger_cannot_register_a_node_or_take_over_one(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    before = _nodes(mesh)
    fake = {
        "node_id": "node-0",
        "address": "127.0.0.1:9",
        "backend": "fast",
        "kv_budget_bytes": 1 << 30,
        "pid": 1,
        "fingerprint": before["node-0"]["fingerprint"],
        "layer_start": 0,
        "layer_end": 4,
        "load": before["node-0"]["load"],
    }
    url = f"{mesh.url}/mesh/nodes"
    assert httpx.post(url, json=fake).status_code == 401
    stranger = node_key(new_secret(), "node-0")  # a key of another mesh
    body = httpx.Request("POST", url, json=fake).content
    forged = {
        "Authorization": sign_request("node-0", stranger, "POST", "/mesh/nodes", body),
        **JSON,
    }
    assert httpx.post(url, content=body, headers=forged).status_code == 401
    # node-1's own key cannot speak for node-0, nor register a new id it was not given
    as_node1 = sign_request("node-1", mesh.node_key("node-1"), "POST", "/mesh/nodes", body)
    r = httpx.post(url, content=body, headers={"Authorization": as_node1, **JSON})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "permission-denied"
    beat_path = "/mesh/nodes/node-0/heartbeat"
    beat = httpx.Request(
        "POST",
        url,
        json={"load": fake["load"], "fingerprint": "x", "layer_start": 0, "layer_end": 4},
    ).content
    as_node1 = sign_request("node-1", mesh.node_key("node-1"), "POST", beat_path, beat)
    r = httpx.post(
        f"{mesh.url}{beat_path}", content=beat, headers={"Authorization": as_node1, **JSON}
    )
    assert r.status_code == 403, r.text
    after = _nodes(mesh)
    for node_id in ("node-0", "node-1"):
        assert after[node_id]["address"] == before[node_id]["address"]
        assert after[node_id]["layers"] == before[node_id]["layers"]
    assert set(after) == set(before)
    _serves_exactly(mesh, tiny)


def test_node_calls_without_the_trackers_signature_are_refused(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    sid = _session_with_kv(mesh)
    held = _describe(mesh, sid)
    stub = _stub(mesh, "node-0")
    forged = MeshKeys(new_secret())  # another mesh's secret
    get = pb.StateGetRequest(session_id=sid)
    calls = {
        "Info": lambda md: stub.Info(pb.InfoRequest(), metadata=md, timeout=5),
        "StateGet": lambda md: stub.StateGet(get, metadata=md, timeout=5),
        "StateOffer": lambda md: stub.StateOffer(get, metadata=md, timeout=5),
        "Release": lambda md: stub.Release(
            pb.ReleaseRequest(session_id=sid, epoch=10**9), metadata=md, timeout=5
        ),
        "Fence": lambda md: stub.Fence(
            pb.FenceRequest(session_id=sid, epoch=10**9), metadata=md, timeout=5
        ),
        "Park": lambda md: stub.Park(pb.ParkRequest(session_id=sid), metadata=md, timeout=5),
        "Configure": lambda md: stub.Configure(
            pb.ConfigureRequest(load=pb.LoadShard(layer_start=0, layer_end=4)),
            metadata=md,
            timeout=5,
        ),
        "StatePull": lambda md: stub.StatePull(
            pb.StatePullRequest(source="127.0.0.1:9", session_id=sid), metadata=md, timeout=5
        ),
        "StatePut": lambda md: stub.StatePut(iter([]), metadata=md, timeout=5),
        "Outputs": lambda md: stub.Outputs(
            pb.OutputsRequest(session_id=sid, first_step=0, end_step=9), metadata=md, timeout=5
        ),
        "Forward": lambda md: stub.Forward(
            iter([pb.ForwardRequest(open=pb.Open(session_id=sid, epoch=10**9))]),
            metadata=md,
            timeout=5,
        ),
        "RelayStream": lambda md: stub.RelayStream(iter([]), metadata=md, timeout=5),
    }
    for method, call in calls.items():
        assert _code(lambda c=call: c(())) == UNAUTHENTICATED, method
        assert _code(lambda c=call, m=method: c(forged.call("node-0", m))) == UNAUTHENTICATED
        # a tracker signature made for another method does not carry over
        other = MeshKeys(mesh.mesh_secret).call("node-0", "Info" if method != "Info" else "Fence")
        assert _code(lambda c=call, o=other: c(o)) == UNAUTHENTICATED, method
    assert _describe(mesh, sid) == held
    r = httpx.post(
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json={"content": "more", "max_tokens": 4, "temperature": 0},
        headers=mesh.api_headers,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["resume_path"] == "hot", r.text
    _serves_exactly(mesh, tiny)


def test_peer_tokens_reach_only_the_session_and_calls_they_name(mesh: LocalMesh) -> None:
    keys = MeshKeys(mesh.mesh_secret)
    mine, other = _session_with_kv(mesh), _session_with_kv(mesh)
    stub = _stub(mesh, "node-0")
    relay = ((METADATA_KEY, keys.peer("node-0", "node-1", "relay")),)
    pull_mine = ((METADATA_KEY, keys.peer("node-0", "node-1", "pull", mine)),)
    get_other = pb.StateGetRequest(session_id=other)
    assert _code(lambda: stub.StateGet(get_other, metadata=relay, timeout=5)) == PERMISSION_DENIED
    assert (
        _code(lambda: stub.StateGet(get_other, metadata=pull_mine, timeout=5)) == PERMISSION_DENIED
    )
    release = pb.ReleaseRequest(session_id=mine)
    assert _code(lambda: stub.Release(release, metadata=pull_mine)) == PERMISSION_DENIED
    frames = list(stub.StateGet(pb.StateGetRequest(session_id=mine), metadata=pull_mine))
    assert frames[0].header.session_id == mine  # the token's own session: allowed


def test_kv_is_imported_only_for_the_prefix_the_tracker_vouches_for(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    keys = MeshKeys(mesh.mesh_secret)
    sid = _session_with_kv(mesh)
    held = _describe(mesh, sid)
    stub = _stub(mesh, "node-0")
    frames = list(
        stub.StateGet(
            pb.StateGetRequest(session_id=sid, token_prefix_hash="a" * 64),
            metadata=keys.call("node-0", "StateGet"),
        )
    )
    signed = keys.call("node-0", "StatePut")
    no_prefix = stub.StatePut(iter(frames), metadata=signed, timeout=10)
    assert (no_prefix.imported, no_prefix.reason) == (False, "invalid")
    wrong = (*signed, (PREFIX_KEY, "b" * 64))
    other_tokens = stub.StatePut(iter(frames), metadata=wrong, timeout=10)
    assert (other_tokens.imported, other_tokens.reason) == (False, "token-prefix")
    after = _describe(mesh, sid)
    assert (after["tokens"], after["state"]) == (held["tokens"], held["state"])
    _serves_exactly(mesh, tiny)


def test_a_node_loads_models_only_from_its_directories(mesh: LocalMesh, tiny: LocalModel) -> None:
    keys = MeshKeys(mesh.mesh_secret)
    stub = _stub(mesh, "node-1")
    answers = []
    for path in ("/etc/passwd", "/no/such/file.gguf", "/root/.ssh/id_rsa"):
        load = pb.LoadShard(model_path=path, layer_start=2, layer_end=4)
        reply = stub.Configure(
            pb.ConfigureRequest(load=load), metadata=keys.call("node-1", "Configure"), timeout=30
        )
        assert not reply.applied
        assert reply.failure.kind == "permission-denied"
        answers.append(reply.failure.message)
    assert len(set(answers)) == 1  # nothing says whether a path exists
    _serves_exactly(mesh, tiny)


def test_admin_routes_need_the_admin_token(mesh: LocalMesh) -> None:
    for method, path in [
        ("GET", "/admin/nodes"),
        ("GET", "/admin/ledger"),
        ("GET", "/admin/generations"),
        ("GET", "/admin/loops"),
        ("POST", "/admin/generations/gen-x/cancel"),
        ("DELETE", "/admin/routes"),
        ("POST", "/admin/tenants"),
    ]:
        for headers in ({}, mesh.api_headers, {"Authorization": "Bearer ma_" + "0" * 64}):
            r = httpx.request(method, f"{mesh.url}{path}", headers=headers, json={"id": "x"})
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "unauthenticated"
    assert httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).status_code == 200
    loops = httpx.get(f"{mesh.url}/admin/loops", headers=mesh.admin_headers).json()["loops"]
    assert {loop["name"] for loop in loops} >= {"heartbeat sweeper", "retention"}
    assert all(loop["failing"] == 0 for loop in loops), loops
    assert httpx.get(f"{mesh.url}/healthz").status_code == 200  # a liveness probe stays open


def test_the_api_answers_only_live_keys(mesh: LocalMesh) -> None:
    admin = mesh.admin_headers
    r = httpx.post(f"{mesh.url}/admin/tenants", json={"id": "carol"}, headers=admin)
    assert r.status_code == 200, r.text
    issued = httpx.post(f"{mesh.url}/admin/tenants/carol/keys", headers=admin).json()
    carol = {"Authorization": f"Bearer {issued['api_key']}"}
    wrong = {"Authorization": "Bearer " + issued["api_key"][:-1] + "x"}
    for headers in ({}, wrong, {"Authorization": issued["api_key"]}, mesh.admin_headers):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]:
            r = httpx.request(method, f"{mesh.url}{path}", json=CHAT, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
    assert len(_ids(mesh, carol)) > 0
    r = httpx.delete(f"{mesh.url}/admin/keys/{issued['key_id']}", headers=admin)
    assert r.status_code == 200, r.text
    time.sleep(0.1)
    r = httpx.post(f"{mesh.url}/v1/chat/completions", json=CHAT, headers=carol)
    assert r.status_code == 401


def _tenant(mesh: LocalMesh, tenant_id: str, **quotas: int) -> dict[str, str]:
    r = httpx.post(
        f"{mesh.url}/admin/tenants", json={"id": tenant_id, **quotas}, headers=mesh.admin_headers
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{mesh.url}/admin/tenants/{tenant_id}/keys", headers=mesh.admin_headers)
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


def test_a_tenant_sees_only_its_own_sessions(mesh: LocalMesh) -> None:
    alice, bob = _tenant(mesh, "alice"), _tenant(mesh, "bob")
    sid = _session_with_kv(mesh, alice)
    r = httpx.get(f"{mesh.url}/v1/sessions/{sid}", headers=alice)
    held = r.json()
    turn = {"content": "mine now", "max_tokens": 4}
    for method, path, body in [
        ("GET", f"/v1/sessions/{sid}", None),
        ("DELETE", f"/v1/sessions/{sid}", None),
        ("POST", f"/v1/sessions/{sid}/park", None),
        ("POST", f"/v1/sessions/{sid}/evict", None),
        ("POST", f"/v1/sessions/{sid}/turns", turn),
        ("GET", f"/v1/sessions/{sid}/turns/turn-x", None),
    ]:
        r = httpx.request(method, f"{mesh.url}{path}", json=body, headers=bob, timeout=30)
        assert r.status_code == 404, (method, path, r.text)
        assert "no session" in r.json()["error"]["message"]
    r = httpx.get(f"{mesh.url}/v1/sessions/{sid}", headers=alice)
    assert r.status_code == 200 and r.json() == held


async def _burst(url: str, headers: dict[str, str], n: int) -> list[tuple[int, str | None]]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one() -> tuple[int, str | None]:
            r = await client.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
            return r.status_code, r.headers.get("retry-after")

        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_a_tenant_over_its_quota_gets_429s_and_others_are_unaffected(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    greedy = _tenant(mesh, "greedy", requests_per_min=20, max_streams=2)
    want = solo_chat_ids(tiny, CHAT)
    others: list[list[int]] = []

    def other_tenant() -> None:
        for _ in range(5):
            others.append(_ids(mesh))

    beside = threading.Thread(target=other_tenant)
    beside.start()
    answers = asyncio.run(_burst(mesh.url, greedy, 200))
    beside.join()
    statuses = [s for s, _ in answers]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) <= 20
    assert statuses.count(429) >= 180
    assert all(retry is not None and int(retry) >= 1 for s, retry in answers if s == 429)
    assert others == [want] * 5


def test_idle_streams_and_connections_cannot_take_a_node_out(
    mesh: LocalMesh, tiny: LocalModel
) -> None:
    node = _nodes(mesh)["node-0"]
    keys = MeshKeys(mesh.mesh_secret)
    stub = _stub(mesh, "node-0")
    sid = _session_with_kv(mesh)
    offer = stub.StateOffer(
        pb.StateGetRequest(session_id=sid), metadata=keys.call("node-0", "StateOffer")
    )
    host, port = offer.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    stop = threading.Event()

    def hang() -> Iterator[pb.ForwardRequest]:
        stop.wait()
        yield from ()

    streams = [stub.Forward(hang(), timeout=60) for _ in range(100)]  # no credential
    try:
        _serves_exactly(mesh, tiny)
        threads = _threads(node["pid"])
        assert threads < 200, threads
    finally:
        stop.set()
        for call in streams:
            call.cancel()
        for conn in idle:
            conn.close()
    _serves_exactly(mesh, tiny)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RSS")


def test_stalled_imports_take_no_memory_and_are_capped(mesh: LocalMesh, tiny: LocalModel) -> None:
    """Six imports that send a valid header of a big session and then stall."""
    node = _nodes(mesh)["node-0"]
    keys = MeshKeys(mesh.mesh_secret)
    stub = _stub(mesh, "node-0")
    sid = _session_with_kv(mesh)
    prefix = "c" * 64
    (header_frame, *_) = stub.StateGet(
        pb.StateGetRequest(session_id=sid, token_prefix_hash=prefix),
        metadata=keys.call("node-0", "StateGet"),
    )
    header = header_frame.header
    # As big as the context allows: what a node used to allocate on reading the header.
    per_token = header.total_bytes // header.tokens
    header.tokens = header.steps = tiny.spec.context_length
    header.total_bytes = per_token * header.tokens
    before = _rss_mb(node["pid"])
    stop = threading.Event()

    def stalled() -> Iterator[pb.KVFrame]:
        yield header_frame
        stop.wait()

    signed = (*keys.call("node-0", "StatePut"), (PREFIX_KEY, prefix))
    calls = [stub.StatePut.future(stalled(), metadata=signed, timeout=20) for _ in range(6)]
    try:
        deadline = time.monotonic() + 10
        busy = []
        while time.monotonic() < deadline and len(busy) < 2:
            busy = [c for c in calls if c.done()]
            time.sleep(0.1)
        assert [c.result().reason for c in busy] == ["busy", "busy"]
        assert header.total_bytes > 0
        assert _rss_mb(node["pid"]) - before < 16
    finally:
        stop.set()
        for call in calls:
            call.cancel()
    _serves_exactly(mesh, tiny)


def test_a_prompt_over_the_character_bound_is_400(mesh: LocalMesh) -> None:
    messages = [{"role": "user", "content": "x" * 600_000}] * 2
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions",
        json={**CHAT, "messages": messages},
        headers=mesh.api_headers,
        timeout=30,
    )
    assert r.status_code == 400, r.text


def test_a_tenants_session_turns_count_against_its_tokens_per_minute(mesh: LocalMesh) -> None:
    thrifty = _tenant(mesh, "thrifty", tokens_per_min=30)
    sid = _session_with_kv(mesh, thrifty)  # its first turn's tokens count already
    url = f"{mesh.url}/v1/sessions/{sid}/turns"
    body = {"content": "again", "max_tokens": 12, "temperature": 0}
    statuses = []
    for _ in range(10):
        r = httpx.post(url, json=body, headers=thrifty, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "quota-exceeded"
            break
        assert r.status_code == 200, r.text
    assert statuses[-1] == 429, statuses
    assert len(_ids(mesh)) > 0  # the default tenant is not limited by it
