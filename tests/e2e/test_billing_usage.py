"""Usage per tenant and earnings per node, as an operator reads them (GET /admin/billing),
on a real tracker and two nodes: each tenant is charged its own generations' work, once."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from session_client import new_session, turn

from meshnet.local_mesh import LocalMesh

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "count to three"}],
    "max_tokens": 6,
    "temperature": 0,
}


@dataclass(frozen=True)
class Tenant:
    url: str
    api_headers: dict[str, str]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:2,2:4", model=tiny_path)


def _tenant(mesh: LocalMesh, tenant_id: str) -> Tenant:
    admin = mesh.admin_headers
    r = httpx.post(f"{mesh.url}/admin/tenants", json={"id": tenant_id}, headers=admin)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{mesh.url}/admin/tenants/{tenant_id}/keys", headers=admin)
    return Tenant(mesh.url, {"Authorization": f"Bearer {r.json()['api_key']}"})


def _layer0_tokens(mesh: LocalMesh, generation_ids: list[str]) -> tuple[int, int]:
    """Billable positions at layer 0, and billable layer-tokens, of these generations as
    their ledger records say."""
    tokens = layer_tokens = 0
    for gid in generation_ids:
        r = httpx.get(
            f"{mesh.url}/admin/ledger", params={"generation_id": gid}, headers=mesh.admin_headers
        )
        for rec in r.json()["records"]:
            if rec["billable"]:
                layer_tokens += rec["tokens"] * (rec["layer_end"] - rec["layer_start"])
                if rec["layer_start"] == 0:
                    tokens += rec["tokens"]
    return tokens, layer_tokens


def _billing(mesh: LocalMesh) -> dict[str, Any]:
    r = httpx.get(f"{mesh.url}/admin/billing", headers=mesh.admin_headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_each_tenant_is_billed_its_own_work_once(mesh: LocalMesh) -> None:
    alice, bob = _tenant(mesh, "alice"), _tenant(mesh, "bob")
    r = httpx.post(f"{mesh.url}/v1/chat/completions", json=CHAT, headers=alice.api_headers)
    assert r.status_code == 200, r.text
    alice_gens = [r.json()["meshnet"]["generation_id"]]
    sid = new_session(bob)
    bob_gens = [turn(bob, sid, "hello", max_tokens=5)["turn_id"]]
    bob_gens.append(turn(bob, sid, "and again", max_tokens=5)["turn_id"])
    # A turn asked again with its key is answered from the first delivery: not billed again.
    again = httpx.post(
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json={"content": "once", "max_tokens": 4},
        headers={**bob.api_headers, "Idempotency-Key": "k1"},
        timeout=60,
    )
    assert again.status_code == 200, again.text
    repeat = httpx.post(
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json={"content": "once", "max_tokens": 4},
        headers={**bob.api_headers, "Idempotency-Key": "k1"},
        timeout=60,
    )
    assert repeat.json()["turn_id"] == again.json()["turn_id"]
    bob_gens.append(again.json()["turn_id"])

    want = {"alice": _layer0_tokens(mesh, alice_gens), "bob": _layer0_tokens(mesh, bob_gens)}
    assert want["alice"][0] >= 6 and want["bob"][0] > want["alice"][0]
    deadline = time.monotonic() + 15  # records reach the database as attempts end
    while True:
        got = _billing(mesh)
        tenants = {t["tenant"]: t for t in got["tenants"]}
        have = {
            name: (tenants[name]["billable_tokens"], tenants[name]["billable_layer_tokens"])
            for name in want
            if name in tenants
        }
        if have == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert have == want
    assert tenants["alice"]["billable_generations"] == 1
    assert tenants["bob"]["billable_generations"] == 3
    # Every billable layer-token a tenant pays is earned by exactly one node.
    earned = sum(n["billable_layer_tokens"] for n in got["nodes"])
    assert earned == sum(t["billable_layer_tokens"] for t in got["tenants"])
    assert {n["node_id"] for n in got["nodes"] if n["billable_layer_tokens"]} == {
        "node-0",
        "node-1",
    }


def test_billing_is_for_the_admin_only(mesh: LocalMesh) -> None:
    carol = _tenant(mesh, "carol")
    assert httpx.get(f"{mesh.url}/admin/billing", headers=carol.api_headers).status_code == 401
    assert httpx.get(f"{mesh.url}/admin/billing").status_code == 401
