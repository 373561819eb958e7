"""Issue 15, item 17: bad input is one line on stderr, exit 2, nothing written, never a traceback.

Each case runs the installed CLI in a real process (what users and scripts see)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cachectl.core.units import parse_duration, parse_size


def cachectl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def assert_bad_input(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cachectl: error: "), done.stderr


def snapshot(*roots: Path) -> dict[str, bytes]:
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p)] = p.read_bytes()
    return out


@pytest.fixture
def index_db(tmp_path) -> str:
    db = f"sqlite:///{tmp_path}/index.db"
    done = cachectl("--db", db, "cache", "add", "main", str(tmp_path / "main"))
    assert done.returncode == 0, done.stderr
    return db


def test_a_corrupt_or_truncated_index_is_bad_input(tmp_path, index_db) -> None:
    path = tmp_path / "index.db"
    data = path.read_bytes()
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(data[: len(data) // 3])
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not an SQLite database at all" * 100)
    scrambled = tmp_path / "scrambled.db"
    blob = bytearray(data)
    blob[4096:8192] = os.urandom(4096)  # the first table pages
    scrambled.write_bytes(bytes(blob))
    for bad in (truncated, garbage, scrambled):
        before = bad.read_bytes()
        for args in (("ls",), ("cache", "list"), ("stats", "--json")):
            done = cachectl("--db", f"sqlite:///{bad}", *args)
            assert_bad_input(done)
            assert "index" in done.stderr
        assert bad.read_bytes() == before


def test_env_json_that_is_not_an_object(tmp_path, index_db) -> None:
    ns = tmp_path / "main" / "jax-0.10.2" / "cpu-cpu-x1" / "0123456789abcdef"
    ns.mkdir(parents=True)
    for content in ("[1, 2, 3]", '"just a string"', "42", "null"):
        (ns / "env.json").write_text(content)
        before = snapshot(tmp_path / "main")
        # sync scans storage: a bad namespace is reported and skipped, as any corrupt env.json is
        done = cachectl("--db", index_db, "--cache", "main", "sync", "--json")
        assert "Traceback" not in done.stderr and done.returncode == 0, done.stderr
        problems = [n["problem"] for n in json.loads(done.stdout)["plan"]["namespaces"]]
        assert len(problems) == 1 and "not an object" in problems[0]
        assert snapshot(tmp_path / "main") == before
        # a mirror directory given on the command line is input: exit 2
        mirror = tmp_path / f"mirror-{len(content)}"
        mirror.mkdir()
        (mirror / "env.json").write_text(content)
        assert_bad_input(cachectl("--db", index_db, "--cache", "main", "pull", "--to", str(mirror)))
        assert (mirror / "env.json").read_text() == content and len(list(mirror.iterdir())) == 1
    from cachectl.core.errors import BadInput
    from cachectl.storage.namespace import read_env_json
    from cachectl.storage.store import Store

    for content in ("[1, 2, 3]", '"x"', "42", "null", json.dumps({"jax_version": []})):
        (ns / "env.json").write_text(content)
        with pytest.raises(BadInput):
            read_env_json(Store(str(tmp_path / "main")), "jax-0.10.2/cpu-cpu-x1/0123456789abcdef")


def test_sizes_and_durations_that_overflow(tmp_path, index_db) -> None:
    from cachectl.core.errors import BadInput

    for text in ("99999999999999TiB", "9" * 40, "1e400"):
        with pytest.raises(BadInput):
            parse_size(text)
    for text in ("99999999999w", "9" * 30 + "s", "1000000000d"):
        with pytest.raises(BadInput):
            parse_duration(text)
    before = snapshot(tmp_path)
    for args in (
        ("cache", "add", "big", str(tmp_path / "big"), "--max-size", "99999999999999TiB"),
        ("cache", "add", "old", str(tmp_path / "old"), "--retention", "99999999999w"),
        ("cache", "set", "main", "--max-size", "99999999999999TiB"),
        ("cache", "set", "main", "--retention", "99999999999w"),
        ("--cache", "main", "prune", "--older-than", "99999999999w", "--dry-run"),
        ("--cache", "main", "stats", "--since", "99999999999w"),
    ):
        assert_bad_input(cachectl("--db", index_db, *args))
    assert snapshot(tmp_path) == before
    listed = {
        c["name"]: c
        for c in json.loads(cachectl("--db", index_db, "cache", "list", "--json").stdout)
    }
    assert "big" not in listed and "old" not in listed
    assert listed["main"]["max_size"] is None and listed["main"]["retention_seconds"] is None


def test_cache_roots_that_cannot_be_caches(tmp_path, index_db) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    before = snapshot(tmp_path)
    for root in (
        "/proc/self/cachectl",
        "/proc/sys",
        "/sys/kernel",
        "/dev/null",
        str(a_file),
        str(a_file / "below"),
    ):
        assert_bad_input(cachectl("--db", index_db, "cache", "add", "bad", root))
    for root in ("/etc/passwd", "/proc/sys", str(a_file)):
        assert_bad_input(cachectl("--db", index_db, "cache", "set", "main", "--url", root))
    assert snapshot(tmp_path) == before
    listed = {
        c["name"]: c
        for c in json.loads(cachectl("--db", index_db, "cache", "list", "--json").stdout)
    }
    assert "bad" not in listed and listed["main"]["root_url"] == str(tmp_path / "main")


def test_a_missing_token_file(tmp_path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'server = "http://127.0.0.1:9"\ntoken_file = "{tmp_path / "no-such-token"}"\n'
    )
    done = cachectl("ls", env={"CACHECTL_CONFIG": str(config)})
    assert_bad_input(done)
    assert "token_file" in done.stderr
    (tmp_path / "a-dir").mkdir()
    config.write_text(f'server = "http://127.0.0.1:9"\ntoken_file = "{tmp_path / "a-dir"}"\n')
    assert_bad_input(cachectl("ls", env={"CACHECTL_CONFIG": str(config)}))


def test_the_index_of_a_broken_file_is_never_rewritten(tmp_path) -> None:
    """A database that is not ours is refused; it is not 'migrated' into one."""
    other = tmp_path / "someone-elses.db"
    con = sqlite3.connect(other)
    con.execute("create table caches (x)")
    con.commit()
    con.close()
    done = cachectl("--db", f"sqlite:///{other}", "cache", "list")
    assert_bad_input(done)
    con = sqlite3.connect(other)
    tables = [r[0] for r in con.execute("select name from sqlite_master where type = 'table'")]
    con.close()
    assert tables == ["caches"]  # no alembic_version, no cachectl tables added


BOMB = """version: 1
a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
functions:
  - fn: os:getcwd
    args: []
    buckets: {n: *i}
