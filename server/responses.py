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

import dataclasses
import functools
import operator
import types
from collections import abc
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from cachectl.core.fingerprint import Environment
from cachectl.core.jsonable import REDACTED, to_jsonable
from cachectl.core.records import (
    AuditInfo,
    CacheInfo,
    CreatedToken,
    EntryInfo,
    EnvironmentInfo,
    Proof,
    TokenInfo,
    WarmRunInfo,
)
from cachectl.index.misses_queries import MissesFacts
from cachectl.index.server_queries import EntryPage, JobInfo
from cachectl.index.telemetry_queries import SignatureRow
from cachectl.index.usage import TelemetryStats, UsageRow
from cachectl.trust.caches import looks_secret
from cachectl.usage.inventory import CacheTotals

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


def _convert(tp: Any) -> Any:
    """A record field's type as its JSON: tuples and sequences are lists, a nested record is that
    record's model, a mapping is a JSON object."""
    if dataclasses.is_dataclass(tp):
        return _MODELS[tp]  # type: ignore[index]
    origin, args = get_origin(tp), get_args(tp)
    if origin in (types.UnionType, Union):
        return functools.reduce(operator.or_, [_convert(a) for a in args])
    if origin in (tuple, list, set, frozenset, abc.Sequence):
        inner = [a for a in args if a is not Ellipsis]
        return list_of(_convert(inner[0])) if inner else list[Any]
    if origin is dict:
        return dict[str, Any]
    return tp


_MODELS: dict[type, type[Out]] = {}


def list_of(model: Any) -> Any:
    """``list[model]`` for a model made at run time (a type checker cannot read one as a type)."""
    return list.__class_getitem__(model)


def record_model(record: type, name: str) -> type[Out]:
    """The model of the JSON ``to_jsonable`` writes for a library record, derived from the record
    itself (its fields, less ``metadata={"json": False}``, then ``__json_extra__``), so the two
    cannot drift; records it nests must have their models first."""
    hints = get_type_hints(record)
    fields: dict[str, Any] = {
        f.name: (_convert(hints[f.name]), ...)
        for f in dataclasses.fields(record)
        if f.metadata.get("json", True)
    }
    for extra in getattr(record, "__json_extra__", ()):
        fields[extra] = (_convert(get_type_hints(getattr(record, extra).fget)["return"]), ...)
    model = create_model(
        name, __base__=Out, __doc__=f"{record.__module__}.{record.__qualname__}", **fields
    )
    _MODELS[record] = model
    return model


# Nested records first. CacheInfo's secret-looking storage options are redacted (``ok``).
EnvironmentFieldsOut = record_model(Environment, "EnvironmentFieldsOut")
CacheOut = record_model(CacheInfo, "CacheOut")
ProofOut = record_model(Proof, "ProofOut")
EnvironmentOut = record_model(EnvironmentInfo, "EnvironmentOut")
UsageRowOut = record_model(UsageRow, "UsageRowOut")
TelemetryStatsOut = record_model(TelemetryStats, "TelemetryStatsOut")
SignatureRowOut = record_model(SignatureRow, "SignatureRowOut")
MissesFactsOut = record_model(MissesFacts, "MissesFactsOut")
CacheTotalsOut = record_model(CacheTotals, "CacheTotalsOut")
AuditOut = record_model(AuditInfo, "AuditOut")
EntryOut = record_model(EntryInfo, "EntryOut")
EntryPageOut = record_model(EntryPage, "EntryPageOut")
WarmRunOut = record_model(WarmRunInfo, "WarmRunOut")
JobOut = record_model(JobInfo, "JobOut")
TokenOut = record_model(TokenInfo, "TokenOut")
CreatedTokenOut = record_model(CreatedToken, "CreatedTokenOut")

# Not a record: resolve's own answer.
ResolveOut = create_model(
    "ResolveOut",
    __base__=Out,
    __doc__="Where a fingerprint's environment lives, and whether this token may write it.",
    cache=(str, ...),
    digest=(str, ...),
    namespace=(str, ...),
    url=(str, ...),
    exists=(bool, ...),
    created=(bool, ...),
    environment=(EnvironmentOut | None, ...),  # type: ignore[arg-type]
    readonly=(bool, ...),
    entries_url=(str, ...),
)


class RecordedOut(Out):
    recorded: Literal[True]


class TelemetryAcceptedOut(Out):
    """What one telemetry POST counted: batches recorded, batches for unknown environments, rows."""

    accepted: int
    unknown_environments: int
    rows: int


class CompileLeaseSeenOut(Out):
    """A compile-lease row as the caller saw it (cachectl/index/compile_leases.py ``Seen``)."""

    mine: bool
    holder: str
    state: str
    sha256: str | None
    hedger: str | None
    age_s: float
    left_s: float
    # The key's last finished compile in ms: a waiter's hedge bound without a "recorded" call.
    compile_ms: int | None = None


class CompileLeaseOut(Out):
    """What a compile-lease call answered: the row (take, look), whether it acted (renew,
    hedge, finish, release), or the compile time recorded for a key in ms (recorded)."""

    result: CompileLeaseSeenOut | bool | int | None


class RegisteredOut(Out):
    inserted: int
    updated: int


# -- health ------------------------------------------------------------------------------------


class HealthOut(Out):
    status: Literal["ok"]


class ReadinessOut(Out):
    """``problems`` and ``caches`` only for a caller with a token: a load balancer needs the status."""

    status: Literal["ready", "unavailable"]
    problems: list[str] | None = None
    caches: int | None = None
