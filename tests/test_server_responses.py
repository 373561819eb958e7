"""The response models (server/responses.py) name exactly the JSON ``to_jsonable`` writes for the
library record each route sends: every field, in order, all required, nothing else.

schemathesis checks the answers it provokes against the models; this holds the models to the
records themselves, so a field added to a record (or to its ``__json_extra__``) fails here even
where no generated case reaches a route that sends it.
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from cachectl.core.fingerprint import Environment
from cachectl.core.records import (
    AuditInfo,
    CacheInfo,
    CreatedToken,
    EntryInfo,
    EnvironmentInfo,
    TokenInfo,
    WarmRunInfo,
)
from cachectl.index.server_queries import EntryPage, JobInfo
from cachectl.index.usage import TelemetryStats, UsageRow
from cachectl.usage.inventory import CacheTotals
from cachectl_server import responses as out
from cachectl_server.app import create_app

RECORDS = [
    (out.CacheOut, CacheInfo),
    (out.EnvironmentFieldsOut, Environment),
    (out.EnvironmentOut, EnvironmentInfo),
    (out.UsageRowOut, UsageRow),
    (out.TelemetryStatsOut, TelemetryStats),
    (out.CacheTotalsOut, CacheTotals),
    (out.AuditOut, AuditInfo),
    (out.EntryOut, EntryInfo),
    (out.EntryPageOut, EntryPage),
    (out.WarmRunOut, WarmRunInfo),
    (out.JobOut, JobInfo),
    (out.TokenOut, TokenInfo),
    (out.CreatedTokenOut, CreatedToken),
]


def _json_fields(record: type) -> list[str]:
    """The keys ``to_jsonable`` writes for a record, in its order."""
    fields = [f.name for f in dataclasses.fields(record) if f.metadata.get("json", True)]
    return fields + list(getattr(record, "__json_extra__", ()))


@pytest.mark.parametrize(("model", "record"), RECORDS, ids=lambda v: v.__name__)
def test_a_model_names_its_records_json(model, record) -> None:
    assert list(model.model_fields) == _json_fields(record)
    assert all(f.is_required() for f in model.model_fields.values())
    assert model.model_json_schema()["additionalProperties"] is False


def test_every_json_route_documents_its_success_body(tmp_path) -> None:
    app = create_app(f"sqlite:///{tmp_path}/index.db")
    try:
        spec = TestClient(app).get("/openapi.json").json()
    finally:
        app.state.cachectl.index.close()
    undocumented = []
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            for status, response in op["responses"].items():
                schema = (response.get("content") or {}).get("application/json", {}).get("schema")
                if schema is not None and not schema:  # FastAPI's "any JSON": no model named
                    undocumented.append(f"{method.upper()} {path} {status}")
    assert not undocumented
