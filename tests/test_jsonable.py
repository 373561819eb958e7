"""The one wire format: library values to JSON (server, --json) and back (the client)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from cachectl.client import decode
from cachectl.core.fingerprint import current_environment
from cachectl.core.jsonable import REDACTED, from_jsonable, to_jsonable
from cachectl.core.records import CacheInfo, EnvironmentInfo
from cachectl.lifecycle.verify_records import VerifyFinding, VerifyPlan, VerifyResult


def _wire(value: object) -> object:
    return json.loads(json.dumps(to_jsonable(value)))


def test_records_survive_the_wire_with_their_types() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    env = EnvironmentInfo(
        id=7,
        cache="c",
        digest="d" * 64,
        namespace="jax-x/cpu",
        environment=current_environment(),
        created_at=at,
        last_seen_at=None,
        deleted_at=None,
        entries=3,
        bytes=1024,
    )
    back = from_jsonable(list[EnvironmentInfo], _wire([env]))
    assert back == [env] and isinstance(back[0].environment.xla_flags, tuple)
    cache = CacheInfo("c", "file:///x", max_size=10, writers=("alice",), created_at=at)
    assert from_jsonable(CacheInfo, _wire(cache)) == cache


def test_extra_json_keys_are_ignored_and_properties_recomputed() -> None:
    plan = VerifyPlan(
        cache="c",
        root="/r",
        entries_checked=2,
        findings=[VerifyFinding("corrupt", "ns", "ns/k", "sha256 differs", action="quarantine")],
    )
    result = VerifyResult(
        plan,
        quarantined=1,
        atimes_deleted=0,
        atimes_written=0,
        rows_dropped=0,
        dry_run=False,
        duration_s=0.5,
    )
    data = _wire(result)
    assert data["ok"] is False and data["plan"]["counts"] == {"corrupt": 1}
    back = from_jsonable(VerifyResult, data)
    assert back == result and back.ok is False


def test_the_client_drops_what_the_server_withheld() -> None:
    data = _wire(CacheInfo("c", "s3://b/p", storage_options={"key": "id", "secret": "s"}))
    data["storage_options"]["secret"] = REDACTED
    assert decode(CacheInfo, data).storage_options == {"key": "id"}


def test_indented_text_is_what_json_dumps_writes() -> None:
    """--json prints through dumps_indented: byte for byte json.dumps(indent=2), every kind of value."""
    from cachectl.core.jsonable import dumps_indented

    data = {
        "plan": {
            "entries": [
                {"key": "jit_f-0", "size": 12, "aot_size": None, "files": ["a/b", "a/c"]},
                {"key": 'ünï\u2028"q"\\', "size": -3, "aot_size": 7, "files": []},
            ],
            "notes": [],
            "criteria": {},
            "ratio": 0.1,
            "big": 10**30,
            "nan": float("nan"),
            "inf": float("inf"),
            "ninf": float("-inf"),
            "ok": True,
            "no": False,
            "tuple": (1, "x"),
        },
        1: "int key",
        2.5: "float key",
        False: "bool key",
        None: "none key",
        "nested": [[[]], [{}], [[1, [2.0]]]],
    }
    assert dumps_indented(data) == json.dumps(data, indent=2)
    for scalar in ("s", 0, 1.5, None, True, [], {}):
        assert dumps_indented(scalar) == json.dumps(scalar, indent=2)
    plan = VerifyPlan(
        cache="c",
        root="/r",
        entries_checked=2,
        findings=[VerifyFinding("corrupt", "ns", "ns/k", "sha256 differs", action="quarantine")],
    )
    assert dumps_indented(to_jsonable(plan)) == json.dumps(to_jsonable(plan), indent=2)
