"""FastAPI dependencies: the runtime, the caller's bearer token, and the admin check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from loraplane.dataplane.server.catalog import Catalog, check_api_key
from loraplane.dataplane.server.errors import Forbidden, NotFound, Unauthorized
from loraplane.dataplane.server.rollout import ROLLOUT_KEY_HEADER
from loraplane.dataplane.server.runtime import Runtime
from loraplane.redact import key_problem


def get_runtime(request: Request) -> Runtime:
    """The runtime built at start."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def bearer_token(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


TokenDep = Annotated[str | None, Depends(bearer_token)]


def caller_key(runtime: RuntimeDep, token: TokenDep) -> str | None:
    """The caller's API key, checked before the body is looked at.

    Standalone with --api-key: that key or 401. Catalog mode: some key (the catalog checks
    it). Standalone without --api-key: anyone.
    """
    settings = runtime.settings
    if settings.controlplane_url:
        if token is None:
            raise Unauthorized("send Authorization: Bearer <your API key>")
        problem = key_problem(token)  # no tenant key has this form: say how, not "unknown"
        if problem is not None:
            raise Unauthorized(f"malformed API key: {problem}")
    elif settings.api_key is not None and not check_api_key(settings.api_key, token):
        raise Unauthorized("Incorrect API key provided: send Authorization: Bearer <key>.")
    return token


CallerKeyDep = Annotated[str | None, Depends(caller_key)]

# a weighted rollout's sticky key (rollout.py): the same key gets the same version
RolloutKeyDep = Annotated[
    str | None,
    Header(
        alias=ROLLOUT_KEY_HEADER,
        max_length=1024,
        description="under a weighted rollout, requests with the same key (this header, else"
        " the body's `user`) get the same version while the weights stay (default: random)",
    ),
]


def get_catalog(runtime: RuntimeDep) -> Catalog:
    """The catalog (503 until the server is ready)."""
    runtime.require_engine()
    assert runtime.catalog is not None
    return runtime.catalog


CatalogDep = Annotated[Catalog, Depends(get_catalog)]


def require_admin(runtime: RuntimeDep, token: TokenDep) -> None:
    """The admin token, or 401 (wrong token) / 404 (no admin token configured: disabled)."""
    expected = runtime.settings.admin_token
    if expected is None:
        raise NotFound("adapter management is disabled (no admin token configured)")
    if token is None:
        raise Unauthorized("this route needs the admin token")
    if not check_api_key(expected, token):
        raise Forbidden("this route needs the admin token")


AdminDep = Annotated[None, Depends(require_admin)]
