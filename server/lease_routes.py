"""The compile lease for a process in server mode: the calls cachectl/index/compile_leases.py
runs on an index a process opens, run here on the server's index
(cachectl/service/compile_lease.py ``RemoteLessor`` is the client).

Reading the lease (look, recorded) needs the reader role; taking, renewing, hedging,
finishing and releasing one need the writer role: only a process that may write the cache compiles for others.

The server names holders: a caller's holder is ``token<id>|<tag>``, its token's id with the tag
it asked for as a suffix (``holder_for``), so no token acts as another's holder. A take or renew
lives at most the server's ``lease_max_ttl_s`` (CACHECTL_SERVER_LEASE_MAX_TTL, 60 s; a larger
ask is clamped, and the answer's ``left_s`` says what was granted). Finishing or releasing a
lease that is another holder's is refused (403; a hedger may record its write). A lease
statement that waits past its lock or statement timeout answers 503. A key's recorded compile
time, which every waiter of a cold key asks for at once, is remembered for
``token_cache_s`` (ServerState.compile_ms; a finish through this replica forgets it).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse

from cachectl.core.errors import BadInput
from cachectl.index import compile_leases as q
from cachectl.trust.tokens import TokenInfo

from . import responses as out
from . import schemas
from .api import CacheName, Digest
from .auth import route
from .deps import CurrentToken, StateDep
from .responses import errors, ok
from .state import ServerState

router = APIRouter(prefix="/api/v1")

PATH = "/caches/{cache}/environments/{digest}/compile-lease"
WRITES = ("take", "renew", "hedge", "finish", "release")
# What the holder's name keeps of the tag a caller asked for (its host, pid and a nonce).
MAX_TAG = 200


def holder_for(token: TokenInfo, tag: str) -> str:
    """The holder a caller acts as: its token's, with its tag as a suffix."""
    return f"token{token.id}|{tag[:MAX_TAG]}"


def _refuse_unless_owner(
    runner: q.Runner, scope: str, key: str, holder: str, token: TokenInfo, action: str, hedged: bool
) -> None:
    """403 when ``key``'s lease is another holder's (a hedger may record its write: ``hedged``)."""
    owners = q.owners(runner, scope, key)
    if owners is None or owners[0] == holder or (hedged and owners[1] == holder):
        return
    raise HTTPException(
        403, f"token {token.name!r} may not {action} compile lease {key}: another holder's"
    )


def _need(value: str | None, name: str) -> str:
    if not value:
        raise BadInput(f"this compile-lease call needs {name!r}")
    return value


def _runner(state: ServerState) -> q.Runner:
    runner = q.runner_for(state.index)
    if runner is None:  # the server's index is always SQL; a guard for the type checker
        raise HTTPException(503, "the server's index runs no SQL")
    return runner


@route(
    router,
    "POST",
    PATH,
    role="writer",
    summary="Take, renew, hedge, finish or release a program's compile lease",
    response_model=out.CompileLeaseOut,
    responses=errors(400, 403, 404, 503),
)
def compile_lease(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    body: schemas.CompileLeaseIn,
) -> JSONResponse:
    if body.action not in WRITES:
        raise BadInput(f"{body.action!r} is a read: POST it to {PATH}/read")
    env = state.where(cache, digest)[1]
    runner, scope = _runner(state), f"{cache}/{env.digest}"
    key = _need(body.key, "key")
    holder = holder_for(token, _need(body.holder, "holder"))
    max_ttl = state.settings.lease_max_ttl_s
    result: object
    if body.action == "take":
        got = q.take(
            runner,
            scope,
            key,
            holder,
            ttl_s=body.ttl_s,
            module=body.module,
            stale_sha256=body.stale,
            max_ttl_s=max_ttl,
        )
        result = got.to_json() if got else None
    elif body.action == "renew":
        result = q.renew(runner, scope, key, holder, ttl_s=body.ttl_s, max_ttl_s=max_ttl)
    elif body.action == "hedge":
        result = q.hedge(runner, scope, key, holder)
    elif body.action == "release":
        _refuse_unless_owner(runner, scope, key, holder, token, "release", hedged=False)
        result = q.release(runner, scope, key, holder)
    else:
        written = body.sha256 is not None
        _refuse_unless_owner(runner, scope, key, holder, token, "finish", hedged=written)
        result = q.finish(
            runner, scope, key, holder, sha256=body.sha256, compile_ms=body.compile_ms
        )
        state.compile_ms_changed(scope, key)
    return ok({"result": result})


@route(
    router,
    "POST",
    PATH + "/read",
    role="reader",
    summary="Read a program's compile lease, or how long its key took to compile",
    response_model=out.CompileLeaseOut,
    responses=errors(400, 404, 503),
)
def read_compile_lease(
    state: StateDep,
    token: CurrentToken,
    cache: CacheName,
    digest: Digest,
    body: schemas.CompileLeaseIn,
) -> JSONResponse:
    if body.action not in ("look", "recorded"):
        raise BadInput(f"{body.action!r} is a write: POST it to {PATH}")
    env = state.where(cache, digest)[1]
    runner = _runner(state)
    if body.action == "recorded":
        key, scope = _need(body.key, "key"), f"{cache}/{env.digest}"
        ms = state.compile_ms(
            scope, key, lambda: q.recorded_ms(runner, scope, cache, env.digest, key)
        )
        return ok({"result": ms})
    seen = q.look(runner, f"{cache}/{env.digest}", _need(body.key, "key"))
    return ok({"result": seen.to_json() if seen else None})
