"""Tenants' API keys and quotas, the admin token, session owners (a real SQLite database)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet.api.quotas import QuotaGate, check_kv, check_sessions
from meshnet.api.tenants import Quotas, Tenant, TenantStore
from meshnet.auth.credentials import new_admin_token, new_api_key
from meshnet.auth.keys import digest
from meshnet.errors import NotFound, QuotaExceeded, RequestError, Unauthenticated
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.storage.database import open_database


@pytest.fixture
def tenants(tmp_path: Path) -> TenantStore:
    return TenantStore(open_database(tmp_path / "t.db"))


def test_a_key_authenticates_its_tenant_until_revoked(tenants: TenantStore) -> None:
    tenants.create_tenant("acme", Quotas(max_streams=3))
    key, key_id = tenants.issue_key("acme")
    assert tenants.authenticate(key) == Tenant("acme", Quotas(max_streams=3))
    stored = tenants.db.query("SELECT digest FROM api_keys WHERE id = ?", (key_id,))
    assert stored == [(digest(key),)]  # the key itself is not kept
    tenants.revoke_key(key_id)
    with pytest.raises(Unauthenticated):
        tenants.authenticate(key)


def test_a_wrong_or_malformed_key_is_refused(tenants: TenantStore) -> None:
    tenants.create_tenant("acme", Quotas())
    key, _ = tenants.issue_key("acme")
    forged = key[:-4] + ("0000" if not key.endswith("0000") else "1111")
    for bad in (forged, new_api_key()[0], "", "mk_short_x", "Bearer " + key):
        with pytest.raises(Unauthenticated):
            tenants.authenticate(bad)
    with pytest.raises(NotFound):
        tenants.issue_key("nobody")
    with pytest.raises(RequestError):
        tenants.create_tenant("../etc", Quotas())


def test_only_a_registered_admin_token_is_admin(tenants: TenantStore) -> None:
    token = new_admin_token()
    assert not tenants.is_admin(token)
    tenants.add_admin_token(token)
    assert tenants.is_admin(token)
    assert not tenants.is_admin(new_admin_token())


def test_sessions_have_one_owner_until_retention_drops_the_session(
    tenants: TenantStore,
) -> None:
    sessions = SessionStore(tenants.db)
    kept = sessions.create("s1", None, 1.0)
    tenants.own(kept.id, "acme")
    tenants.own("s2", "acme")  # a session retention has deleted
    assert tenants.owner("s1") == "acme"
    assert tenants.owner("s3") is None
    assert sorted(tenants.owned("acme")) == ["s1", "s2"]
    assert tenants.purge_orphans(10) == 1
    assert tenants.owned("acme") == ["s1"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refuse_with_the_wait_until_room() -> None:
    clock = Clock()
    gate = QuotaGate(clock)
    tenant = Tenant("t", Quotas(requests_per_min=2))
    gate.admit(tenant, stream=False)
    clock.now += 10
    gate.admit(tenant, stream=False)
    with pytest.raises(QuotaExceeded) as refused:
        gate.admit(tenant, stream=False)
    assert refused.value.retry_after_s == 50
    assert refused.value.http_status == 429
    clock.now += 50
    gate.admit(tenant, stream=False)
    other = Tenant("u", Quotas(requests_per_min=2))
    gate.admit(other, stream=False)  # another tenant's window is its own


def test_tokens_per_minute_count_prompts_and_generated_tokens() -> None:
    clock = Clock()
    gate = QuotaGate(clock)
    tenant = Tenant("t", Quotas(tokens_per_min=100))
    slot = gate.admit(tenant, prompt_tokens=60, stream=False)
    slot.charge(30)
    with pytest.raises(QuotaExceeded):
        gate.admit(tenant, prompt_tokens=20, stream=False)
    clock.now += 61
    gate.admit(tenant, prompt_tokens=20, stream=False)


def test_streams_are_held_until_their_slot_ends() -> None:
    gate = QuotaGate(Clock())
    tenant = Tenant("t", Quotas(max_streams=2))
    a, b = gate.admit(tenant), gate.admit(tenant)
    with pytest.raises(QuotaExceeded):
        gate.admit(tenant)
    a.end()
    a.end()  # once only
    c = gate.admit(tenant)
    assert gate.streams("t") == 2
    b.end()
    c.end()
    assert gate.streams("t") == 0


def test_sessions_and_kv_bytes_quotas() -> None:
    tenant = Tenant("t", Quotas(max_sessions=2, max_kv_bytes=1000))
    check_sessions(tenant, 1)
    with pytest.raises(QuotaExceeded):
        check_sessions(tenant, 2)
    check_kv(tenant, 999)
    with pytest.raises(QuotaExceeded):
        check_kv(tenant, 1000)
    check_sessions(Tenant("u", Quotas()), 10**6)  # 0 is no limit
