"""Response bodies: how a handler builds one (``ok``) and what each route sends, as pydantic models
for the OpenAPI document.

A handler builds its body with ``to_jsonable`` (the encoder `--json` and the client's
decoder share) and returns it as a JSONResponse, which FastAPI sends as it is: a 5000-entry page is
serialized once, and the bytes on the wire stay exactly what the client rebuilds the library's
records from. These models say what that JSON is; tests/test_server_schemathesis.py checks every
answer against them. Every field ``to_jsonable`` writes is required (it writes them all, ``null``
included), and no other key is allowed, so a field added to a record without its model fails the
check instead of going undocumented.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cachectl.core.jsonable import REDACTED, to_jsonable
from cachectl.trust.caches import looks_secret

_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "auth", "session")


def redact_secrets(value: Any, inside_options: bool = False) -> Any:
    """Storage options may hold credentials: their secret-looking values never leave the server,
    whether the key says so or the value does (a URL with user:password@ in it)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if inside_options and (
                any(w in str(k).lower() for w in _SECRET_WORDS) or looks_secret(str(k), v)
            ):
                out[k] = REDACTED  # the client drops these and uses its own credentials
            else:
                out[k] = redact_secrets(v, inside_options or k == "storage_options")
        return out
    if isinstance(value, list):
        return [
            REDACTED
            if inside_options and looks_secret("", v)
            else redact_secrets(v, inside_options)
            for v in value
        ]
    return value


def ok(value: Any, status: int = 200) -> JSONResponse:
    """A success body: the library's value as ``to_jsonable`` writes it, secrets redacted."""
    return JSONResponse(redact_secrets(to_jsonable(value)), status_code=status)


class Out(BaseModel):
    """A response body: closed (``additionalProperties: false``), so drift shows in the check."""

    model_config = ConfigDict(extra="forbid")


# -- errors ---------------------------------------------------------------------------


class ErrorOut(Out):
    """A refusal: the message, and the library error's class when the library refused."""

    detail: str
    error: str | None = Field(
        None, description="The cachectl error class (absent for HTTP-level refusals)"
    )


class ValidationIssue(BaseModel):
    """One of FastAPI's validation errors, in FastAPI's own shape (open: pydantic adds keys)."""

    loc: list[str | int]
    msg: str
    type: str


class UnprocessableOut(Out):
    """422: FastAPI's list of validation errors, or one message (a body refused at the edge, a bad
    entry key or bytes that are not what the route takes)."""

    detail: str | list[ValidationIssue]
    error: str | None = None


