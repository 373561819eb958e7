"""JAX itself writes into the managed namespace; sync then indexes what it wrote."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner
from support.infra import run_py

from cachectl.cli import cli
from cachectl.storage.store import Store

SERVICE_SNIPPET = """
import json, os, jax, jax.numpy as jnp, cachectl
a = cachectl.activate(readonly=False)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
f = jax.jit(lambda x, y: jnp.sin(x) @ y + 1.0)
for n in (4, 8):
    f(jnp.ones((n, n)), jnp.ones((n, n))).block_until_ready()
print(json.dumps({"path": a.path, "namespace": a.namespace, "digest": a.digest}))
"""


def _cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("backend", ["local", "s3", "gcs", "az"])
def test_jax_writes_then_sync_indexes(backend: str, request, tmp_path, monkeypatch) -> None:
    root = {
        "local": lambda: str(tmp_path / "shared"),
        "s3": lambda: request.getfixturevalue("s3_bucket") + "/cache",
        "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/cache",
        "az": lambda: request.getfixturevalue("az_container") + "/cache",
    }[backend]()
    db = f"sqlite:///{tmp_path}/index.db"
    monkeypatch.setenv("CACHECTL_DB", db)
    monkeypatch.setenv("CACHECTL_CACHE", "shared")
    _cli("cache", "add", "shared", root, "--service-writes", "allow")

    proc = run_py(SERVICE_SNIPPET)
    assert proc.returncode == 0, proc.stderr
    service = json.loads(proc.stdout.strip().splitlines()[-1])

    store = Store(root)
    written = {
        f.path.rsplit("/", 1)[1][: -len("-cache")]: f
        for f in store.list(service["namespace"])
        if f.path.endswith("-cache")
    }
    assert len(written) >= 2, "JAX should have written entries into the namespace"

    plan = json.loads(_cli("sync", "--min-age", "0", "--dry-run", "--json"))
    assert plan["entries_added"] == len(written) and plan["dry_run"] is True
    assert (
        json.loads(_cli("ls", "--json"))["environments"][0]["entries"] == 0
    )  # dry run changed nothing

    done = json.loads(_cli("sync", "--min-age", "0", "--json"))
    assert done["entries_added"] == len(written)
    listing = json.loads(_cli("ls", "--env", service["digest"][:12], "--json"))
    assert listing["environment"]["namespace"] == service["namespace"]
    indexed = {e["key"]: e for e in listing["entries"]}
    assert set(indexed) == set(written)
    for key, info in written.items():
        data = store.read_bytes(info.path)
        assert indexed[key]["size"] == len(data) == info.size
        assert indexed[key]["sha256"] == hashlib.sha256(data).hexdigest()
        assert indexed[key]["origin"] == "observed"

    assert json.loads(_cli("sync", "--min-age", "0", "--json"))["entries_added"] == 0  # idempotent

    # A file removed behind the index's back is dropped from it.
    gone = next(iter(written.values()))
    store.delete([gone.path])
    assert json.loads(_cli("sync", "--min-age", "0", "--json"))["rows_dropped"] == 1
    assert (
        len(json.loads(_cli("ls", "--env", service["digest"][:12], "--json"))["entries"])
        == len(written) - 1
    )


def test_sync_rebuilds_a_lost_index(tmp_path, monkeypatch) -> None:
    root = str(tmp_path / "shared")
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/first.db")
    monkeypatch.setenv("CACHECTL_CACHE", "shared")
    _cli("cache", "add", "shared", root)
    proc = run_py(SERVICE_SNIPPET)
    assert proc.returncode == 0, proc.stderr
    _cli("sync", "--min-age", "0")
    before = json.loads(_cli("ls", "--json"))["environments"]

    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/second.db")
    _cli("cache", "add", "shared", root)
    result = json.loads(_cli("sync", "--min-age", "0", "--json"))
    assert result["environments_added"] == 1
    after = json.loads(_cli("ls", "--json"))["environments"]
    assert [(e["digest"], e["entries"], e["bytes"]) for e in after] == [
        (e["digest"], e["entries"], e["bytes"]) for e in before
    ]
