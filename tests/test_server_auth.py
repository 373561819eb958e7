"""Tokens and the 401/403 matrix: every route of the app x every kind of caller.

The route table is the app's own (each route declares its role and scope in
its OpenAPI metadata), so a route added later is in the matrix without
editing this file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support.server_kit import IDENTITIES, MAIN, OTHER, bearer, seed

from cachectl.index import open_index
from cachectl.index.models import Token
from cachectl.trust import tokens
from cachectl_server.app import create_app
from cachectl_server.auth import PUBLIC, ROLE_KEY, SCOPE_KEY

RANK = {"reader": 0, "writer": 1, "admin": 2}
# identity -> (role, caches it may act on; None = all), for the valid tokens
VALID = {
    "reader": ("reader", None),
    "writer": ("writer", None),
    "admin": ("admin", None),
    "scoped_writer": ("writer", {MAIN}),
    "wrong_scope_admin": ("admin", {OTHER}),
    "wrong_scope_reader": ("reader", {OTHER}),
}


def _route_table() -> list[tuple[str, str, str, str]]:
    """(method, path, role, scope) for every operation a real app publishes in /openapi.json."""
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(f"sqlite:///{tmp}/index.db")
        spec = TestClient(app).get("/openapi.json").json()
        app.state.cachectl.index.close()
    out = []
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            out.append(
                (
                    method.upper(),
                    path,
                    op.get(ROLE_KEY, "undeclared"),
                    op.get(SCOPE_KEY, "undeclared"),
                )
            )
    return sorted(out, key=lambda r: (r[1], r[0]))


ROUTES = _route_table()


def test_every_route_declares_its_role() -> None:
    undeclared = [f"{m} {p}" for m, p, role, _s in ROUTES if role == "undeclared"]
    assert not undeclared
    assert len(ROUTES) >= 25
    public = {f"{m} {p}" for m, p, role, _s in ROUTES if role == PUBLIC}
    assert public == {"GET /healthz", "GET /readyz", "GET /login", "POST /login", "POST /logout"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    s = seed(f"sqlite:///{tmp}/index.db", str(tmp / "main"), str(tmp / "other"))
    app = create_app(s.db)
    admin = TestClient(app, headers=bearer(s.tokens["admin"]))
    job = admin.post(f"/api/v1/caches/{MAIN}/verify", json={"dry_run": True}).json()
    client = TestClient(app)
    from cachectl.index import warm_runs

    index = open_index(s.db)
    env = index.find_environment(MAIN, s.digest)
    run = warm_runs.start_run(index, env.id, manifest_digest="m", manifest_path=None, buckets=1)
    index.close()
    values = {
        "cache": MAIN,
        "digest": s.digest,
        "key": s.keys[0],
        "job_id": job["id"],
        "name": "no-such-token",
        "run_id": str(run.id),
    }
    yield s, client, values
    admin.get(f"/api/v1/jobs/{job['id']}")
    app.state.cachectl.jobs.shutdown()


def _body(path: str, method: str, s) -> dict | None:
    """A plausible body, so an allowed caller gets past auth (its answer may still be 4xx)."""
    if method not in ("POST", "PUT", "PATCH"):
        return None
    if path.endswith("/telemetry"):
        return {
            "batches": [
                {
                    "process": "h:1",
                    "cache": MAIN,
                    "environment_digest": s.digest,
                    "started_at": "2026-01-01T00:00:00Z",
                    "ended_at": "2026-01-01T00:00:05Z",
                    "functions": [{"function": "jit_f", "requests": 2, "hits": 1}],
                }
            ]
        }
    if path.endswith("/resolve"):
        return {**s.env.to_dict(), "create": False}
    if path.endswith(("/prune", "/gc", "/verify")):
        return {"dry_run": True}
    return {}


def _expected(identity: str, role: str, scope: str) -> set[int] | None:
    """None = any answer but 401/403; else the set of acceptable statuses."""
    if role == PUBLIC:
        return None
    if identity in ("none", "garbage", "expired", "revoked"):
        return {401}
    have, caches = VALID[identity]
    if RANK[have] < RANK[role]:
        return {403}
    if scope in ("cache", "object") and caches is not None and MAIN not in caches:
        return {403}
    if scope == "global" and caches is not None:
        return {403}
    return None


@pytest.mark.parametrize(
    ("method", "path", "role", "scope"), ROUTES, ids=[f"{m} {p}" for m, p, _r, _s in ROUTES]
)
def test_auth_matrix(world, method: str, path: str, role: str, scope: str) -> None:
    s, client, values = world
    url = path.format(**values)
    wrong = []
    for identity in ("none", "garbage", *IDENTITIES):
        token = {"none": None, "garbage": "cct_" + "x" * 43}.get(identity, s.tokens.get(identity))
        if (method, path) == ("POST", "/login"):
            # The sign-in form: the token travels in the form, and it is checked like a reader's.
            response = client.post(url, data={"token": token or ""}, follow_redirects=False)
            expected = _expected(identity, "reader", "any")
        else:
            response = client.request(
                method, url, headers=bearer(token), json=_body(path, method, s)
            )
            expected = _expected(identity, role, scope)
        status = response.status_code
        ok = (status not in (401, 403) and status < 500) if expected is None else status in expected
        if not ok:
            wrong.append(
                f"{identity}: got {status} {response.text[:200]!r}, expected {expected or 'not 401/403'}"
            )
        if status == 401 and path.startswith("/api/"):
            assert response.headers.get("www-authenticate", "").startswith("Bearer")
    assert not wrong, f"{method} {path} (role {role}, scope {scope}):\n" + "\n".join(wrong)


def test_only_a_hash_is_stored_and_compared_in_constant_time(tmp_path, monkeypatch) -> None:
    db = f"sqlite:///{tmp_path}/index.db"
    index = open_index(db)
    created = tokens.create_token(index, "ci", "writer")
    with index.session() as s:
        stored = s.scalar(select(Token.token_hash).where(Token.name == "ci"))
        raw = [tuple(r) for r in s.execute(select(Token.__table__))]
    assert stored == hashlib.sha256(created.token.encode()).hexdigest()
    assert created.token not in repr(raw)
    assert len(created.token) >= 40 and created.token.startswith("cct_")
    calls = []
    real = tokens.hmac.compare_digest
    monkeypatch.setattr(tokens.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert tokens.authenticate(index, created.token).name == "ci"
    assert calls, "authenticate must compare with hmac.compare_digest"
    with pytest.raises(tokens.InvalidToken):
        tokens.authenticate(index, created.token[:-1] + ("A" if created.token[-1] != "A" else "B"))
    tokens.revoke_token(index, "ci")
    with pytest.raises(tokens.InvalidToken):
        tokens.authenticate(index, created.token)
    index.close()


def test_token_library_rejects_bad_input(tmp_path) -> None:
    from cachectl.core.errors import BadInput, NotFound

    index = open_index(f"sqlite:///{tmp_path}/index.db")
    with pytest.raises(BadInput, match="role"):
        tokens.create_token(index, "x", "root")
    with pytest.raises(BadInput, match="name"):
        tokens.create_token(index, "../x", "reader")
    with pytest.raises(NotFound, match="no cache named"):
        tokens.create_token(index, "x", "reader", ["nope"])
    tokens.create_token(index, "x", "reader")
    with pytest.raises(BadInput, match="exists"):
        tokens.create_token(index, "x", "reader")
    with pytest.raises(NotFound):
        tokens.revoke_token(index, "nope")
    index.close()


def test_tokens_never_reach_logs_or_error_messages(world, caplog) -> None:
    s, client, values = world
    caplog.set_level(logging.DEBUG)
    bodies = []
    for token in [*s.tokens.values(), "cct_not-a-real-token-value-123456789"]:
        for method, path in (
            ("GET", "/api/v1/caches"),
            ("GET", "/api/v1/tokens"),
            ("POST", "/api/v1/caches/main/gc"),
            ("GET", "/metrics"),
            ("GET", "/api/v1/caches/main/environments/zz"),
        ):
            r = client.request(
                method, path, headers=bearer(token), json={} if method == "POST" else None
            )
            bodies.append(r.text + repr(dict(r.headers)))
        r = client.get("/api/v1/caches", params={"token": token})  # a token put in a URL by mistake
        bodies.append(r.text)
        r = client.post(
            "/login",
            content=f"token={token}x",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        bodies.append(r.text + repr(dict(r.headers)))
    # The test's own HTTP client (httpx) logs the URLs it requested; everything else is the server.
    server_log = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("httpx"))
    assert "GET /api/v1/caches 401" in server_log
    text = server_log + "\n".join(bodies)
    for token in s.tokens.values():
        assert token not in text
    assert "cct_not-a-real-token-value-123456789" not in text


def test_created_token_works_at_once_and_revocation_is_immediate(world) -> None:
    s, client, _values = world
    admin = bearer(s.tokens["admin"])
    made = client.post(
        "/api/v1/tokens", json={"name": "fresh", "role": "reader", "caches": [MAIN]}, headers=admin
    )
    assert made.status_code == 201, made.text
    secret = made.json()["token"]
    assert client.get("/api/v1/caches", headers=bearer(secret)).status_code == 200
    assert client.get(f"/api/v1/caches/{OTHER}", headers=bearer(secret)).status_code == 403
    listed = client.get("/api/v1/tokens", headers=admin).json()
    assert secret not in repr(listed) and "fresh" in {t["name"] for t in listed}
    assert client.delete("/api/v1/tokens/fresh", headers=admin).status_code == 200
    assert client.get("/api/v1/caches", headers=bearer(secret)).status_code == 401
    made = client.post(
        "/api/v1/tokens", json={"name": "fresh2", "role": "reader", "bogus": 1}, headers=admin
    )
    assert made.status_code == 422


def test_scoped_reader_sees_only_its_caches(world) -> None:
    s, client, _values = world
    names = [
        c["name"]
        for c in client.get("/api/v1/caches", headers=bearer(s.tokens["wrong_scope_reader"])).json()
    ]
    assert names == [OTHER]
    names = [
        c["name"] for c in client.get("/api/v1/caches", headers=bearer(s.tokens["reader"])).json()
    ]
    assert names == [MAIN, OTHER]


def test_token_cli_prints_secret_alone_on_last_line(tmp_path) -> None:
    from click.testing import CliRunner

    from cachectl.cli import cli

    db = f"sqlite:///{tmp_path}/index.db"
    runner = CliRunner()
    r = runner.invoke(
        cli,
        ["--db", db, "token", "create", "--name", "svc", "--role", "writer", "--expires", "90d"],
    )
    assert r.exit_code == 0, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("cct_") and " " not in last
    index = open_index(db)
    assert tokens.authenticate(index, last).role == "writer"
    index.close()
    r = runner.invoke(cli, ["--db", db, "token", "list", "--json"])
    assert r.exit_code == 0 and last not in r.output and '"svc"' in r.output
    r = runner.invoke(
        cli,
        ["--db", db, "token", "create", "--name", "bad", "--role", "reader", "--expires", "soon"],
    )
    assert r.exit_code == 2 and "bad duration" in r.output
    r = runner.invoke(cli, ["--db", db, "token", "revoke", "svc"])
    assert r.exit_code == 0
    r = runner.invoke(cli, ["--db", db, "token", "revoke", "nope"])
    assert r.exit_code == 2 and "no token named" in r.output


# `cachectl ARGS` in a new interpreter that writes, at exit, whether SQLAlchemy was imported.
_PROBE = """
import atexit, os, sys
atexit.register(lambda: open(os.environ["PROBE_OUT"], "w").write(str("sqlalchemy" in sys.modules)))
from cachectl.cli import main
sys.argv = ["cachectl", *sys.argv[1:]]
main()
"""


def _fresh(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], bool]:
    """(the process, whether it imported SQLAlchemy)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PROBE_OUT": str(out)},
        timeout=120,
    )
    return proc, out.read_text() == "True"


