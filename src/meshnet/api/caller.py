"""Who calls a generation endpoint: a tenant (its API key), or an operator naming a route.

Generations are tenant traffic: a tenant's API key, metered by its quotas. A
request that names its route (``meshnet.route``) is an operator's tool, so it
needs the admin token instead: a tenant naming one is refused (403), and the
admin token on a request that names none is not an API key (401, as before).
The admin's generations count against no tenant's quotas; the tracker's
admission (capacity per tracker and per node) takes them like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol

from fastapi import Depends, Request

from meshnet.api.auth import auth_of, require_admin, require_tenant
from meshnet.api.tenants import Tenant
from meshnet.errors import PermissionDenied, Unauthenticated
from meshnet.tracker.accounting import billing


class Meter(Protocol):
    """What a generation's tokens are charged to; ``end`` when it ends (once)."""

    def charge(self, tokens: int) -> None: ...

    def end(self) -> None: ...


class Unmetered:
    """The meter of an operator's generation: no tenant's quota counts it."""

    def charge(self, tokens: int) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class Caller:
    tenant: Tenant | None  # None: the admin token

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    @property
    def billed_to(self) -> str:
        """Whom the caller's generations are billed to (the ledger's usage per tenant)."""
        return billing.ADMIN if self.tenant is None else self.tenant.id

    def check_route(self, route: Sequence[str] | None) -> None:
        """Naming a route needs the admin token; the admin token needs a named route."""
        if route is not None and not self.is_admin:
            raise PermissionDenied("naming a route (meshnet.route) needs the admin token")
        if route is None and self.is_admin:
            raise Unauthenticated("the admin token is not an API key: send a tenant's API key")

    def admit(self, request: Request, prompt_tokens: int) -> Meter:
        """The tenant's quota slot for one generation (``QuotaExceeded`` when over)."""
        if self.tenant is None:
            return Unmetered()
        return auth_of(request).quotas.admit(self.tenant, prompt_tokens)


async def require_caller(request: Request) -> Caller:
    """A tenant's API key, else the admin token; 401 (the API key's reason) for neither."""
    try:
        return Caller(await require_tenant(request))
    except Unauthenticated as not_a_tenant:
        try:
            await require_admin(request)
        except Unauthenticated:
            raise not_a_tenant from None
        return Caller(None)


AnyCaller = Annotated[Caller, Depends(require_caller)]
