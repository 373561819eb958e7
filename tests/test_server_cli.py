"""The CLI in server mode (CACHECTL_SERVER + CACHECTL_TOKEN): same output and exit codes as direct mode.

A real uvicorn server runs in this process over a seeded SQLite index; the
same commands run once with --db (direct) and once through the server, and
their outputs are compared. Warm registration and activate() telemetry go
through the server too, with real JAX compiles in fresh processes.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from support.infra import run_py
from support.server_kit import MAIN, LiveServer, seed

from cachectl.cli import cli
from cachectl.index import open_index
from cachectl.index.models import Job
from cachectl_server.app import create_app

# Timings (and "now - window") differ between any two runs, direct or not.
_TIMINGS = re.compile(
    r'("(planning_s|duration_s)": )[0-9.e-]+|\b\d+\.\d+s\b|("since": )"[^"]+"'
    r"|(since )\d{4}-\d\d-\d\d \d\d:\d\d"
)


def normalized(text: str) -> str:
    return _TIMINGS.sub(lambda m: (m.group(1) or m.group(3) or m.group(4) or "") + "T", text)


def _serve(tmp):
    s = seed(f"sqlite:///{tmp}/index.db", str(tmp / "main"), str(tmp / "other"), entries=5)
    app = create_app(s.db)
    with LiveServer(app) as live:
        yield s, live
    app.state.cachectl.index.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that only read (and the token test, which cleans up)."""
    yield from _serve(tmp_path_factory.mktemp("served"))


@pytest.fixture
def served(tmp_path):
    """A server of its own, for tests that change the cache."""
    yield from _serve(tmp_path)


def both(s, live, *args: str, token: str = "admin") -> tuple[tuple[int, str], tuple[int, str]]:
    """(exit code, output) direct, then through the server."""
    runner = CliRunner()
    direct = runner.invoke(cli, ["--db", s.db, "--cache", MAIN, *args])
    remote = runner.invoke(
        cli,
        ["--cache", MAIN, *args],
        env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens[token]},
    )
    return (direct.exit_code, direct.output), (remote.exit_code, remote.output)


@pytest.mark.parametrize(
    "args",
    [
        ("ls", "--json"),
        ("ls",),
        ("stats", "--json"),
        ("stats",),
        ("stats", "--all", "--json"),
        ("ls", "--env", "PREFIX", "--json"),
        ("ls", "--env", "PREFIX"),
        ("stats", "--since", "1d", "--json"),
        ("ls", "--env", "zz"),
        ("ls", "--env", "0000000"),
    ],
    ids=lambda a: " ".join(a),
)
def test_reads_match_direct_mode(shared, args) -> None:
    s, live = shared
    args = tuple(a.replace("PREFIX", s.digest[:12]) for a in args)
    direct, remote = both(s, live, *args, token="reader")
    assert remote[0] == direct[0]
    assert normalized(remote[1]) == normalized(direct[1])
    if args[-1] == "--json" and direct[0] == 0:
        json.loads(direct[1])


def test_errors_match_direct_mode(shared) -> None:
    s, live = shared
    runner = CliRunner()
    direct = runner.invoke(cli, ["--db", s.db, "--cache", "nope", "ls"])
    remote = runner.invoke(
        cli,
        ["--cache", "nope", "ls"],
        env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["admin"]},
    )
    assert (
        (remote.exit_code, remote.output) == (direct.exit_code, direct.output) == (2, remote.output)
    )
    assert "no cache named 'nope'" in remote.output
    denied = runner.invoke(
        cli,
        ["--cache", MAIN, "ls"],
        env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["revoked"]},
    )
    assert denied.exit_code == 4 and "refused the token" in denied.output
    assert s.tokens["revoked"] not in denied.output
    scoped = runner.invoke(
        cli,
        ["--cache", "other", "ls"],
        env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["scoped_writer"]},
    )
    assert scoped.exit_code == 4 and "scoped to main" in scoped.output
    down = runner.invoke(
        cli,
        ["--cache", MAIN, "ls"],
        env={"CACHECTL_SERVER": "http://127.0.0.1:9", "CACHECTL_TOKEN": "x"},
    )
    assert down.exit_code == 2 and "unreachable" in down.output and "Traceback" not in down.output


