"""Verified local mirror: pull from s3:// (moto), all hits; tampered/slipped objects refused; push."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner
from support.infra import run_py

from cachectl.cli import cli
from cachectl.core.fingerprint import current_environment
from cachectl.index import NewEntry, open_index
from cachectl.storage.entries import make_entry, sha256
from cachectl.storage.store import Store

PROGRAMS = """
import jax, jax.numpy as jnp
fs = [jax.jit(lambda x: jnp.sin(x) * 2.0), jax.jit(lambda x: x @ x.T + 1.0), jax.jit(lambda x: jnp.cumsum(x, 0))]
for f in fs:
    f(jnp.ones((8, 8))).block_until_ready()
"""

WRITER = (
    """
import json, cachectl, jax
a = cachectl.activate("remote", readonly=False, telemetry=False)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
"""
    + PROGRAMS
    + """
print(json.dumps({"namespace": a.namespace, "path": a.path}))
"""
)

MIRRORED = (
    """
import json, cachectl
from cachectl import telemetry
a = cachectl.activate("remote", mirror={mirror!r})
"""
    + PROGRAMS
    + """
s = telemetry.current().stats()
import sys
print(json.dumps({{"path": a.path, "copied": a.pull.copied, "refused": len(a.pull.refused),
                  "listed": a.pull.storage_listed, "s3fs": "s3fs" in sys.modules,
                  "warning": a.warning, "requests": s.requests, "hits": s.hits, "writes": s.writes}}))
"""
)


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_pull_from_s3_hits_everything_and_refuses_tampered_objects(
    tmp_path, monkeypatch, s3_bucket
) -> None:
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    monkeypatch.setenv("CACHECTL_CACHE", "remote")
    _cli("cache", "add", "remote", s3_bucket + "/cache")

    # Entries come from real JAX compiles writing straight into s3://, then sync indexes them.
    proc = run_py(WRITER)
    assert proc.returncode == 0, proc.stderr
    written = _json_line(proc.stdout)
    assert json.loads(_cli("sync", "--min-age", "0", "--json"))["entries_added"] >= 3
    store = Store(s3_bucket + "/cache")
    keys = sorted(
        f.path.rsplit("/", 1)[1]
        for f in store.list(written["namespace"])
        if f.path.endswith("-cache")
    )

    # A fresh process mirrors the namespace and hits every program it compiles.
    mirror = tmp_path / "mirror"
    proc = run_py(MIRRORED.format(mirror=str(mirror)))
    assert proc.returncode == 0, proc.stderr
    run = _json_line(proc.stdout)
    assert run["path"] == str(mirror) and run["warning"] is None
    assert run["copied"] == len(keys) and run["refused"] == 0, proc.stderr
    assert run["requests"] >= 3 and run["hits"] == run["requests"] and run["writes"] == 0
    assert sorted(n for n in os.listdir(mirror) if n.endswith("-cache")) == keys
    # A restart on a complete mirror never touches the bucket (nor loads the S3 client).
    proc = run_py(MIRRORED.format(mirror=str(mirror)))
    assert proc.returncode == 0, proc.stderr
    restart = _json_line(proc.stdout)
    assert restart["copied"] == 0 and restart["listed"] is False and restart["s3fs"] is False
    assert restart["hits"] == restart["requests"] == run["requests"]
    assert json.loads((mirror / "env.json").read_text())["namespace"] == written["namespace"]

    # Someone tampers with one object and slips another into the bucket.
    tampered = keys[0]
    store.write_bytes(f"{written['namespace']}/{tampered}", make_entry(b"evil payload", 1))
    slipped = "jit_backdoor-" + "ab" * 32 + "-cache"
    store.write_bytes(f"{written['namespace']}/{slipped}", make_entry(b"also evil", 1))

    fresh = tmp_path / "mirror2"
    out = _cli("pull", "--to", str(fresh), "--json", code=1)
    result = json.loads(out)
    refused = {p["key"] + "-cache": p["reason"] for p in result["refused"]}
    assert set(refused) == {tampered, slipped}
    assert "sha256" in refused[tampered] and "not in the index" in refused[slipped]
    assert result["copied"] == len(keys) - 1 and result["ok"] is False
    present = set(os.listdir(fresh))
    assert tampered not in present and slipped not in present
    assert not [n for n in present if n.startswith(".tmp-")]

    # The existing mirror keeps its verified copy (it never re-downloads the tampered object) and
    # still reports the slipped one.
    again = json.loads(_cli("pull", "--to", str(mirror), "--json", code=1))
    assert again["copied"] == 0 and again["present"] == len(keys)
    assert [p["key"] + "-cache" for p in again["refused"]] == [slipped]
    assert (mirror / tampered).read_bytes() != store.read_bytes(
        f"{written['namespace']}/{tampered}"
    )

    # Human output names the refused entries.
    text = _cli("pull", "--to", str(fresh), code=1)
    assert "refused" in text and "jit_backdoor" in text


FOUR = """
import jax.numpy as jnp
x = jnp.ones((8, 8))
fs = [jax.jit(lambda v, c=float(i): jnp.sin(v) * c + c) for i in range(4)]
for f in fs:
    f(x).block_until_ready()