ERROR_TEXT = {
    400: "bad input (the library's message)",
    401: "missing, unknown, expired or revoked token",
    403: "the token's role or cache scope does not allow this",
    404: "no such cache, environment, entry, run, job or token",
    409: "conflicts with the cache's state",
    413: "request body above the route's or the cache's limit",
    503: "the index or a cache's storage cannot be reached",
    507: "the server's disk is full: nothing stored",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the given refusal statuses, each with its body's model."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        if code == 422:
            out[422] = {"model": UnprocessableOut, "description": "validation error"}
        else:
            out[code] = {"model": ErrorOut, "description": ERROR_TEXT[code]}
    return out


def json_bodies(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """The refusals of a route whose own answers are not JSON (bytes, text): FastAPI would put
    their models under the route's media type, so each names its JSON body by reference (the
    models are in the document's components: the JSON routes use them)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code, response in responses.items():
        model = response.get("model")
        if model is None:
            out[code] = response
            continue
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        rest = {k: v for k, v in response.items() if k != "model"}
        out[code] = {**rest, "content": {"application/json": {"schema": ref}}}
    return out


def refusal(code: int, description: str) -> dict[int | str, dict[str, Any]]:
    """One refusal status with a route's own wording of when it happens."""
    model = UnprocessableOut if code == 422 else ErrorOut
    return {code: {"model": model, "description": description}}


# -- caches and environments ------------------------------------------------------------


class CacheOut(Out):
    """cachectl.core.cache_info.CacheInfo (secret-looking storage options redacted)."""

    name: str
    root_url: str
    max_size: int | None
    max_entry_size: int | None
    env_max_size: int | None
    retention_seconds: int | None
    keep_versions: int | None
    writers: list[str]
    service_writes: str | None
    group: str | None
    storage_options: dict[str, Any]
    created_at: datetime | None
    trusted_keys: list[str]


class EnvironmentFieldsOut(Out):
    """cachectl.core.fingerprint.Environment: what JAX's cache key holds besides the program."""

    jax_version: str
    jaxlib_version: str
    backend: str
    platform_version: str
    device_kind: str
    device_count: int
    process_count: int
    topology: str
    xla_flags: list[str]
    compression: str
    enable_xla_caches: str
    include_metadata_in_key: bool


class EnvironmentOut(Out):
    """cachectl.core.records.EnvironmentInfo, with its totals."""

    id: int
    cache: str
    digest: str
    namespace: str
    environment: EnvironmentFieldsOut
    created_at: datetime | None
    last_seen_at: datetime | None
    deleted_at: datetime | None
    entries: int
    bytes: int
    last_access_at: datetime | None
    executables: int
    aot_bytes: int


class ResolveOut(Out):
    """Where a fingerprint's environment lives, and whether this token may write it."""

    cache: str
    digest: str
    namespace: str
    url: str
    exists: bool
    created: bool
    environment: EnvironmentOut | None
    readonly: bool
    entries_url: str


# -- usage --------------------------------------------------------------------------------


class UsageRowOut(Out):
    """cachectl.index.usage.UsageRow: one environment's or function's counters over a window."""

    environment: str
    namespace: str
    function: str | None
    processes: int
    requests: int
    hits: int
    misses: int
    writes: int
    saved_seconds: float
    dropped: int
    uncacheable: int
    name: str | None
    saved_warm_seconds: float
    loads: int
    saved_estimate_seconds: float
    hit_rate: float | None
    cacheable_requests: int


class TelemetryStatsOut(Out):
    """cachectl.index.usage.TelemetryStats."""

    cache: str
    since: datetime
    window_seconds: float
    environments: list[UsageRowOut]
    functions: list[UsageRowOut]


class CacheTotalsOut(Out):
    """cachectl.usage.inventory.CacheTotals."""

    cache: CacheOut
    environments: int
    entries: int
    bytes: int
    last_access_at: datetime | None
    per_environment: list[EnvironmentOut]
    executables: int
    aot_bytes: int
    telemetry: TelemetryStatsOut | None
    hit_rate: float | None


class AuditOut(Out):
    """cachectl.core.records.AuditInfo."""

    at: datetime
    actor: str
    operation: str
    cache: str | None
    entries: int
    bytes: int
    duration_ms: int | None
    details: dict[str, Any]


class RecordedOut(Out):
    recorded: Literal[True]


class TelemetryAcceptedOut(Out):
    """What one telemetry POST counted: batches recorded, batches for unknown environments, rows."""

    accepted: int
    unknown_environments: int
    rows: int


# -- entries and warm runs --------------------------------------------------------------------


class EntryOut(Out):
    """cachectl.core.records.EntryInfo."""

    key: str
    module: str
    size: int
    sha256: str
    compile_time_ms: int | None
    origin: str
    function: str | None
    bucket: dict[str, Any] | None
    created_at: datetime | None
    last_access_at: datetime | None
    hit_count: int
    environment_id: int
    aot_size: int | None
    aot_sha256: str | None
    aot_unusable: str | None


class EntryPageOut(Out):
    """cachectl.index.server_queries.EntryPage: ``next_offset`` is null on the last page."""

    items: list[EntryOut]
    total: int
    limit: int
    offset: int
    next_offset: int | None


class RegisteredOut(Out):
    inserted: int
    updated: int


class WarmRunOut(Out):
    """cachectl.core.records.WarmRunInfo."""

    id: int
    environment_id: int
    manifest_digest: str
    manifest_path: str | None
    host: str
    user: str
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    buckets: int
    compiled: int
    cached: int
    failed: int


# -- jobs and tokens ----------------------------------------------------------------------------


class JobOut(Out):
    """cachectl.index.server_queries.JobInfo: ``result`` is the library's report as JSON."""

    id: str
    cache: str
    kind: str
    status: str
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


class TokenOut(Out):
    """cachectl.core.records.TokenInfo: never the secret."""

    id: int
    name: str
    role: str
    caches: list[str] | None
    created_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


class CreatedTokenOut(Out):
    """cachectl.core.records.CreatedToken: the secret, in this response only."""

    info: TokenOut
    token: str


# -- health ------------------------------------------------------------------------------------


class HealthOut(Out):
    status: Literal["ok"]


class ReadinessOut(Out):
    """``problems`` and ``caches`` only for a caller with a token: a load balancer needs the status."""

    status: Literal["ready", "unavailable"]
    problems: list[str] | None = None
    caches: int | None = None
