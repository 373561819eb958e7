"""schemathesis over the published /openapi.json with a writer token, then an admin token (on a
world of its own: its cases prune, revoke and change policies): no input makes a 5xx, and every
answer is what the document says (its status, content type, headers and body schema).

Bounded: a few examples per operation (CACHECTL_SCHEMATHESIS_EXAMPLES to raise
it). Half the generated cases keep schemathesis's random path values, half
point at the seeded cache, environment and entry, so handlers past the
lookups get fuzzed too.
"""

from __future__ import annotations

import itertools
import os

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.server_kit import MAIN, bearer, seed  # noqa: E402

from cachectl_server.app import create_app  # noqa: E402

EXAMPLES = int(os.environ.get("CACHECTL_SCHEMATHESIS_EXAMPLES", "12"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module", params=["writer", "admin"])
def seeded(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    s = seed(f"sqlite:///{tmp}/index.db", str(tmp / "main"), str(tmp / "other"))
    app = create_app(s.db)
    yield s, app, request.param
    app.state.cachectl.jobs.shutdown()


@pytest.fixture(scope="module")
def api_schema(seeded):
    _s, app, _identity = seeded
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_no_input_makes_a_server_error_or_an_undocumented_answer(api_schema, seeded) -> None:
    """Every operation, EXAMPLES generated cases each (driven directly: schemathesis's
    pytest plugin does not load under this pytest)."""
    s, _app, identity = seeded
    toggle = itertools.count()
    failures: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 25

    for operation in operations:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:
            if next(toggle) % 2:
                real = {"cache": MAIN, "digest": s.digest, "key": s.keys[0]}
                for name, value in real.items():
                    if case.path_parameters and name in case.path_parameters:
                        case.path_parameters[name] = value
            case.call_and_validate(headers=bearer(s.tokens[identity]), checks=CHECKS)

        try:
            fuzz()
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure, then report
            failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
