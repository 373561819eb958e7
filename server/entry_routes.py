"""Entry bytes over HTTP: PUT (writers), GET (read whole up to WHOLE, streamed above) and HEAD.

An upload is checked before anything is stored, in this order: the key is a
JAX key and nothing else (no '/', no '..', no leading dot), the environment
exists, the body fits the cache's max entry size (413, read no further; it is
streamed to a temporary file, never held in memory), the bytes decompress
into a JAX entry (422) in one streaming pass that stops at a bound tied to
that size (413), the key holds no other bytes already (409, unless an admin
says to overwrite: audited), and the quota is reserved in the index
atomically (413). Only then is it written, atomically; a full disk is 507. The rules are
cachectl/storage/ingest.py's (its checks in ingest_rules.py; this module streams the body and
turns refusals into statuses).
Downloads serve only regular files inside the namespace (no symlinks); a download is located in
the index and opened in one worker-thread hop. Under `cachectl serve` a file on local disk is then
handed to the server whole, which sends it with ``sendfile`` (server/zero_copy.py: uvicorn offers
no zero-copy send of its own); elsewhere (an object store, a server without the extension) it is
read in that hop (up to WHOLE) and written, or streamed. A GET or HEAD that every check passes is
answered by server/fast_lane.py with this module's functions, before FastAPI routes it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cachectl.core.errors import EntryConflict, QuotaExceeded
from cachectl.core.units import format_size
from cachectl.index import CacheInfo, EnvironmentInfo, NewEntry, warm_runs
from cachectl.index import server_queries as sq
from cachectl.storage import ingest, ingest_rules
from cachectl.storage.entries import CACHE_SUFFIX, MAX_KEY_LENGTH, EntryName, parse_key

from . import responses as out
from . import schemas, zero_copy
from .accel import ACCEL_HEADER, accel_uri
from .api import CacheName, Digest
from .auth import route
from .config import EXPANSION_RATIO, ServerSettings
from .deps import OVERWRITE_HEADER, CurrentToken, Overwrite, StateDep, state_of
from .responses import errors, ok, refusal
from .state import ServerState

router = APIRouter(prefix="/api/v1")
ENTRY_ROUTE = "/caches/{cache}/environments/{digest}/entries/{key}"

# <module>-<64 hex>: the module part as JAX sanitizes it (word characters, '.', '-'),
# never starting with a dot, so no key can name a path outside its namespace; at most
# MAX_KEY_LENGTH characters, so that a file system can name each of its files (a longer one
# was a 500, "file name too long").
KEY_PATTERN = rf"^[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,{MAX_KEY_LENGTH - 66}}}-[0-9a-f]{{64}}$"
_KEY_RE = re.compile(KEY_PATTERN)
Key = Annotated[
    str,
    Path(
        min_length=66,
        max_length=MAX_KEY_LENGTH,
        pattern=KEY_PATTERN,
        description="A JAX cache key: <module>-<64 hex>, without the -cache suffix",
    ),
]
SHA_HEADER = "x-cachectl-sha256"
# An admin replacing an entry that is stored with other bytes says so with OVERWRITE_HEADER
# (server/deps.py ``may_overwrite``).
# A download up to WHOLE is read into memory in the same thread hop as its open and sent in one
# write, while one of WHOLE_SLOTS is free (held until the response is sent); any other streams in
# CHUNK-sized reads. Whole bodies held at once in a process: 16 x 4 MiB = 64 MiB at most.
WHOLE = 4 << 20
CHUNK = 1 << 20
WHOLE_SLOTS = threading.BoundedSemaphore(16)


def is_key(key: str) -> bool:
    """Whether ``check_key`` accepts ``key``: its pattern implies ``parse_key``'s, so one match
    (server/fast_lane.py asks this on every request; no EntryName, no exception)."""
    return _KEY_RE.match(key) is not None


def check_key(key: str) -> EntryName:
    parsed = parse_key(key) if _KEY_RE.match(key) else None
    if parsed is None:
        raise HTTPException(
            422, "bad entry key: use <module>-<64 hex digits> as JAX names it (no path)"
        )
    return parsed


def entry_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{CACHE_SUFFIX}"


def _resolve(state: ServerState, cache: str, digest: str) -> tuple[CacheInfo, EnvironmentInfo]:
    found = sq.locate(state.index, cache, digest)
    return found.cache, found.environment


def _too_large(what: str) -> HTTPException:
    return HTTPException(413, what)


# Why cachectl.storage.ingest refused an upload (ingest_rules' rule), as the HTTP status the client gets.
_REFUSED_STATUS = {
    ingest_rules.SHA256: 422,
    ingest_rules.CORRUPT: 422,
    ingest_rules.EXECUTABLE: 422,
    ingest_rules.MISMATCH: 422,
    ingest_rules.TOO_LARGE: 413,
    ingest_rules.EXPANDS: 413,
}


def refused(exc: ingest_rules.Refused) -> HTTPException:
    return HTTPException(_REFUSED_STATUS[exc.rule], exc.message)


def disk_full() -> HTTPException:
    """507 for a full disk or quota (ENOSPC, EDQUOT): the client may retry elsewhere or later."""
    return HTTPException(507, "insufficient storage: the server's disk is full; nothing stored")


async def receive_body(
    request: Request, limit: int, what: str, directory: str | None
) -> ingest.Spool:
    """Stream the body to a spool file, hashed as it goes; 413 past ``limit`` (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise HTTPException(400, "bad Content-Length header") from None
        if length > limit:
            raise _too_large(
                f"entry of {format_size(length)} is above {what} ({format_size(limit)}): nothing stored"
            )
    upload = ingest.Spool(directory)
    try:
        async for chunk in request.stream():
            if upload.size + len(chunk) > limit:
                raise _too_large(f"entry is above {what} ({format_size(limit)}): nothing stored")
            await run_in_threadpool(upload.write, chunk)
        return upload.finish()
    except BaseException as exc:
        upload.discard()
        if ingest.is_disk_full(exc):
            raise disk_full() from None
        raise


def expansion_limit(settings: ServerSettings, limit: int) -> int:
    """How far an upload may decompress: EXPANSION_RATIO times the size it may have on the wire
    (so a cache's max entry size bounds it too), never more than max_decompressed_bytes."""
    return min(settings.max_decompressed_bytes, max(limit, 1) * EXPANSION_RATIO)


def upload_limit(state: ServerState, info: CacheInfo) -> tuple[int, str]:
    return ingest_rules.size_limit(
        info, state.settings.max_upload_bytes, "the server's upload limit"
    )


def store_upload(
    state: ServerState, info: CacheInfo, env: EnvironmentInfo, fn: Any, *args: Any, **kwargs: Any
) -> ingest.Ingested:
    """Run an ingest call for an upload, its refusals as HTTP answers."""
    try:
        return fn(
            ingest.Target(state.index, info, env, state.store(info)),
            *args,
            claim_name=SHA_HEADER,
            **kwargs,
        )
    except ingest_rules.Refused as exc:
        raise refused(exc) from None
    except QuotaExceeded as exc:
        raise _too_large(exc.message) from None
    except EntryConflict as exc:  # 409, named: a client tells it from other failures
        raise EntryConflict(
            f"{exc.message}: send {OVERWRITE_HEADER}: true with an admin token"
        ) from None
    except OSError as exc:
        if ingest.is_disk_full(exc):
            raise disk_full() from None
        raise


class OctetStream(Response):
    """What the byte routes send (and document): the stored file's bytes, or none for HEAD."""

    media_type = "application/octet-stream"


# The request body of the byte uploads: FastAPI reads no body the handler does not declare.
BYTES_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
BYTES_HEADERS = {
    SHA_HEADER: {
        "description": "The sha256 the index recorded for these bytes (absent when unknown)",
        "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    },
    "ETag": {"description": "The recorded sha256, quoted", "schema": {"type": "string"}},
}


def upload_responses(stored: str, again: str, bad: str) -> dict[int | str, dict[str, Any]]:
    """A byte upload's answers: the entry's row (201 ``stored``, 200 ``again``), or a refusal."""
    return {
        201: {"model": out.EntryOut, "description": stored},
        200: {"model": out.EntryOut, "description": again},
        **errors(400, 404),
        **refusal(413, "too large for the cache, or it decompresses past its bound"),
        **refusal(422, bad),
        **refusal(507, "the server's disk is full: nothing stored"),
    }


def download_responses(what: str) -> dict[int | str, dict[str, Any]]:
    """A byte download's answers: the bytes with their recorded sha256, or a refusal."""
    return {200: {"description": what, "headers": BYTES_HEADERS}, **errors(400, 404, 422)}


@route(
    router,
    "PUT",
    ENTRY_ROUTE,
    role="writer",
    summary="Upload one entry (raw bytes as JAX wrote them)",
    openapi_extra=BYTES_BODY,
    response_model=out.EntryOut,
    responses={
        **upload_responses("stored", "already stored, or replaced", "not a JAX entry"),
        **refusal(409, "stored with other bytes"),
    },
)
async def put_entry(
    request: Request,
    token: CurrentToken,
    replace: Overwrite,
    cache: CacheName,
    digest: Digest,
    key: Key,
) -> JSONResponse:
    return await upload(
        request,
        cache,
        digest,
        key,
        ingest.ingest_entry,
        lambda state, limit: {
            "origin": "upload",
            "expand_to": expansion_limit(state.settings, limit),
            "replace_existing": replace,
            "who": f"token {token.name}",
        },
        lambda outcome: 201 if outcome == "inserted" else 200,
    )


async def upload(
    request: Request,
    cache: str,
    digest: str,
    key: str,
    ingest_fn: Callable[..., Any],
    fields: Callable[[ServerState, int], dict[str, Any]],
    status: Callable[[str], int],
) -> JSONResponse:
    """PUT of an entry or of its stored executable: the body spooled within the cache's limit, then
    checked, written and indexed by ``ingest_fn`` (cachectl/storage/ingest.py)."""
    state = state_of(request)
    parsed = check_key(key)
    info, env = await run_in_threadpool(_resolve, state, cache, digest)
    limit, what = upload_limit(state, info)
    body: ingest.Spool | None = None
    try:
        body = await receive_body(request, limit, what, state.settings.upload_dir)
        done = await run_in_threadpool(
            store_upload,
            state,
            info,
            env,
            ingest_fn,
            parsed,
            body,
            claimed_sha256=request.headers.get(SHA_HEADER),
            **fields(state, limit),
        )
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    finally:
        if body is not None:
            body.discard()
        state.entries_changed()
    state.metrics.uploads.labels(cache, "stored").inc()
    state.metrics.upload_bytes.labels(cache).inc(body.size)
    return ok(done.entry, status(done.outcome))


@dataclass(frozen=True)
class ByteRoute:
    """What differs between an entry's byte routes and its stored executable's."""

    path_of: Callable[[EnvironmentInfo, str], str]
    executable: bool
    missing: str  # the 404 text: {key}, {env} (a digest prefix), {cache}


ENTRY = ByteRoute(entry_path, False, "no entry {key} in environment {env} of cache {cache!r}")


def located(
    state: ServerState, cache: str, digest: str, key: str, route: ByteRoute = ENTRY
) -> tuple[CacheInfo, EnvironmentInfo, int, str | None]:
    """The object's cache, environment, size and recorded sha256; 404 when storage lacks it."""
    info, env = state.where(cache, digest)
    recorded = state.recorded(env.id, key, route.executable)
    try:
        size = state.store(info).size(route.path_of(env, key))
    except FileNotFoundError:
        raise HTTPException(
            404, route.missing.format(key=key, env=env.digest[:16], cache=cache)
        ) from None
    return info, env, size, recorded[1] if recorded and recorded[0] == size else None


@dataclass(frozen=True)
class Opened:
    """What a GET sends: the bytes (up to WHOLE) or the open file to stream or hand over (``sent``),
    its size, its recorded sha256."""

    body: bytes | Any
    size: int
    sha256: str | None
    sent: bool = False


def opened(
    state: ServerState,
    cache: str,
    digest: str,
    key: str,
    route: ByteRoute,
    *,
    zero_copy: bool = False,
) -> Opened:
    """Find the object in the index and open it, in one worker-thread hop: a file on local disk is
    left open for the server to send (``zero_copy``: the server offers it), otherwise a file up to
    WHOLE is read at once and a larger one is left open to stream. The size is the open file's own (fstat on local disk),
    so Content-Length always matches the bytes sent, even when the entry was replaced meanwhile.

    Only a regular file inside the namespace is opened: on local disk no symlink is followed
    (O_NOFOLLOW, every directory on the path checked), so a link planted in a namespace serves nothing."""
    info, env = state.where(cache, digest)
    recorded = state.recorded(env.id, key, route.executable)
    store = state.store(info)
    try:
        fh = store.open(route.path_of(env, key), "rb")
    except FileNotFoundError:
        raise HTTPException(
            404, route.missing.format(key=key, env=env.digest[:16], cache=cache)
        ) from None
    try:
        size = os.fstat(fh.fileno()).st_size if store.kind == "file" else int(fh.size)
        sent = zero_copy and store.kind == "file"
        whole = not sent and size <= WHOLE and WHOLE_SLOTS.acquire(blocking=False)
        try:
            body = fh.read(size) if whole else fh
        except BaseException:
            if whole:
                WHOLE_SLOTS.release()
            raise
    except BaseException:
        fh.close()
        raise
    if body is not fh:
        fh.close()
        size = len(body)
    state.metrics.download_bytes.labels(cache).inc(size)
    return Opened(body, size, recorded[1] if recorded and recorded[0] == size else None, sent)


class WholeBody(Response):
    """Bytes read whole under one of WHOLE_SLOTS: the slot is free again once they are sent, or the
    send failed or was cancelled."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            WHOLE_SLOTS.release()


class SentFile(Response):
    """An open file on local disk, handed to the server to send (server/zero_copy.py) and closed once
    it has been: the server's ``send`` returns when the bytes are written. Made only for a GET whose
    server offered the extension (``opened(zero_copy=...)``)."""

    def __init__(self, file: Any, size: int, headers: dict[str, str]) -> None:
        super().__init__(None, media_type="application/octet-stream", headers=headers)
        self.file, self.size = file, size

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        with self.file:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            message = {"type": zero_copy.ZERO_COPY, "file": self.file, "offset": 0}
            await send({**message, "count": self.size})


def discard(response: Response) -> None:
    """Give back what a response that will never be sent holds: a whole body's slot, a handed-over
    file (a streamed one's file is closed when the response is collected)."""
    if isinstance(response, WholeBody):
        WHOLE_SLOTS.release()
    elif isinstance(response, SentFile):
        response.file.close()


def stream_file(body: bytes | Any, headers: dict[str, str]) -> Response:
    """What opened() gave as the response body: bytes at once, a file in CHUNK-sized reads (closed after)."""
    if isinstance(body, bytes):
        return WholeBody(body, media_type="application/octet-stream", headers=headers)

    def chunks() -> Iterator[bytes]:
        with body:
            while block := body.read(CHUNK):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


def byte_headers(size: int, sha: str | None) -> dict[str, str]:
    headers = {"content-length": str(size), "cache-control": "private, max-age=0"}
    if sha:
        headers[SHA_HEADER] = sha
        headers["etag"] = f'"{sha}"'
    return headers


@route(
    router,
    "GET",
    ENTRY_ROUTE,
    role="reader",
    summary="Download one entry (streamed)",
    response_class=OctetStream,
    responses=download_responses("the entry's bytes"),
)
async def get_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    return await download(request, cache, digest, key, ENTRY)


async def download(
    request: Request, cache: str, digest: str, key: str, route: ByteRoute
) -> Response:
    """GET of an entry or of its stored executable: found and opened in one thread hop, then handed
    to the server (zero-copy) or read (up to WHOLE) in that hop."""
    check_key(key)
    state, sendfile = state_of(request), zero_copy.offered(request.scope)
    return await run_in_threadpool(download_answer, state, cache, digest, key, route, sendfile)


async def head(request: Request, cache: str, digest: str, key: str, route: ByteRoute) -> Response:
    """HEAD of an entry or of its stored executable: size and sha256 without the bytes."""
    check_key(key)
    return await run_in_threadpool(head_answer, state_of(request), cache, digest, key, route)


def download_answer(
    state: ServerState, cache: str, digest: str, key: str, route: ByteRoute, zero_copy: bool = False
) -> Response:
    """A GET's work, in a worker thread (the route's, and server/fast_lane.py's)."""
    prefix = state.settings.accel_redirect
    if prefix is not None and state.store(state.where(cache, digest)[0]).kind == "file":
        # Behind nginx (server/accel.py): checked here, sent by nginx.
        _info, env, size, sha = located(state, cache, digest, key, route)
        headers = {
            **byte_headers(size, sha),
            "content-length": "0",
            ACCEL_HEADER: accel_uri(prefix, cache, route.path_of(env, key)),
        }
        return Response(status_code=200, headers=headers, media_type="application/octet-stream")
    got = opened(state, cache, digest, key, route, zero_copy=zero_copy)
    headers = byte_headers(got.size, got.sha256)
    return SentFile(got.body, got.size, headers) if got.sent else stream_file(got.body, headers)


def head_answer(
    state: ServerState, cache: str, digest: str, key: str, route: ByteRoute
) -> Response:
    """A HEAD's work, in a worker thread (the route's, and server/fast_lane.py's)."""
    _info, _env, size, sha = located(state, cache, digest, key, route)
    return Response(
        status_code=200, headers=byte_headers(size, sha), media_type="application/octet-stream"
    )


@route(
    router,
    "HEAD",
    ENTRY_ROUTE,
    role="reader",
    summary="An entry's size and sha256, without its bytes",
    response_class=OctetStream,
    responses=download_responses("the entry's size and recorded sha256, no bytes"),
)
async def head_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    return await head(request, cache, digest, key, ENTRY)


@route(
    router,
    "POST",
    "/caches/{cache}/environments/{digest}/entries",
    role="writer",
    summary="Record entries a writer stored itself (checked against storage)",
    response_model=out.RegisteredOut,
    responses={
        **errors(400, 404),
        **refusal(409, "a key is recorded with other bytes"),
        **refusal(422, "a claim storage does not bear out"),
    },
)
def register_entries(
    state: StateDep,
    token: CurrentToken,
    replace: Overwrite,
    cache: CacheName,
    digest: Digest,
    body: schemas.EntryRegistration,
) -> JSONResponse:
    info, env = _resolve(state, cache, digest)
    claims = [
        NewEntry(
            key=e.key,
            module=check_key(e.key).module,
            size=e.size,
            sha256=e.sha256,
            origin=e.origin,
            compile_time_ms=e.compile_time_ms,
            function=e.function,
            bucket=e.bucket,
            warm_run_id=body.warm_run_id,
            aot_size=e.aot_size,
            aot_sha256=e.aot_sha256,
        )
        for e in body.entries
    ]
    run_env = (
        warm_runs.get_run(state.index, body.warm_run_id).environment_id
        if body.warm_run_id is not None
        else None
    )
    try:
        inserted, updated = ingest.register_stored(
            ingest.Target(state.index, info, env, state.store(info)),
            claims,
            run_environment_id=run_env,
            replace_existing=replace,
            who=f"token {token.name}",
        )
    except ingest_rules.Refused as exc:
        raise refused(exc) from None
    except EntryConflict as exc:
        raise HTTPException(
            409, f"{exc.message}; an admin may replace it with {OVERWRITE_HEADER}: true"
        ) from None
    finally:
        state.entries_changed()
    return ok({"inserted": inserted, "updated": updated})
