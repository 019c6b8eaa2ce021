"""Tenants, their API keys and quotas, the admin tokens, and who owns each session.

Only SHA-256 digests of keys and tokens are stored; a key is found by its id
and its digest compared in constant time. Verified keys are remembered for a
few seconds, so a revoked key stops working within ``CACHE_S``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import asdict, dataclass, fields

from meshnet.auth.credentials import api_key_id, new_api_key
from meshnet.auth.keys import digest, same
from meshnet.errors import NotFound, RequestError, Unauthenticated
from meshnet.tracker.storage.database import Database, Row

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    created DOUBLE PRECISION NOT NULL,
    requests_per_min BIGINT NOT NULL,
    tokens_per_min BIGINT NOT NULL,
    max_streams BIGINT NOT NULL,
    max_sessions BIGINT NOT NULL,
    max_kv_bytes BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    revoked INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS admin_tokens (
    digest TEXT PRIMARY KEY,
    created DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS session_owners (
    session_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL
)
"""

DEFAULT_TENANT = "default"
CACHE_S = 5.0
_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_ADMIN_TOKENS = 16


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; 0 is no limit."""

    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_streams: int = 0
    max_sessions: int = 0
    max_kv_bytes: int = 0


@dataclass(frozen=True)
class Tenant:
    id: str
    quotas: Quotas


class TenantStore:
    """The tenancy tables in the tracker's database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        db.create_schema(SCHEMA)
        self._cache: dict[str, tuple[float, Tenant]] = {}
        self._lock = threading.Lock()

    # --- tenants and keys (admin) ---

    def create_tenant(self, tenant_id: str, quotas: Quotas) -> Tenant:
        if not _TENANT_ID.fullmatch(tenant_id):
            raise RequestError("a tenant id has 1 to 64 letters, digits, '.', '_' or '-'")
        q = asdict(quotas)
        columns = ", ".join(q)
        marks = ", ".join("?" for _ in q)
        updates = ", ".join(f"{c} = excluded.{c}" for c in q)
        self.db.run(
            f"INSERT INTO tenants (id, created, {columns}) VALUES (?, ?, {marks}) "
            f"ON CONFLICT (id) DO UPDATE SET {updates}",
            (tenant_id, time.time(), *q.values()),
        )
        self._forget()
        return Tenant(tenant_id, quotas)

    def tenant(self, tenant_id: str) -> Tenant:
        rows = self.db.query(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE id = ?", (tenant_id,))
        if not rows:
            raise NotFound(f"no tenant {tenant_id!r}")
        return _tenant(rows[0])

    def tenants(self) -> list[Tenant]:
        rows = self.db.query(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY id")
        return [_tenant(r) for r in rows]

    def issue_key(self, tenant_id: str) -> tuple[str, str]:
        """A new API key for the tenant: (key, key id). The key is shown only now."""
        self.tenant(tenant_id)
        key, key_id = new_api_key()
        self.add_key(tenant_id, key)
        return key, key_id

    def add_key(self, tenant_id: str, key: str) -> None:
        key_id = api_key_id(key)
        if key_id is None:
            raise RequestError("a malformed API key")
        self.db.run(
            "INSERT INTO api_keys (id, tenant_id, digest, created, revoked) VALUES (?, ?, ?, ?, 0) "
            "ON CONFLICT (id) DO NOTHING",
            (key_id, tenant_id, digest(key), time.time()),
        )

    def revoke_key(self, key_id: str) -> None:
        if not self.db.run("UPDATE api_keys SET revoked = 1 WHERE id = ?", (key_id,)):
            raise NotFound(f"no API key {key_id!r}")
        self._forget()

    def add_admin_token(self, token: str) -> None:
        self.db.run(
            "INSERT INTO admin_tokens (digest, created) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (digest(token), time.time()),
        )

    # --- checks on every request ---

    def authenticate(self, key: str) -> Tenant:
        """The tenant whose live API key ``key`` is; ``Unauthenticated`` otherwise."""
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
        key_id = api_key_id(key)
        rows = (
            self.db.query(
                "SELECT tenant_id, digest FROM api_keys WHERE id = ? AND revoked = 0", (key_id,)
            )
            if key_id
            else []
        )
        if not rows or not same(str(rows[0][1]), digest(key)):
            raise Unauthenticated("invalid API key")
        tenant = self.tenant(str(rows[0][0]))
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = (now, tenant)
        return tenant

    def is_admin(self, token: str) -> bool:
        rows = self.db.query("SELECT digest FROM admin_tokens LIMIT ?", (_MAX_ADMIN_TOKENS,))
        wanted = digest(token)
        return any(same(str(r[0]), wanted) for r in rows)

    # --- session ownership ---

    def own(self, session_id: str, tenant_id: str) -> None:
        self.db.run(
            "INSERT INTO session_owners (session_id, tenant_id) VALUES (?, ?)",
            (session_id, tenant_id),
        )

    def owner(self, session_id: str) -> str | None:
        rows = self.db.query(
            "SELECT tenant_id FROM session_owners WHERE session_id = ?", (session_id,)
        )
        return str(rows[0][0]) if rows else None

    def owned(self, tenant_id: str) -> list[str]:
        rows = self.db.query(
            "SELECT session_id FROM session_owners WHERE tenant_id = ?", (tenant_id,)
        )
        return [str(r[0]) for r in rows]

    def purge_orphans(self, limit: int) -> int:
        """Delete up to ``limit`` ownership rows whose session is no longer kept (retention)."""
        return self.db.run(
            "DELETE FROM session_owners WHERE session_id IN ("
            " SELECT o.session_id FROM session_owners o"
            " LEFT JOIN sessions s ON s.id = o.session_id WHERE s.id IS NULL LIMIT ?)",
            (limit,),
        )

    def _forget(self) -> None:
        with self._lock:
            self._cache.clear()


_TENANT_COLUMNS = ", ".join(["id", *(f.name for f in fields(Quotas))])


def _tenant(row: Row) -> Tenant:
    return Tenant(str(row[0]), Quotas(*(int(v) for v in row[1:])))
