"""Who is calling the tracker's HTTP API: a tenant's API key, the admin token, or a node.

Users send ``Authorization: Bearer <api key>`` (what the OpenAI clients send);
admins ``Authorization: Bearer <admin token>``; nodes sign their requests
(``meshnet.auth.signing``). Anything else is 401 before the handler runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from meshnet.api.quotas import QuotaGate
from meshnet.api.tenants import Tenant, TenantStore
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.auth.signing import request_signer, verify_request
from meshnet.errors import NotFound, PermissionDenied, Unauthenticated

_MAX_BEARER = 256


@dataclass(frozen=True)
class TrackerAuth:
    tenants: TenantStore
    keys: MeshKeys
    quotas: QuotaGate


def auth_of(request: Request) -> TrackerAuth:
    return request.app.state.auth  # type: ignore[no-any-return]  # app.state is untyped


def _bearer(request: Request) -> str:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value or len(value) > _MAX_BEARER:
        raise Unauthenticated("send 'Authorization: Bearer <API key>'")
    return value.strip()


async def require_tenant(request: Request) -> Tenant:
    """The tenant of the request's API key."""
    key = _bearer(request)
    return await run_in_threadpool(auth_of(request).tenants.authenticate, key)


async def require_admin(request: Request) -> None:
    token = _bearer(request)
    if not await run_in_threadpool(auth_of(request).tenants.is_admin, token):
        raise Unauthenticated("this endpoint needs the admin token")


async def require_node(request: Request) -> str:
    """The node id whose key signed this request."""
    header = request.headers.get("authorization", "")
    node_id = request_signer(header)
    body = await request.body()
    key = auth_of(request).keys.node_key(node_id)
    verify_request(key, header, request.method, request.url.path, body)
    return node_id


CallingTenant = Annotated[Tenant, Depends(require_tenant)]
CallingNode = Annotated[str, Depends(require_node)]


def require_same_node(caller: str, claimed: str) -> None:
    if caller != claimed:
        raise PermissionDenied(f"node {caller} cannot speak for node {claimed}")


def require_owner(request: Request, tenant: Tenant, session_id: str) -> None:
    """A session another tenant owns (or none does) is not found."""
    if auth_of(request).tenants.owner(session_id) != tenant.id:
        raise NotFound(f"no session {session_id!r}")