"""

JAX_COUNTED = (
    """
import json, cachectl, jax
from jax import monitoring
jax_events = {{}}
monitoring.register_event_listener(
    lambda event, **kw: jax_events.__setitem__(event, jax_events.get(event, 0) + 1)
)
from cachectl import telemetry
a = cachectl.activate("remote", mirror={mirror!r})
"""
    + FOUR
    + """
s = telemetry.current().stats()
print(json.dumps({{"copied": a.pull.copied, "indexed": a.pull.indexed, "warning": a.warning,
                  "hits": s.hits, "misses": s.misses, "requests": s.requests,
                  "jax_hits": jax_events.get("/jax/compilation_cache/cache_hits", 0),
                  "jax_requests": jax_events.get("/jax/compilation_cache/compile_requests_use_cache", 0)}}))
"""
)


def test_a_mirror_of_an_unsynced_bucket_says_so_and_its_counts_are_jaxs(
    tmp_path, monkeypatch, s3_bucket
) -> None:
    """Entries JAX wrote straight to s3:// are not in the index until `sync` records them (and it
    skips young ones): a mirror pulls nothing, JAX misses every program, and activate() says why
    instead of the service quietly compiling. Once synced the mirror hits, by JAX's own count."""
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    monkeypatch.setenv("CACHECTL_CACHE", "remote")
    _cli("cache", "add", "remote", s3_bucket + "/cache")
    writer = """
import cachectl, jax
cachectl.activate("remote", readonly=False, telemetry=False)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
"""
    run_py(writer + FOUR, check=True)
    # A plain sync leaves entries younger than --min-age (5 minutes) out of the index.
    assert json.loads(_cli("sync", "--json"))["entries_added"] == 0

    proc = run_py(JAX_COUNTED.format(mirror=str(tmp_path / "m1")), check=True)
    cold = _json_line(proc.stdout)
    assert cold["indexed"] == cold["copied"] == 0
    # JAX's own events: a request per program it looked up, a hit per one it read.
    assert cold["jax_hits"] == 0 and cold["jax_requests"] >= 4, cold
    assert (cold["hits"], cold["requests"]) == (cold["jax_hits"], cold["jax_requests"]), cold
    assert "the index lists no entries for this environment" in (cold["warning"] or ""), cold
    assert "cachectl sync" in cold["warning"]

    assert json.loads(_cli("sync", "--min-age", "0", "--json"))["entries_added"] >= 4
    proc = run_py(JAX_COUNTED.format(mirror=str(tmp_path / "m2")), check=True)
    warm = _json_line(proc.stdout)
    assert warm["warning"] is None and warm["copied"] == warm["indexed"] >= 4, warm
    assert warm["jax_requests"] == cold["jax_requests"], warm
    assert warm["jax_hits"] == warm["jax_requests"], warm  # everything, read from the mirror
    assert (warm["hits"], warm["requests"]) == (warm["jax_hits"], warm["jax_requests"]), warm

    # What both services flushed to the index: the four programs missed once, then hit once (the
    # eager staging programs JAX also looked up are counted as not cacheable, hit or not).
    (env,) = json.loads(_cli("stats", "--since", "1h", "--json"))["environments"]
    assert env["requests"] == cold["jax_requests"] + warm["jax_requests"]
    assert (env["hits"], env["misses"]) == (4, 4), env
    assert env["uncacheable"] == env["requests"] - 8


def _local_cache(tmp_path: Path, monkeypatch, writers: str = "") -> tuple[str, Path]:
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    monkeypatch.setenv("CACHECTL_CACHE", "loc")
    root = tmp_path / "shared"
    args = ["cache", "add", "loc", str(root)]
    if writers:
        args += ["--writers", writers]
    _cli(*args)
    return f"sqlite:///{tmp_path}/index.db", root


def _key(module: str, n: int) -> str:
    return f"{module}-{n:064x}"


