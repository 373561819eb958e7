"""Entry bytes over HTTP: PUT (writers), GET (streamed) and HEAD.

An upload is checked before anything is stored, in this order: the key is a
JAX key and nothing else (no '/', no '..', no leading dot), the environment
exists, the body fits the cache's max entry size (413, read no further) and
its quota, the bytes decompress into a JAX entry (422) without expanding
past a bound. Only then is it written, atomically, and its sha256 recorded.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cachectl.entries import (
    AOT_SUFFIX,
    CACHE_SUFFIX,
    ENV_FILE,
    CorruptEntry,
    EntryName,
    parse_key,
    read_header,
    sha256,
)
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo, NewEntry, warm_runs
from cachectl.index import server_queries as sq
from cachectl.namespace import ensure_namespace
from cachectl.units import format_size

from . import schemas
from .api import CacheName, Digest, ok, state_of
from .auth import route
from .state import ServerState

router = APIRouter(prefix="/api/v1")

# <module>-<64 hex>: the module part as JAX sanitizes it (word characters, '.', '-'),
# never starting with a dot, so no key can name a path outside its namespace.
KEY_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,440}-[0-9a-f]{64}$"
_KEY_RE = re.compile(KEY_PATTERN)
Key = Annotated[str, Path(min_length=66, max_length=512, pattern=KEY_PATTERN,
                          description="A JAX cache key: <module>-<64 hex>, without the -cache suffix")]
SHA_HEADER = "x-cachectl-sha256"
CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def check_key(key: str) -> EntryName:
    parsed = parse_key(key) if _KEY_RE.match(key) else None
    if parsed is None:
        raise HTTPException(422, "bad entry key: use <module>-<64 hex digits> as JAX names it (no path)")
    return parsed


def entry_path(env: EnvironmentInfo, key: str) -> str:
    return f"{env.namespace}/{key}{CACHE_SUFFIX}"


def _resolve(state: ServerState, cache: str, digest: str) -> tuple[CacheInfo, EnvironmentInfo]:
    found = sq.locate(state.index, cache, digest)
    return found.cache, found.environment


def _too_large(what: str) -> HTTPException:
    return HTTPException(413, what)


def check_expansion(data: bytes, limit: int) -> None:
    """Refuse bytes that would decompress past ``limit`` before read_header inflates them."""
    if data[:4] == _ZSTD_MAGIC:
        import zstandard

        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CorruptEntry(f"zstd frame is corrupt: {exc}") from exc
        if size == -1:  # size not recorded in the frame: inflate at most limit + 1 bytes
            reader = zstandard.ZstdDecompressor().stream_reader(data)
            try:
                size = len(reader.read(limit + 1))
            except zstandard.ZstdError as exc:
                raise CorruptEntry(f"zstd data is corrupt: {exc}") from exc
    else:
        inflater = zlib.decompressobj()
        try:
            size = len(inflater.decompress(data, limit + 1))
        except zlib.error as exc:
            raise CorruptEntry(f"not zstd or zlib data: {exc}") from exc
    if size > limit:
        raise _too_large(f"entry expands to more than {format_size(limit)}: refused")


async def _read_body(request: Request, limit: int, what: str) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise HTTPException(400, "bad Content-Length header") from None
        if length > limit:
            raise _too_large(f"entry of {format_size(length)} is above {what} ({format_size(limit)}): nothing stored")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _too_large(f"entry is above {what} ({format_size(limit)}): nothing stored")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_quota(state: ServerState, info: CacheInfo, env: EnvironmentInfo, replaced: int, size: int) -> None:
    """413 unless the cache (and environment) stay within their limits once this entry is in."""
    if info.max_size is not None:
        _entries, used = sq.cache_usage(state.index, info.name)
        if used - replaced + size > info.max_size:
            raise _too_large(f"cache {info.name!r} is at {format_size(used)} of its {format_size(info.max_size)} "
                             f"quota; an entry of {format_size(size)} does not fit: run gc, or raise max_size")
    if info.env_max_size is not None:
        _entries, used = sq.environment_usage(state.index, env.id)
        if used - replaced + size > info.env_max_size:
            raise _too_large(f"environment {env.digest[:16]} is at {format_size(used)} of its "
                             f"{format_size(info.env_max_size)} quota: run gc, or raise env_max_size")


def _store_entry(state: ServerState, info: CacheInfo, env: EnvironmentInfo, parsed: EntryName,
                 data: bytes, claimed_sha: str | None) -> tuple[bool, EntryInfo | None]:
    digest = sha256(data)
    if claimed_sha is not None and claimed_sha.lower() != digest:
        raise HTTPException(422, f"body sha256 is {digest}, not the {SHA_HEADER} sent: corrupted in transit?")
    try:
        check_expansion(data, state.settings.max_decompressed_bytes)
        header = read_header(data)
    except CorruptEntry as exc:
        raise HTTPException(422, f"not a JAX cache entry: {exc}") from None
    existing = state.index.get_entry(env.id, parsed.key)
    _check_quota(state, info, env, existing.size if existing else 0, len(data))
    store = state.store(info)
    if not store.exists(f"{env.namespace}/{ENV_FILE}"):
        # An environment recorded without its namespace (e.g. by a service that may not write):
        # storage must stay self-describing for sync and verify.
        ensure_namespace(store, env.environment, group=info.group)
    store.write_bytes(entry_path(env, parsed.key), data)
    state.index.upsert_entries(env.id, [NewEntry(key=parsed.key, module=parsed.module, size=len(data),
                                                 sha256=digest, origin="upload",
                                                 compile_time_ms=header.compile_seconds * 1000)])
    return existing is not None, state.index.get_entry(env.id, parsed.key)


@route(router, "PUT", "/caches/{cache}/environments/{digest}/entries/{key}", role="writer",
       summary="Upload one entry (raw bytes as JAX wrote them)",
       openapi_extra={"requestBody": {"required": True, "content": {
           "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
       responses={201: {"description": "stored"}, 200: {"description": "replaced"},
                  413: {"description": "too large for the cache"}, 422: {"description": "not a JAX entry"}})
async def put_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> JSONResponse:
    state = state_of(request)
    parsed = check_key(key)
    info, env = await run_in_threadpool(_resolve, state, cache, digest)
    limit, what = state.settings.max_upload_bytes, "the server's upload limit"
    if info.max_entry_size is not None and info.max_entry_size < limit:
        limit, what = info.max_entry_size, f"cache {cache!r}'s max entry size"
    try:
        data = await _read_body(request, limit, what)
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    try:
        existed, entry = await run_in_threadpool(_store_entry, state, info, env, parsed, data,
                                                 request.headers.get(SHA_HEADER))
    except HTTPException as exc:
        state.metrics.uploads.labels(cache, str(exc.status_code)).inc()
        raise
    state.metrics.uploads.labels(cache, "stored").inc()
    state.metrics.upload_bytes.labels(cache).inc(len(data))
    return ok(entry, 200 if existed else 201)


def _located(state: ServerState, cache: str, digest: str, key: str) -> tuple[CacheInfo, EnvironmentInfo, int, str | None]:
    """The entry's cache, environment, size and recorded sha256; 404 when storage lacks it."""
    found = sq.locate(state.index, cache, digest, key)
    info, env, recorded = found.cache, found.environment, found.entry
    try:
        size = state.store(info).size(entry_path(env, key))
    except FileNotFoundError:
        raise HTTPException(404, f"no entry {key} in environment {env.digest[:16]} of cache {cache!r}") from None
    return info, env, size, recorded.sha256 if recorded and recorded.size == size else None


