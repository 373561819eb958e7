"""What handlers take as parameters instead of reaching into the request: the app's state and the
caller's token, as FastAPI dependencies (``Annotated[..., Depends(...)]``).

The role and scope checks themselves are the dependency ``route()`` puts in front of every
authenticated route (server/auth.py ``require``); ``CurrentToken`` hands a handler the token that
check accepted. All are ``async def``: a plain ``def`` dependency runs in the thread pool, one
extra thread hop on every request of the hot routes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from cachectl.trust.tokens import TokenInfo

from .auth import current_token, forbidden, identify, unauthorized
from .state import ServerState

OVERWRITE_HEADER = "x-cachectl-overwrite"


def state_of(request: Request) -> ServerState:
    """This app's ServerState (for helpers that are handed the request, and the dependency)."""
    return request.app.state.cachectl


async def app_state(request: Request) -> ServerState:
    return state_of(request)


async def checked_token(request: Request) -> TokenInfo:
    """The token the route's role check accepted (``route()`` runs that check first)."""
    return current_token(request)


async def optional_token(request: Request) -> TokenInfo | None:
    """The caller's token if it sent a valid one; never refuses (a public route's extra detail)."""
    try:
        return await identify(request)
    except HTTPException:
        return None


async def metrics_reader(request: Request) -> TokenInfo | None:
    """/metrics: anyone when ``metrics_public``, else an unscoped reader token (401, 403)."""
    if state_of(request).settings.metrics_public:
        return None
    token = await identify(request)
    if token is None:
        raise unauthorized()
    if not token.allows("reader") or token.caches is not None:
        raise HTTPException(
            403, f"token {token.name!r} may not read metrics: it needs an unscoped token"
        )
    return token


async def may_overwrite(
    request: Request, token: Annotated[TokenInfo, Depends(checked_token)]
) -> bool:
    """Whether this write replaces an entry stored with other bytes: only when the caller asks
    with ``OVERWRITE_HEADER`` and holds admin on the cache (403 when it asks without)."""
    if request.headers.get(OVERWRITE_HEADER, "").strip().lower() not in ("1", "true", "yes"):
        return False
    if not token.allows("admin", request.path_params.get("cache", "")):
        raise forbidden(token, "overwrite entries: it needs role admin")
    return True


StateDep = Annotated[ServerState, Depends(app_state)]
CurrentToken = Annotated[TokenInfo, Depends(checked_token)]
OptionalToken = Annotated[TokenInfo | None, Depends(optional_token)]
Overwrite = Annotated[bool, Depends(may_overwrite)]