"""


def test_a_manifest_alias_bomb_and_too_many_buckets(tmp_path) -> None:
    import time

    from cachectl.core.errors import BadInput
    from cachectl.manifest import parse_manifest

    started = time.monotonic()
    with pytest.raises(BadInput, match="alias"):
        parse_manifest(BOMB, name="bomb.yaml")
    assert time.monotonic() - started < 5
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    done = cachectl("warm", str(bomb), "--dry-run")
    assert_bad_input(done)
    assert "bomb.yaml" in done.stderr
    axis = ", ".join(str(n) for n in range(1, 201))
    many = tmp_path / "many.yaml"
    many.write_text(
        f"version: 1\nfunctions:\n  - fn: os:getcwd\n    args: []\n"
        f"    buckets: {{a: [{axis}], b: [{axis}]}}\n"
    )
    with pytest.raises(BadInput, match="40000 buckets"):
        parse_manifest(many.read_text(), name="many.yaml")
    done = cachectl("warm", str(many), "--dry-run")
    assert_bad_input(done)
    assert "many.yaml:5" in done.stderr and "10000" in done.stderr


def test_max_buckets_raises_the_limit(tmp_path) -> None:
    axis = ", ".join(str(n) for n in range(1, 201))
    wide = tmp_path / "wide.yaml"
    wide.write_text(
        f"version: 1\nfunctions:\n  - fn: os:getcwd\n    args: []\n"
        f"    buckets: {{a: [{axis}], b: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}}\n"
    )  # 2,400
    assert_bad_input(cachectl("warm", str(wide), "--dry-run", "--max-buckets", "1000"))
    done = cachectl("warm", str(wide), "--dry-run", "--json", "--max-buckets", "5000")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["buckets"] == 2400
    assert_bad_input(cachectl("warm", str(wide), "--dry-run", env={"CACHECTL_MAX_BUCKETS": "lots"}))


def _alias_chain(levels: int, anchors: int) -> str:
    """Anchors each nesting the previous one ``levels`` deep: each is shallow, the whole is not."""
    lines = ["version: 1", "functions: []"]
    inner = "1"
    for n in range(anchors):
        lines.append(f"a{n}: &a{n} " + "[" * levels + inner + "]" * levels)
        inner = f"*a{n}"
    return "\n".join(lines) + "\n"


def test_manifests_nested_too_deep_binary_or_past_int64_are_one_line(tmp_path) -> None:
    """Issue 22, item 13: these were RecursionError/ReaderError tracebacks (exit 1), or a dry run
    that passed (exit 0) for a shape whose warm then aborted the process (exit 134)."""
    cases = {
        "deep-lists.yaml": "version: 1\nfunctions: " + "[" * 5000 + "]" * 5000 + "\n",
        "deep-mappings.yaml": "".join("  " * i + f"k{i}:\n" for i in range(2000)),
        "aliases.yaml": _alias_chain(20, 80),
        "garbage.yaml": "\x00\x01\x02 version: 1\n\x7f\x1b[31m",
        "overflow.yaml": (
            "version: 1\nfunctions:\n  - fn: operator:neg\n    args:\n"
            "      - {shape: [batch, 4294967296, 4294967296], dtype: float32}\n"
            "    buckets: {batch: [1, 2]}\n"
        ),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        done = cachectl("warm", str(path), "--dry-run")
        assert_bad_input(done)
        assert name in done.stderr, done.stderr
    assert "overflow.yaml:5: functions[0].args[0].shape" in done.stderr
    # what still fits is not refused: 2^59 elements in the largest bucket
    fits = tmp_path / "fits.yaml"
    fits.write_text(
        cases["overflow.yaml"].replace("4294967296, 4294967296", "536870912, 536870912")
    )
    from cachectl.manifest import parse_manifest

    parse_manifest(fits.read_text(), name="fits.yaml")


def test_an_index_in_a_missing_directory_is_refused_until_db_upgrade_makes_it(tmp_path) -> None:
    """`--db sqlite:///…/no/such/x.db` (or CACHECTL_DB): one line, exit 2, nothing created (the
    suite runs as root too, which could create any directory); `db upgrade` creates it."""
    missing = tmp_path / "no" / "such"
    db = f"sqlite:///{missing}/x.db"
    for args, env in (
        (("--db", db, "ls"), None),
        (("--db", db, "cache", "list", "--json"), None),
        (("token", "create", "--name", "a", "--role", "reader"), {"CACHECTL_DB": db}),
        (("--db", db, "db", "current"), None),
    ):
        done = cachectl(*args, env=env)
        assert_bad_input(done)
        assert f"directory {missing} does not exist" in done.stderr and "db upgrade" in done.stderr
        assert not (tmp_path / "no").exists(), args
    made = cachectl("--db", db, "db", "upgrade")
    assert made.returncode == 0 and (missing / "x.db").is_file(), made.stderr
    listed = cachectl("--db", db, "cache", "list", "--json")
    assert listed.returncode == 0, listed.stderr