def test_push_uploads_new_entries_for_writers_only(tmp_path, monkeypatch) -> None:
    db, root = _local_cache(tmp_path, monkeypatch)
    env = current_environment()
    index = open_index(db)
    shared = make_entry(b"shared executable", 2)
    info = index.ensure_environment("loc", env)
    index.upsert_entries(
        info.id, [NewEntry(_key("jit_a", 1), "jit_a", len(shared), sha256(shared), "warm")]
    )
    Store(str(root)).write_bytes(f"{env.namespace}/{_key('jit_a', 1)}-cache", shared)

    mirror = tmp_path / "mirror"
    pulled = json.loads(_cli("pull", "--to", str(mirror), "--json"))
    assert pulled["copied"] == 1 and pulled["ok"] is True
    # The local run wrote two new entries, a conflicting copy of a shared key, and junk.
    new1, new2 = make_entry(b"new one", 3), make_entry(b"new two", 0)
    (mirror / f"{_key('jit_b', 2)}-cache").write_bytes(new1)
    (mirror / f"{_key('jit_c', 3)}-cache").write_bytes(new2)
    (mirror / f"{_key('jit_junk', 4)}-cache").write_bytes(b"not an entry at all")

    dry = json.loads(_cli("push", "--from", str(mirror), "--dry-run", "--json", code=1))
    assert dry["uploaded"] == 2 and dry["dry_run"] is True
    assert not Store(str(root)).exists(f"{env.namespace}/{_key('jit_b', 2)}-cache")

    result = json.loads(_cli("push", "--from", str(mirror), "--json", code=1))
    assert result["uploaded"] == 2 and result["already_shared"] == 1
    assert [p["key"] for p in result["refused"]] == [_key("jit_junk", 4)]
    assert Store(str(root)).read_bytes(f"{env.namespace}/{_key('jit_b', 2)}-cache") == new1
    rows = {e.key: e for e in index.list_entries(info.id)}
    assert (
        rows[_key("jit_b", 2)].origin == "push" and rows[_key("jit_b", 2)].compile_time_ms == 3000
    )
    assert rows[_key("jit_c", 3)].sha256 == sha256(new2)
    assert index.audit_log("loc")[0].operation == "push"

    # Same key, other bytes: the shared copy wins and the conflict is reported.
    (mirror / f"{_key('jit_junk', 4)}-cache").unlink()
    (mirror / f"{_key('jit_b', 2)}-cache").write_bytes(make_entry(b"different", 3))
    result = json.loads(_cli("push", "--from", str(mirror), "--json"))
    assert result["uploaded"] == 0 and [p["key"] for p in result["conflicts"]] == [_key("jit_b", 2)]
    index.close()


def test_push_refused_for_non_writers_and_unknown_dirs(tmp_path, monkeypatch) -> None:
    _local_cache(tmp_path, monkeypatch, writers="nobody-else-at-all")
    mirror = tmp_path / "m"
    mirror.mkdir()
    out = CliRunner().invoke(cli, ["push", "--from", str(mirror)])
    assert out.exit_code == 2 and "no env.json" in out.output  # bad input before permissions
    (mirror / "env.json").write_text(current_environment().env_json())
    out = CliRunner().invoke(cli, ["push", "--from", str(mirror)])
    assert out.exit_code == 4 and "may not push to cache 'loc'" in out.output


def test_pull_refuses_a_directory_of_another_environment(tmp_path, monkeypatch) -> None:
    db, _ = _local_cache(tmp_path, monkeypatch)
    env = current_environment()
    index = open_index(db)
    index.ensure_environment("loc", env)
    index.close()
    other = replace(env, device_count=env.device_count + 7)
    mirror = tmp_path / "m"
    mirror.mkdir()
    (mirror / "env.json").write_text(other.env_json())
    out = CliRunner().invoke(cli, ["pull", "--to", str(mirror)])
    assert out.exit_code == 2
    assert "holds environment" in out.output and "Traceback" not in out.output

    # A directory full of entries of unknown origin is refused too.
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / f"jit_x-{0:064x}-cache").write_bytes(make_entry(b"x"))
    out = CliRunner().invoke(cli, ["pull", "--to", str(unknown)])
    assert out.exit_code == 2 and "already holds JAX entries but no env.json" in out.output
    assert not (unknown / "env.json").exists()


def test_pull_of_an_unwarmed_environment_is_bad_input(tmp_path, monkeypatch) -> None:
    _local_cache(tmp_path, monkeypatch)
    out = CliRunner().invoke(cli, ["pull", "--to", str(tmp_path / "m")])
    assert out.exit_code == 2 and "nothing verified to pull" in out.output
    assert not (tmp_path / "m").exists()