def test_prune_gc_verify_through_the_server(served) -> None:
    s, live = served
    for args in (
        ("prune", "--function", "train", "--dry-run", "--json"),
        ("prune", "--function", "train", "--dry-run"),
        ("gc", "--max-size", "1", "--dry-run", "--json"),
        ("gc", "--max-size", "1", "--dry-run"),
        ("verify", "--json"),
        ("verify",),
        ("prune", "--keep", "2"),
        ("gc", "--policy", "nope"),
    ):
        direct, remote = both(s, live, *args)
        assert remote[0] == direct[0], (args, direct, remote)
        assert normalized(remote[1]) == normalized(direct[1]), args
    # a real prune, through the server, as a job; then the index agrees
    runner = CliRunner()
    env = {"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["admin"]}
    done = runner.invoke(cli, ["--cache", MAIN, "prune", "--function", "train", "--json"], env=env)
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["execution"]["entries_deleted"] == 3
    index = open_index(s.db)
    assert sum(e.entries for e in index.environment_stats(MAIN)) == 2
    assert any(a.operation == "prune" for a in index.audit_log(MAIN))
    index.close()
    # a writer token may not: exit 4, the server's message
    denied = runner.invoke(
        cli,
        ["--cache", MAIN, "gc", "--max-size", "1"],
        env={**env, "CACHECTL_TOKEN": s.tokens["writer"]},
    )
    assert denied.exit_code == 4 and "needs role admin" in denied.output


def test_sync_through_the_server_records_what_storage_holds(served) -> None:
    """sync in server mode reads storage here and writes the index through the server's API: a file
    JAX wrote (not in the index) is added with its real size, sha256 and module; a second sync finds
    nothing to do."""
    from support.server_kit import entry_key

    from cachectl.storage.entries import make_entry, sha256
    from cachectl.storage.store import Store

    s, live = served
    store = Store(s.root)
    data = make_entry(b"written by a service" * 50, compile_seconds=2)
    new_key = entry_key("jit_served", 7)
    store.write_bytes(f"{s.env.namespace}/{new_key}-cache", data)
    env = {"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["admin"]}
    runner = CliRunner()
    done = runner.invoke(cli, ["--cache", MAIN, "sync", "--min-age", "0", "--json"], env=env)
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert (report["entries_added"], report["entries_updated"], report["rows_dropped"]) == (
        1,
        0,
        0,
    ), report
    index = open_index(s.db)
    (info,) = index.environment_stats(MAIN)
    rows = {e.key: e for e in index.list_entries(info.id)}
    index.close()
    assert set(rows) == {new_key, *s.keys}
    assert (rows[new_key].size, rows[new_key].sha256, rows[new_key].module) == (
        len(data),
        sha256(data),
        "jit_served",
    )
    again = json.loads(
        runner.invoke(cli, ["--cache", MAIN, "sync", "--min-age", "0", "--json"], env=env).output
    )
    assert (again["entries_added"], again["entries_updated"], again["rows_dropped"]) == (0, 0, 0)


def test_token_commands_through_the_server(shared) -> None:
    s, live = shared
    runner = CliRunner()
    env = {"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["admin"]}
    made = runner.invoke(
        cli, ["token", "create", "--name", "via-api", "--role", "reader", "--cache", MAIN], env=env
    )
    assert made.exit_code == 0, made.output
    secret = made.output.strip().splitlines()[-1]
    listed = runner.invoke(
        cli,
        ["ls", "--json"],
        env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": secret, "CACHECTL_CACHE": MAIN},
    )
    assert listed.exit_code == 0 and json.loads(listed.output)["cache"] == MAIN
    assert runner.invoke(cli, ["token", "revoke", "via-api"], env=env).exit_code == 0


WARM_MODULE = """
import jax.numpy as jnp

def scale(x, k=2.0):
    return jnp.sin(x) * k
"""

WARM_MANIFEST = """
version: 1
cache: main
target: {backend: cpu}
functions:
  - fn: srv_warm:scale
    args: [{shape: [batch, 4], dtype: float32}]
    buckets: {batch: [1, 2]}
"""

SERVICE = """
import json, sys
import numpy as np
import jax
import cachectl
sys.path.insert(0, {dir!r})
import srv_warm
from cachectl import telemetry
act = cachectl.activate("main", readonly=True)
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
fn = jax.jit(srv_warm.scale)
for b in (1, 2):
    fn(np.ones((b, 4), np.float32)).block_until_ready()
before = telemetry.current().stats()
stats = telemetry.stop(flush=True)
print(json.dumps({{"before": before.__dict__, "after": stats.__dict__, "warning": act.warning, "telemetry": act.telemetry, "indexed": act.indexed,
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0), "flushes": stats.flushes,
                  "failed": stats.failed_flushes}}))
"""


def test_warm_registration_and_activate_telemetry_through_the_server(served, tmp_path) -> None:
    s, live = served
    (tmp_path / "srv_warm.py").write_text(textwrap.dedent(WARM_MODULE))
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(textwrap.dedent(WARM_MANIFEST))
    env = {"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["writer"], "CACHECTL_DB": None}
    warm = run_py(
        f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(manifest)!r}, "--path", {str(tmp_path)!r}, "--jobs", "1", "--json"]
        main()
    """,
        env=env,
        timeout=300,
    )
    assert warm.returncode == 0, warm.stdout + warm.stderr
    report = json.loads(warm.stdout)
    assert report["summary"]["compiled"] == 2
    index = open_index(s.db)
    envs = {e.digest: e for e in index.environment_stats(MAIN)}
    warmed = envs[report["environment"]["digest"]]
    entries = index.list_entries(warmed.id)
    assert len(entries) == 2 and {e.origin for e in entries} == {"warm"}
    runs = [r for r in index.audit_log(MAIN) if r.operation == "warm"]
    assert runs and "via token:writer" in runs[0].actor
    from cachectl.index import warm_runs

    (run,) = warm_runs.list_runs(index, cache=MAIN)
    assert run.status == "succeeded" and run.compiled == 2 and "via token writer" in run.user
    # a read-only service: activate() resolves through the server, telemetry flushes to it
    out = run_py(
        SERVICE.format(dir=str(tmp_path)), env={**env, "CACHECTL_TOKEN": s.tokens["reader"]}
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hits"] == 2 and result["warning"] is None, result
    assert (
        result["telemetry"] == f"server {live.url}"
        and result["flushes"] >= 1
        and result["failed"] == 0
    ), (result, out.stderr[-3000:])
    hit = {e.key: e.hit_count for e in index.list_entries(warmed.id)}
    assert sorted(hit.values()) == [1, 1]
    # warm-check through the server: the check runs; recording its proof is refused, said so
    check = run_py(
        f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm-check", {str(manifest)!r}, "--path", {str(tmp_path)!r}, "--json"]
        main()
    """,
        env=env,
        timeout=300,
    )
    checked = json.loads(check.stdout)
    assert checked["summary"]["hits"] == 2, check.stdout + check.stderr
    assert checked["proof"] is None
    assert (
        "recording warm-check's proof is not available through the server"
        in (checked["proof_error"])
    )
    assert all(e.proof is None for e in index.environment_stats(MAIN))
    index.close()


def test_a_down_server_costs_a_service_one_warning(tmp_path) -> None:
    """activate() with CACHECTL_SERVER pointing nowhere: a warning, JAX still gets its cache dir."""
    out = run_py(
        """
        import json, time, warnings
        warnings.simplefilter("ignore")
        import cachectl
        t = time.monotonic()
        act = cachectl.activate("main")  # no mode given: the cache's policy is asked for
        print(json.dumps({"path": act.path, "warning": act.warning, "s": time.monotonic() - t}))
    """,
        env={
            "CACHECTL_SERVER": "http://127.0.0.1:9",
            "CACHECTL_TOKEN": "cct_x",
            "CACHECTL_ROOT": str(tmp_path / "root"),
        },
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["path"].startswith(str(tmp_path / "root")) and "unreachable" in result["warning"]
    assert "cct_x" not in out.stdout + out.stderr


def test_flags_the_server_does_not_take_are_refused_not_dropped(served) -> None:
    """verify --deep and prune/gc --batch-size were sent nowhere in server mode (the job ran
    without them, exit 0): now bad input, exit 2, one line, and no job is started."""
    s, live = served
    runner = CliRunner()
    env = {"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["admin"]}
    for args, flag in (
        (("verify", "--deep"), "verify --deep"),
        (("verify", "--deep", "--json"), "verify --deep"),
        (("prune", "--function", "train", "--batch-size", "10"), "--batch-size"),
        (("gc", "--max-size", "1", "--dry-run", "--batch-size", "10"), "--batch-size"),
    ):
        done = runner.invoke(cli, ["--cache", MAIN, *args], env=env)
        lines = [line for line in done.output.splitlines() if line.strip()]
        assert done.exit_code == 2, (args, done.output)
        assert len(lines) == 1 and "works only in direct mode" in lines[0], done.output
        assert flag in lines[0] and "Traceback" not in done.output
    index = open_index(s.db)
    try:
        with index.session() as session:
            assert session.scalars(select(Job)).all() == []
        assert sum(e.entries for e in index.environment_stats(MAIN)) == 5
    finally:
        index.close()
    # the default batch size is what the server does: accepted
    done = runner.invoke(
        cli,
        ["--cache", MAIN, "gc", "--max-size", "1", "--dry-run", "--batch-size", "1000"],
        env=env,
    )
    assert done.exit_code == 0, done.output
