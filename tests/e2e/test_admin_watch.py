"""Operators list sessions and follow the mesh's state changes (real tracker and nodes)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from session_client import new_session, op, turn

from meshnet.local_mesh import LocalMesh

QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_factory: Any) -> LocalMesh:
    model = Path(tiny_factory("chat.gguf", context_length=1024))
    return mesh_factory("0:2,2:4", model=model, tracker_args=QUIET)


def _tenant_api(mesh: LocalMesh, tenant_id: str) -> Any:
    admin = mesh.admin_headers
    assert httpx.post(f"{mesh.url}/admin/tenants", json={"id": tenant_id}, headers=admin).is_success
    r = httpx.post(f"{mesh.url}/admin/tenants/{tenant_id}/keys", headers=admin)
    key = r.json()["api_key"]

    return SimpleNamespace(url=mesh.url, api_headers={"Authorization": f"Bearer {key}"})


def _list(mesh: LocalMesh, **params: Any) -> httpx.Response:
    return httpx.get(f"{mesh.url}/admin/sessions", params=params, headers=mesh.admin_headers)


def _all_ids(mesh: LocalMesh, **params: Any) -> list[str]:
    ids: list[str] = []
    after = ""
    while True:
        r = _list(mesh, after=after, **params)
        assert r.status_code == 200, r.text
        ids += [s["id"] for s in r.json()["sessions"]]
        after = r.json()["next"]
        if after is None:
            return ids


def test_sessions_are_listed_by_page_state_and_tenant(mesh: LocalMesh) -> None:
    acme = _tenant_api(mesh, "acme")
    mine = [new_session(acme) for _ in range(3)]
    others = [new_session(mesh) for _ in range(2)]
    turn(acme, mine[0], "hello")
    op(acme, mine[0], "park")

    listed = _all_ids(mesh, tenant="acme", limit=2)  # two pages and a last one
    assert sorted(listed) == sorted(mine)
    assert not set(others) & set(_all_ids(mesh, tenant="acme"))
    parked = _list(mesh, state="parked", tenant="acme").json()["sessions"]
    assert [s["id"] for s in parked] == [mine[0]]
    assert parked[0]["tenant"] == "acme" and parked[0]["model"] == "chat"
    both = _all_ids(mesh, state=["parked", "idle"], tenant="acme")
    assert (
        sorted(both) == sorted(mine) == sorted(_all_ids(mesh, state="idle,parked", tenant="acme"))
    )
    assert _all_ids(mesh, model="no-such-model") == []

    assert _list(mesh, state="asleep").status_code == 400
    assert _list(mesh, limit=0).status_code in (400, 422)
    assert _list(mesh, limit=501).status_code in (400, 422)
    r = httpx.get(f"{mesh.url}/admin/sessions", headers=mesh.api_headers)
    assert r.status_code in (401, 403)  # a tenant's key is not the admin's


class _Watcher:
    """Reads an event stream on a thread; its events, as they come."""

    def __init__(self, mesh: LocalMesh, headers: dict[str, str] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.names: list[str] = []
        self.status = 0
        self._client = httpx.Client(timeout=httpx.Timeout(60, read=None))
        self._ready = threading.Event()
        url, hdrs = f"{mesh.url}/admin/events", {**mesh.admin_headers, **(headers or {})}
        self._thread = threading.Thread(target=self._read, args=(url, hdrs), daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with self._client.stream("GET", url, headers=headers) as r:
                self.status = r.status_code
                self._ready.set()
                name = ""
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        self.names.append(name)
                        if name != "reset":
                            self.events.append(json.loads(line[6:]))
        except httpx.HTTPError:
            pass
        finally:
            self._ready.set()

    def wait_for(self, match: Any, within_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for e in list(self.events):
                if match(e):
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no such event in {self.events}")

    def close(self) -> None:
        self._client.close()


@pytest.fixture
def watcher(mesh: LocalMesh) -> Iterator[_Watcher]:
    w = _Watcher(mesh)
    yield w
    w.close()


def test_session_changes_stream_in_order_and_resume_from_the_last_id(
    mesh: LocalMesh, watcher: _Watcher
) -> None:
    assert watcher.status == 200
    sid = new_session(mesh)
    made = watcher.wait_for(lambda e: e["subject"] == sid)
    assert (made["kind"], made["previous"], made["state"]) == ("session", "", "idle")
    turn(mesh, sid, "hello")
    op(mesh, sid, "park")
    parked = watcher.wait_for(lambda e: e["subject"] == sid and e["state"] == "parked")
    assert parked["previous"] in ("idle", "active") and parked["id"] > made["id"]
    ids = [e["id"] for e in watcher.events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    # A watcher that lost its connection after `made` gets what followed it, no more.
    again = _Watcher(mesh, {"Last-Event-ID": str(made["id"])})
    try:
        resumed = again.wait_for(lambda e: e["subject"] == sid and e["state"] == "parked")
        assert resumed["id"] == parked["id"]
        assert all(e["id"] > made["id"] for e in again.events)
    finally:
        again.close()
    # One that names an id this tracker never gave is told to list afresh.
    future = _Watcher(mesh, {"Last-Event-ID": "999999999"})
    try:
        deadline = time.monotonic() + 30
        while "reset" not in future.names and time.monotonic() < deadline:
            time.sleep(0.05)
        assert future.names[:1] == ["reset"]
    finally:
        future.close()


def test_a_node_that_dies_is_an_event(mesh: LocalMesh, watcher: _Watcher) -> None:
    mesh.kill_node("node-1")
    down = watcher.wait_for(lambda e: e["kind"] == "node" and e["state"] == "down", 60)
    assert down["subject"] == "node-1" and down["previous"] == "up"


def test_event_streams_need_the_admin_and_are_bounded(mesh: LocalMesh) -> None:
    r = httpx.get(f"{mesh.url}/admin/events", headers=mesh.api_headers)
    assert r.status_code in (401, 403)
    r = httpx.get(f"{mesh.url}/admin/events", headers={**mesh.admin_headers, "Last-Event-ID": "x"})
    assert r.status_code == 400