def _headers(size: int, sha: str | None) -> dict[str, str]:
    headers = {"content-length": str(size), "cache-control": "private, max-age=0"}
    if sha:
        headers[SHA_HEADER] = sha
        headers["etag"] = f'"{sha}"'
    return headers


@route(router, "GET", "/caches/{cache}/environments/{digest}/entries/{key}", role="reader",
       summary="Download one entry (streamed)",
       responses={200: {"content": {"application/octet-stream": {}}, "description": "the entry's bytes"}})
async def get_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    info, env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    store = state.store(info)
    state.metrics.download_bytes.labels(cache).inc(size)
    headers = _headers(size, sha)
    if store.is_local:
        return FileResponse(store.url_for(entry_path(env, key)), media_type="application/octet-stream",
                            headers=headers)

    def chunks() -> Iterator[bytes]:
        with store.open(entry_path(env, key), "rb") as fh:
            while block := fh.read(CHUNK):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


@route(router, "HEAD", "/caches/{cache}/environments/{digest}/entries/{key}", role="reader",
       summary="An entry's size and sha256, without its bytes")
async def head_entry(request: Request, cache: CacheName, digest: Digest, key: Key) -> Response:
    state = state_of(request)
    check_key(key)
    _info, _env, size, sha = await run_in_threadpool(_located, state, cache, digest, key)
    return Response(status_code=200, headers=_headers(size, sha), media_type="application/octet-stream")


@route(router, "POST", "/caches/{cache}/environments/{digest}/entries", role="writer",
       summary="Record entries a writer stored itself (checked against storage)")
def register_entries(request: Request, cache: CacheName, digest: Digest,
                     body: schemas.EntryRegistration) -> JSONResponse:
    state = state_of(request)
    info, env = _resolve(state, cache, digest)
    store = state.store(info)
    new = []
    for e in body.entries:
        parsed = check_key(e.key)
        try:
            size = store.size(entry_path(env, e.key))
        except FileNotFoundError:
            raise HTTPException(422, f"entry {e.key} is not in storage at {env.namespace}: write it first") from None
        if size != e.size:
            raise HTTPException(422, f"entry {e.key} is {size} bytes in storage, not {e.size}")
        if info.max_entry_size is not None and e.size > info.max_entry_size:
            raise HTTPException(413, f"entry {e.key} ({e.size} bytes) is above cache {cache!r}'s max entry size "
                                     f"({info.max_entry_size} bytes)")
        if (e.aot_size is None) != (e.aot_sha256 is None):
            raise HTTPException(422, f"entry {e.key}: give both aot_size and aot_sha256, or neither")
        if e.aot_size is not None:
            try:
                aot_size = store.size(f"{env.namespace}/{e.key}{AOT_SUFFIX}")
            except FileNotFoundError:
                raise HTTPException(422, f"stored executable of {e.key} is not in storage: write it first") from None
            if aot_size != e.aot_size:
                raise HTTPException(422, f"stored executable of {e.key} is {aot_size} bytes in storage, "
                                         f"not {e.aot_size}")
        new.append(NewEntry(key=e.key, module=parsed.module, size=e.size, sha256=e.sha256, origin=e.origin,
                            compile_time_ms=e.compile_time_ms, function=e.function, bucket=e.bucket,
                            warm_run_id=body.warm_run_id, aot_size=e.aot_size, aot_sha256=e.aot_sha256))
    if body.warm_run_id is not None:
        run = warm_runs.get_run(state.index, body.warm_run_id)
        if run.environment_id != env.id:
            raise HTTPException(422, f"warm run {body.warm_run_id} belongs to another environment")
    inserted, updated = state.index.upsert_entries(env.id, new)
    return ok({"inserted": inserted, "updated": updated})
