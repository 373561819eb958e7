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

from cachectl import aot
from cachectl.entries import AOT_SUFFIX, CorruptEntry, EntryName
from cachectl.errors import QuotaExceeded
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo
from cachectl.index import server_queries as sq

from .api import CacheName, Digest, ok, state_of
from .auth import route
from .entries import (
    SHA_HEADER,
    Key,
    Upload,
    _disk_full,
    _headers,
    _receive_body,
    _resolve,
    _too_large,
    check_key,
    open_body,
    stream_file,
)
from .state import ServerState

router = APIRouter(prefix="/api/v1")
ROUTE = "/caches/{cache}/environments/{digest}/entries/{key}/aot"


def executable_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{AOT_SUFFIX}"


def _store_executable(state: ServerState, info: CacheInfo, env: EnvironmentInfo, parsed: EntryName,
                      upload: Upload, claimed_sha: str | None) -> tuple[bool, EntryInfo | None]:
    if claimed_sha is not None and claimed_sha.lower() != upload.sha256:
        raise HTTPException(422, f"body sha256 is {upload.sha256}, not the {SHA_HEADER} sent: corrupted in transit?")
    with open(upload.path, "rb") as fh:
        data = fh.read()  # bounded by the upload limit; artifacts are a few KiB
    try:
        header = aot.read_header(data)
    except CorruptEntry as exc:
        raise HTTPException(422, f"not a cachectl stored executable: {exc}") from None
    if header.key != parsed.key:
        raise HTTPException(422, "the stored executable's header names another key: refused")
    entry = state.index.get_entry(env.id, parsed.key)
    if entry is None:
        raise HTTPException(422, f"no entry {parsed.key} in environment {env.digest[:16]}: "
                                 "upload the entry first, then its executable")
    if header.entry_sha256 != entry.sha256:
        raise HTTPException(422, "the stored executable was made for other entry bytes than the indexed "
                                 "entry's (entry_sha256 differs): refused")
    try:
        previous = sq.reserve_executable(state.index, info.name, env.id, parsed.key, upload.size, upload.sha256)
    except QuotaExceeded as exc:
        raise _too_large(exc.message) from None
    try:
        state.store(info).write_file(executable_path(env, parsed.key), upload.path)
    except BaseException as exc:
        sq.release_executable(state.index, env.id, parsed.key, previous)
        if isinstance(exc, OSError) and (full := _disk_full(exc)) is not None:
            raise full from None
        raise
    return previous is not None, state.index.get_entry(env.id, parsed.key)


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
    limit, what = state.settings.max_upload_bytes, "the server's upload limit"
    if info.max_entry_size is not None and info.max_entry_size < limit:
        limit, what = info.max_entry_size, f"cache {cache!r}'s max entry size"
    upload: Upload | None = None
    try:
        upload = await _receive_body(request, limit, what, state.settings.upload_dir)
        existed, entry = await run_in_threadpool(_store_executable, state, info, env, parsed, upload,
                                                 request.headers.get(SHA_HEADER))
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    finally:
        if upload is not None:
            upload.discard()
    state.metrics.uploads.labels(cache, "stored").inc()
    state.metrics.upload_bytes.labels(cache).inc(upload.size)
    return ok(entry, 200 if existed else 201)


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
