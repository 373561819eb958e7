"""Stored executables over HTTP: PUT (writers), GET (streamed) and HEAD of an entry's ``<key>-aot``.

The sibling of server/entries.py: ``/caches/{cache}/environments/{digest}/entries/{key}/aot``.
An executable belongs to an indexed entry and is recorded on that entry's row
(cachectl/aot.py). An upload is checked before anything is stored: the key,
the environment, the same size limits as entries (413) and the cache's quota
counting entry and executable as one unit, then the bytes are an intact
artifact (``aot.read_header``: magic, format, payload checksum) made for
this key and this entry's recorded bytes (422). The server computes the
sha256 it records from the bytes it received.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from cachectl import ingest
from cachectl.entries import AOT_SUFFIX
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.index import server_queries as sq

from .api import CacheName, Digest, ok, state_of
from .auth import route
from .entries import (
    SHA_HEADER,
    Key,
    _headers,
    _resolve,
    check_key,
    open_body,
    receive_body,
    store_upload,
    stream_file,
    upload_limit,
)
from .state import ServerState

router = APIRouter(prefix="/api/v1")
ROUTE = "/caches/{cache}/environments/{digest}/entries/{key}/aot"


def executable_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{AOT_SUFFIX}"


@route(router, "PUT", ROUTE, role="writer",
       summary="Upload an entry's stored executable (the <key>-aot bytes warm made)",
       openapi_extra={"requestBody": {"required": True, "content": {
           "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
       responses={201: {"description": "stored"}, 200: {"description": "replaced"},
                  413: {"description": "too large for the cache"},
                  422: {"description": "not a stored executable of this entry"},
                  507: {"description": "the server's disk is full"}})
async def put_executable(request: Request, cache: CacheName, digest: Digest, key: Key) -> JSONResponse:
    state = state_of(request)
    parsed = check_key(key)
    info, env = await run_in_threadpool(_resolve, state, cache, digest)
    limit, what = upload_limit(state, info)
    upload: ingest.Spool | None = None
    try:
        upload = await receive_body(request, limit, what, state.settings.upload_dir)
        done = await run_in_threadpool(store_upload, state, info, env, ingest.ingest_executable, parsed, upload,
                                       claimed_sha256=request.headers.get(SHA_HEADER))
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    finally:
        if upload is not None:
            upload.discard()
    state.metrics.uploads.labels(cache, "stored").inc()
    state.metrics.upload_bytes.labels(cache).inc(upload.size)
    return ok(done.entry, 200 if done.outcome == "replaced" else 201)


def _located(state: ServerState, cache: str, digest: str, key: str
             ) -> tuple[CacheInfo, EnvironmentInfo, int, str | None]:
    """The executable's cache, environment, size and recorded sha256; 404 when storage lacks it."""
    found = sq.locate(state.index, cache, digest, key)
    info, env, recorded = found.cache, found.environment, found.entry
    try:
        size = state.store(info).size(executable_path(env, key))
    except FileNotFoundError:
        raise HTTPException(404, f"no stored executable for entry {key} in environment {env.digest[:16]} "
                                 f"of cache {cache!r}") from None
    sha = recorded.aot_sha256 if recorded and recorded.aot_size == size else None
    return info, env, size, sha


@route(router, "GET", ROUTE, role="reader", summary="Download an entry's stored executable (streamed)",
       responses={200: {"content": {"application/octet-stream": {}}, "description": "the -aot bytes"}})
async def get_executable(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    info, env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    store = state.store(info)
    try:
        # Only a regular file inside the namespace, never through a symlink (Store.open).
        fh = await run_in_threadpool(open_body, store, executable_path(env, key), size)
    except FileNotFoundError:
        raise HTTPException(404, f"no stored executable for entry {key} in environment {env.digest[:16]} "
                                 f"of cache {cache!r}") from None
    state.metrics.download_bytes.labels(cache).inc(size)
    return stream_file(fh, _headers(size, sha))


@route(router, "HEAD", ROUTE, role="reader", summary="A stored executable's size and sha256, without its bytes")
async def head_executable(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    _info, _env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    return Response(status_code=200, headers=_headers(size, sha), media_type="application/octet-stream")
