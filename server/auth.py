"""Who is calling: bearer tokens checked against the index, roles and cache scopes.

Each route declares the role it needs and how cache scope applies, through
``route()``; the declaration is both the check and the route's OpenAPI
metadata (``x-cachectl-role`` / ``x-cachectl-scope``), so tests can walk the
route table. Failures never echo the token: 401 says only that the token is
missing, unknown, expired or revoked; 403 names the token's *name* and role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from cachectl.core.errors import NotFound
from cachectl.trust.tokens import (
    ROLES,
    InvalidToken,
    TokenInfo,
    authenticate,
    authenticate_session,
    hash_token,
)

from .recent import Recent
from .responses import errors, json_bodies

PUBLIC = "public"
ROLE_KEY = "x-cachectl-role"
SCOPE_KEY = "x-cachectl-scope"
# How a token's cache scope applies to a route:
#   cache  - the route's {cache} must be in the scope;
#   any    - any token with the role; the handler shows only caches in scope;
#   object - any token with the role; the handler checks the cache of the object
#            the request names (a job's cache, each telemetry batch's cache);
#   global - only tokens without a cache scope (tokens, metrics: they span caches).
SCOPES = ("cache", "any", "object", "global")
# The dashboard's session cookie (cachectl.trust.tokens.issue_session: never the token itself).
COOKIE_NAME = "cachectl_session"
# Where BodyGuard leaves the token it checked, so the route's dependency need not ask again.
CHECKED_KEY = "cachectl_checked_token"
UNAUTHORIZED = "missing, unknown, expired or revoked token: send 'Authorization: Bearer <token>'"


class TokenCache:
    """Valid tokens by hash (server/recent.py: refused at the latest ``ttl_s`` after a revocation
    elsewhere, at once when revoked through this replica). Expiry is checked on every use."""

    def __init__(self, ttl_s: float) -> None:
        self._recent: Recent[str, TokenInfo] = Recent(ttl_s)

    def get(self, token: str) -> TokenInfo | None:
        info = self._recent.get(hash_token(token))
        return info if info is not None and info.active else None

    def expires(self, token: str) -> float | None:
        """When a remembered valid token is asked for again (server/recent.py ``expires``); its own
        expiry, if sooner, is left to the caller's check (``TokenInfo.active``)."""
        return self._recent.expires(hash_token(token)) if self.get(token) is not None else None

    def put(self, token: str, info: TokenInfo) -> None:
        self._recent.put(hash_token(token), info)

    def forget(self, token: str) -> None:
        self._recent.forget(hash_token(token))

    def clear(self) -> None:
        self._recent.clear()


def bearer_token(request: Request) -> str | None:
    return bearer_value(request.headers.get("authorization"))


def bearer_value(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header's value, else None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def unauthorized() -> HTTPException:
    return HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": 'Bearer realm="cachectl"'})


def forbidden(token: TokenInfo, what: str) -> HTTPException:
    return HTTPException(403, f"token {token.name!r} (role {token.role}) may not {what}")


async def identify(request: Request, *, allow_cookie: bool = False) -> TokenInfo | None:
    """The caller's token, None when none was sent; 401 for a bad one.

    ``allow_cookie`` (the dashboard): without a bearer token, the session cookie's token."""
    token = bearer_token(request)
    state = request.app.state.cachectl
    checked = request.scope.get("state", {}).get(CHECKED_KEY)
    if token is not None and checked is not None and checked[0] == hash_token(token):
        return checked[1]  # BodyGuard checked this very token before the body was read
    if token is None and allow_cookie and request.cookies.get(COOKIE_NAME):
        try:
            return await run_in_threadpool(
                authenticate_session, state.index, request.cookies[COOKIE_NAME]
            )
        except InvalidToken:
            raise unauthorized() from None
    if token is None:
        return None
    cached = state.tokens.get(token)
    if cached is not None:
        return cached
    try:
        info = await run_in_threadpool(authenticate, state.index, token)
    except InvalidToken:
        raise unauthorized() from None
    state.tokens.put(token, info)
    return info


def check_cache(token: TokenInfo, role: str, cache: str) -> None:
    """403 unless ``token`` holds ``role`` for ``cache``."""
    refused = refusal(token, role, "cache", cache)
    if refused is not None:
        raise refused


def require(role: str, scope: str = "cache") -> Callable[..., Any]:
    """A dependency: the request's token, checked for ``role`` and ``scope``."""
    if role not in ROLES:
        raise ValueError(role)
    if scope not in SCOPES:
        raise ValueError(scope)

    async def dependency(request: Request) -> TokenInfo:
        token = await identify(request)
        if token is None:
            raise unauthorized()
        refused = refusal(token, role, scope, request.path_params.get("cache", ""))
        if refused is not None:
            raise refused
        request.state.token = token
        return token

    return dependency


def refusal(token: TokenInfo, role: str, scope: str, cache: str) -> HTTPException | None:
    """Why ``token`` may not call a route that needs ``role`` under ``scope`` (for the route's
    ``{cache}``, when it has one), as its 403; None when it may."""
    if not token.allows(role):
        return forbidden(token, f"do this: it needs role {role}")
    if scope == "cache" and not token.allows(role, cache):
        return forbidden(
            token, f"act on cache {cache!r}: it is scoped to {', '.join(token.caches or ())}"
        )
    if scope == "global" and token.caches is not None:
        return forbidden(token, "do this: it needs a token without a cache scope")
    return None


def hides_caches(request: Request, token: TokenInfo | None) -> bool:
    """True when a 404 for this request must not be answered as the library words it: a scoped
    token naming a cache in its scope that no longer exists would get the list of every cache."""
    if token is None or token.caches is None:
        return False
    cache = request.path_params.get("cache")
    if not cache:
        return False
    try:
        request.app.state.cachectl.index.get_cache(cache)
    except NotFound:
        return True
    return False


def current_token(request: Request) -> TokenInfo:
    return request.state.token


def route(
    router: APIRouter,
    method: str,
    path: str,
    *,
    role: str,
    scope: str = "cache",
    enforce: bool = True,
    **kwargs: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a route with the role it needs; public routes skip authentication.

    ``enforce=False`` records the role but leaves the check to its own dependency
    (the dashboard and /metrics, which can be configured public). An enforced route documents
    the refusals any authenticated request may get: its token (401, 403), its body at the edge
    (413, 422; server/limits.py) and an index that does not answer (503).
    """
    extra = {ROLE_KEY: role, SCOPE_KEY: scope if role != PUBLIC else PUBLIC}
    extra.update(kwargs.pop("openapi_extra", None) or {})
    dependencies = list(kwargs.pop("dependencies", None) or [])
    responses = dict(kwargs.pop("responses", None) or {})
    if role != PUBLIC and enforce:
        dependencies.insert(0, Depends(require(role, scope)))
        responses = {**errors(401, 403, 413, 422, 503), **responses}
    media_type = getattr(kwargs.get("response_class"), "media_type", "application/json")
    if media_type != "application/json":
        responses = json_bodies(responses)
    return router.api_route(
        path,
        methods=[method],
        dependencies=dependencies,
        openapi_extra=extra,
        responses=responses,
        **kwargs,
    )