def test_token_create_in_a_fresh_process_makes_the_servers_token(db_url, tmp_path) -> None:
    """`token create` on an index that exists: on SQLite the stdlib driver writes it without
    SQLAlchemy (fast: BENCHMARKS.md); on both the server accepts it, `token list` shows it as one
    the SQL index wrote, the name and the scope are checked, and the audit log records it."""
    index = open_index(db_url, auto_migrate=True)
    index.add_cache(MAIN, str(tmp_path / "main"))
    tokens.create_token(index, "before", "writer", [MAIN], timedelta(days=90))
    out = tmp_path / "probe.txt"
    made, heavy = _fresh(
        out, "--db", db_url, "token", "create", "--name", "ci", "--role", "writer",
        "--cache", MAIN, "--cache", MAIN, "--expires", "90d",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert heavy == db_url.startswith("postgresql"), "SQLite's token create imported SQLAlchemy"
    secret = made.stdout.strip().splitlines()[-1]
    app = create_app(db_url)
    try:
        r = TestClient(app).get("/api/v1/caches", headers=bearer(secret))
        assert r.status_code == 200, r.text
    finally:
        app.state.cachectl.index.close()
    info = tokens.authenticate(index, secret)
    assert (info.name, info.role, info.caches) == ("ci", "writer", (MAIN,))

    listed, _ = _fresh(out, "--db", db_url, "token", "list", "--json")
    rows = {t["name"]: t for t in json.loads(listed.stdout)}
    assert sorted(rows) == ["before", "ci"]
    for row in rows.values():
        created, expires = (datetime.fromisoformat(row[k]) for k in ("created_at", "expires_at"))
        assert created.utcoffset() == timedelta(0) and expires - created == timedelta(days=90), row
    assert {k: v for k, v in rows["ci"].items() if k not in ("id", "name", "created_at", "expires_at", "last_used_at")} == {
        k: v for k, v in rows["before"].items() if k not in ("id", "name", "created_at", "expires_at", "last_used_at")
    }  # fmt: skip

    for args, error in (
        (["--name", "ci", "--role", "reader"], "error: a token named 'ci' exists"),
        (["--name", "new", "--role", "reader", "--cache", "nope"], "error: no cache named 'nope'"),
    ):
        bad, _ = _fresh(out, "--db", db_url, "token", "create", *args)
        assert bad.returncode == 2 and bad.stdout == "", bad
        assert bad.stderr.count("\n") == 1 and error in bad.stderr, bad.stderr
    assert [t.name for t in tokens.list_tokens(index)] == ["before", "ci"]  # nothing half-written
    audits = [a for a in index.audit_log() if a.operation == "token-create"]
    assert [a.details for a in audits] == [{"name": "ci", "role": "writer", "caches": [MAIN]}]
    index.close()


def test_a_revoked_tokens_name_can_be_used_again(db_url, tmp_path) -> None:
    """A token made, revoked, then made again under its name: on an index made before migration
    0014 (upgraded with the revoked row in it) and by both writers (on SQLite the stdlib driver's
    `token create`; the SQL index's library call). The revoked rows and their audit rows stay;
    only the new token authenticates; a name a token not revoked holds is still refused."""
    from cachectl.core.errors import BadInput
    from cachectl.index import db as index_db
    from cachectl.index.models import utcnow

    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine, "0013")  # an index as it was: names unique over every row
    with engine.begin() as conn:
        now = utcnow()
        conn.execute(
            Token.__table__.insert().values(
                name="ci-warm",
                role="writer",
                token_hash=tokens.hash_token("cct_first"),
                created_at=now,
                revoked_at=now,
            )
        )
    index_db.upgrade(engine)  # migration 0014, the revoked row in it
    engine.dispose()
    index = open_index(db_url)
    out = tmp_path / "probe.txt"
    made, _ = _fresh(
        out, "--db", db_url, "token", "create", "--name", "ci-warm", "--role", "writer"
    )
    assert made.returncode == 0, made.stderr
    second = made.stdout.strip().splitlines()[-1]
    with pytest.raises(BadInput, match="exists"):  # held by the token just made
        tokens.create_token(index, "ci-warm", "reader")
    bad, _ = _fresh(out, "--db", db_url, "token", "create", "--name", "ci-warm", "--role", "reader")
    assert bad.returncode == 2 and "a token named 'ci-warm' exists" in bad.stderr, bad.stderr
    with pytest.raises(tokens.InvalidToken):
        tokens.authenticate(index, "cct_first")
    assert tokens.authenticate(index, second).name == "ci-warm"
    tokens.revoke_token(index, "ci-warm")  # the second one: revoked by its name
    with pytest.raises(tokens.InvalidToken):
        tokens.authenticate(index, second)
    third = tokens.create_token(index, "ci-warm", "reader")  # the library's writer, a third time
    assert tokens.authenticate(index, third.token).role == "reader"
    listed = [(t.name, t.role, t.revoked_at is not None) for t in tokens.list_tokens(index)]
    assert listed == [
        ("ci-warm", "writer", True),
        ("ci-warm", "writer", True),
        ("ci-warm", "reader", False),
    ]
    creates = [a for a in index.audit_log() if a.operation == "token-create"]
    assert len(creates) >= 1 and all(a.details["name"] == "ci-warm" for a in creates)
    index.close()
