"""FastAPI dependencies: the service context, a database session, and who is calling.

Authorization is `Authorization: Bearer <token>` only, and fails closed: a credential that
cannot be checked (the database is down) is refused with 503, never waved through.
Dependencies that do no I/O are `async` so they cost no trip through the threadpool.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from loraplane.controlplane import security
from loraplane.controlplane.context import AppContext
from loraplane.controlplane.crud.keys import authenticate
from loraplane.controlplane.errors import RateLimited, Unauthorized
from loraplane.controlplane.models import ApiKey, Tenant
from loraplane.controlplane.schemas.common import DNS_LABEL

_bearer = HTTPBearer(auto_error=False, description="admin token, service token or tenant key")


async def get_context(request: Request) -> AppContext:
    """The service context built at start."""
    ctx: AppContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_session(ctx: ContextDep) -> Iterator[Session]:
    """A session for one request, closed (and rolled back if unfinished) afterwards."""
    session = ctx.sessions()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("send Authorization: Bearer <token>")
    return credentials.credentials


async def require_admin(ctx: ContextDep, credentials: Credentials) -> str:
    """The admin caller (its audit actor name); Unauthorized for any other credential."""
    if not security.token_matches(_token(credentials), ctx.admin_token):
        raise Unauthorized("this route needs the admin token")
    return "admin"


async def require_service(ctx: ContextDep, credentials: Credentials) -> str:
    """The data plane or operator (the service token); Unauthorized otherwise."""
    if not security.token_matches(_token(credentials), ctx.service_token):
        raise Unauthorized("this route needs the service token")
    return "service"


@dataclass(frozen=True, slots=True)
class Caller:
    """A tenant calling with one of its keys."""

    tenant: Tenant
    key: ApiKey

    @property
    def actor(self) -> str:
        """How the audit trail names this caller (never the key itself)."""
        return f"tenant:{self.tenant.name}/key:{self.key.prefix}"


def current_tenant(
    request: Request, ctx: ContextDep, session: SessionDep, credentials: Credentials
) -> Caller:
    """The tenant whose live key this is, within its rate limit."""
    token = _token(credentials)
    if security.key_prefix(token) is None:
        raise Unauthorized(security.not_a_key(token, ctx.admin_token))
    key = authenticate(session, secret=token)
    request.state.tenant = key.tenant.name  # for the access log's line (accesslog.py)
    wait = ctx.limiter.acquire(key.id, key.tenant.requests_per_minute)
    if wait is not None:
        raise RateLimited(
            f"key {key.prefix} is over its tenant's {key.tenant.requests_per_minute} requests "
            "per minute",
            retry_after=wait,
        )
    return Caller(key.tenant, key)


AdminDep = Annotated[str, Depends(require_admin)]
ServiceDep = Annotated[str, Depends(require_service)]
CallerDep = Annotated[Caller, Depends(current_tenant)]
# `?namespace=` of the routes that name one pool (its ServingPool's namespace; default "default")
PoolNamespace = Annotated[
    str,
    Query(min_length=1, max_length=63, pattern=DNS_LABEL, description="the pool's namespace"),
]
