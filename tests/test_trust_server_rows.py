"""Issue 50, findings 6 and 8 (tokens): a writer cannot break readers for good, and an empty scope
never means every cache. A real server on 127.0.0.1 over real HTTP, a real SQLite index written
straight through the stdlib driver (as a row stored before the fix was), `cachectl ls` in a real
process.

The edge answers a non-finite number with 422, the status it gives every JSON body it refuses
(NaN, Infinity, depth, lone surrogates) and FastAPI gives a body its models refuse; the client
maps 422 to bad input (exit 2), as 400.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import httpx
import pytest
from support.server_kit import MAIN, bearer, seed, served

from cachectl.core.jsonable import NOT_FINITE
from cachectl.storage.entries import sha256

API = "/api/v1"


@pytest.fixture
def world(tmp_path):
    return seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))


def _post(c: httpx.Client, path: str, text: str, headers: dict) -> httpx.Response:
    return c.post(path, content=text, headers={**headers, "content-type": "application/json"})


def test_non_finite_numbers_are_refused_at_the_edge(world) -> None:
    s = world
    key = s.keys[0]
    blob = s.entry_bytes[key]
    claim = {"key": key, "size": len(blob), "sha256": sha256(blob)}
    w = bearer(s.tokens["writer"])
    entries = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    audit = f"{API}/caches/{MAIN}/audit"
    with served(s.db) as (_live, c):
        for number in ("1e999", "-1e999", "1E+400", "1" * 400 + ".5"):
            body = '{"entries": [' + json.dumps(claim)[:-1] + ', "bucket": {"b": ' + number + "}}]}"
            res = _post(c, entries, body, w)
            assert res.status_code == 422 and "finite" in res.json()["detail"], (number, res.text)
            res = _post(c, audit, '{"operation": "warm", "details": {"d": ' + number + "}}", w)
            assert res.status_code == 422 and "finite" in res.json()["detail"], (number, res.text)
        # Finite numbers with big exponents, and the same text inside strings, are fine.
        fine = {"b": 1e300, "tiny": 1e-300, "note": "1e999"}
        res = _post(c, entries, json.dumps({"entries": [{**claim, "bucket": fine}]}), w)
        assert res.status_code == 200, res.text
        res = _post(c, audit, json.dumps({"operation": "warm", "details": fine}), w)
        assert res.status_code in (200, 201), res.text


def test_a_stored_non_finite_number_never_breaks_a_listing(world, tmp_path) -> None:
    """Rows written before the fix, straight into the index: every listing still answers."""
    s = world
    db = sqlite3.connect(s.db.removeprefix("sqlite:///"))
    with db:
        db.execute("UPDATE entries SET bucket = ?", ('{"b": 1e999, "n": -1e999}',))
        db.execute(
            "INSERT INTO audit_log (at, actor, operation, cache_name, entries, bytes, details) "
            "VALUES ('2026-01-01 00:00:00.000000', 'w@h', 'warm', ?, 0, 0, ?)",
            (MAIN, '{"d": 1e999}'),
        )
    db.close()
    entries = f"{API}/caches/{MAIN}/environments/{s.digest}/entries"
    with served(s.db) as (_live, c):
        res = c.get(entries, headers=bearer(s.tokens["reader"]))
        assert res.status_code == 200, res.text
        assert all(i["bucket"] == {"b": NOT_FINITE, "n": NOT_FINITE} for i in res.json()["items"])
        res = c.get(f"{API}/caches/{MAIN}/audit", headers=bearer(s.tokens["admin"]))
        assert res.status_code == 200 and NOT_FINITE in res.text, res.text
    done = subprocess.run(
        [sys.executable, "-m", "cachectl", "--db", s.db, "--cache", MAIN, "ls"]
        + ["--env", s.digest[:12], "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert NOT_FINITE in done.stdout


def test_a_token_with_an_empty_scope_is_refused(world) -> None:
    s = world
    admin = bearer(s.tokens["admin"])
    with served(s.db) as (_live, c):
        res = c.post(
            f"{API}/tokens", json={"name": "nothing", "role": "reader", "caches": []}, headers=admin
        )
        assert res.status_code == 400 and "scoped to no cache" in res.text, res.text
        listed = c.get(f"{API}/tokens", headers=admin).json()
        assert "nothing" not in json.dumps(listed)
        res = c.post(
            f"{API}/tokens",
            json={"name": "main-only", "role": "reader", "caches": [MAIN]},
            headers=admin,
        )
        assert res.status_code == 201, res.text
