"""`cachectl doctor`: real environments in the index, real files and modes on disk."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from click.testing import CliRunner
from support.infra import clear_fsspec_instance_caches, free_port

from cachectl.cli import cli
from cachectl.context import Context
from cachectl.core.config import load_settings
from cachectl.core.fingerprint import Environment, current_environment
from cachectl.index import NewEntry
from cachectl.service.doctor import ERROR, INFO, WARNING, diagnose
from cachectl.storage.entries import make_entry, sha256

PLAIN_JAX = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_enable_xla_caches": "none",
    "jax_compilation_cache_include_metadata_in_key": False,
    "jax_compilation_cache_max_size": -1,
}


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    monkeypatch.setenv("CACHECTL_CACHE", "loc")
    context = Context(load_settings())
    from cachectl.trust.caches import add_cache

    add_cache(context, "loc", str(tmp_path / "shared"))
    yield context
    context.close()


def warm(ctx: Context, env: Environment, n: int, *, files: bool = False) -> None:
    """Record an environment with n entries (and write them to storage if asked)."""
    info = ctx.index.ensure_environment("loc", env)
    store = ctx.store(ctx.cache())
    rows = []
    for i in range(n):
        data = make_entry(f"exe {env.digest} {i}".encode(), 2)
        key = f"jit_step-{i:064x}"
        rows.append(NewEntry(key, "jit_step", len(data), sha256(data), "warm"))
        if files:
            store.write_bytes(f"{env.namespace}/{key}-cache", data)
    ctx.index.upsert_entries(info.id, rows)


def messages(report, severity: str | None = None) -> list[str]:
    return [f.message for f in report.findings if severity is None or f.severity == severity]


def test_names_the_nearest_environment_and_every_difference(ctx) -> None:
    base = current_environment()
    near = replace(
        base, xla_flags=(), compression="zstandard", jaxlib_version="0.10.2", device_count=8
    )
    far = replace(near, backend="gpu", device_kind="NVIDIA H100", jax_version="0.9.0", topology="t")
    unwarmed = replace(
        base,
        xla_flags=("--xla_foo=true",),
        compression="zlib",
        jaxlib_version="0.10.1",
        device_count=4,
        topology="only-this-differs",
    )
    warm(ctx, near, 3)
    warm(ctx, far, 10)
    ctx.index.ensure_environment("loc", unwarmed)  # no entries: never the "nearest"
    here = replace(unwarmed, topology=base.topology)

    report = diagnose(ctx, env=here, environ={}, jax_config=PLAIN_JAX)
    assert report.nearest == near.digest and report.nearest_namespace == near.namespace
    assert not report.ok and report.errors >= 5
    errors = messages(report, ERROR)
    assert errors[0].startswith(f"no entries for this environment ({here.digest[:16]})")
    assert f"Nearest warmed environment: {near.namespace} (3 entries), 4 difference(s)" in errors[0]
    assert any(m.startswith("XLA_FLAGS differ: +--xla_foo=true") for m in errors)
    assert "compression: zlib here, zstandard in the warmed namespace — install zstandard" in errors
    assert any(m.startswith("jaxlib 0.10.1 vs 0.10.2") for m in errors)
    assert any(m.startswith("device_count 4 vs 8") for m in errors)
    assert {d.field for d in report.differences} == {
        "xla_flags",
        "compression",
        "jaxlib_version",
        "device_count",
    }
    fixes = {f.check: f.fix for f in report.findings}
    assert "pip install zstandard" in fixes["env:compression"]
    assert "install jaxlib==0.10.2" in fixes["env:jaxlib_version"]

    # A flag only the warmed side had is named as missing here.
    lost = replace(base, xla_flags=())
    warm(ctx, replace(base, xla_flags=("--xla_cpu_enable_fast_math=true",)), 5)
    report = diagnose(ctx, env=lost, environ={}, jax_config=PLAIN_JAX)
    assert (
        "XLA_FLAGS differ: missing here (set at warm): --xla_cpu_enable_fast_math=true"
        in messages(report)
    )


def test_cli_exit_codes_follow_errors(ctx) -> None:
    here = current_environment()
    warm(ctx, replace(here, device_count=here.device_count + 7), 2)
    out = CliRunner().invoke(cli, ["doctor", "--json"])
    assert out.exit_code == 1, out.output
    report = json.loads(out.output)
    assert report["ok"] is False and report["environment"] == here.digest
    assert any(
        f["message"].startswith(f"device_count {here.device_count} vs {here.device_count + 7}")
        for f in report["findings"]
    )
    human = CliRunner().invoke(cli, ["doctor"])
    assert human.exit_code == 1 and "nearest warmed:" in human.output and "fix:" in human.output

    warm(ctx, here, 2, files=True)
    out = CliRunner().invoke(cli, ["doctor", "--json"])
    report = json.loads(out.output)
    assert out.exit_code == 0, out.output
    assert report["ok"] is True and report["warmed_entries"] == 2
    assert [f["severity"] for f in report["findings"]].count(INFO) >= 1


def test_process_config_that_breaks_managed_keys(ctx) -> None:
    here = current_environment()
    warm(ctx, here, 1, files=True)
    ns_url = ctx.store(ctx.cache()).url_for(here.namespace)

    report = diagnose(
        ctx,
        env=here,
        environ={"JAX_COMPILATION_CACHE_DIR": ns_url},
        jax_config={
            **PLAIN_JAX,
            "jax_persistent_cache_enable_xla_caches": "xla_gpu_per_fusion_autotune_cache_dir",
        },
    )
    (err,) = messages(report, ERROR)
    assert "keys then depend on the cache path" in err

    report = diagnose(
        ctx,
        env=here,
        jax_config=PLAIN_JAX,
        environ={
            "JAX_COMPILATION_CACHE_MAX_SIZE": "1000000000",
            "JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY": "true",
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "all",
        },
    )
    warnings = messages(report, WARNING)
    assert report.ok
    assert any(
        "JAX_COMPILATION_CACHE_MAX_SIZE=1000000000" in m and "O(entries)" in m for m in warnings
    )
    assert any("include_metadata_in_key is on" in m for m in warnings)
    assert any("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=all" in m for m in warnings)

    report = diagnose(
        ctx,
        env=here,
        environ={
            "JAX_COMPILATION_CACHE_DIR": "/somewhere/else",
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
        },
        jax_config=PLAIN_JAX,
    )
    assert any("not this environment's namespace" in m for m in messages(report, WARNING))


def test_eviction_leftovers_and_writable_directories(ctx, tmp_path) -> None:
    here = current_environment()
    warm(ctx, here, 2, files=True)
    root = tmp_path / "shared"
    ns_dir = root / here.namespace
    (ns_dir / ".lockfile").write_bytes(b"")
    (ns_dir / f"jit_step-{0:064x}-atime").write_bytes((1).to_bytes(8, "little"))
    report = diagnose(ctx, env=here, environ={}, jax_config=PLAIN_JAX)
    (err,) = messages(report, ERROR)
    assert ".lockfile present" in err and "1 -cache file(s) have no -atime" in err
    assert f"jit_step-{1:064x}" in err
    os.remove(ns_dir / ".lockfile")
    os.remove(ns_dir / f"jit_step-{0:064x}-atime")

    os.chmod(root / here.namespace.split("/")[0], 0o777)
    os.chmod(ns_dir, 0o775)
    report = diagnose(ctx, env=here, environ={}, jax_config=PLAIN_JAX)
    (err,) = messages(report, ERROR)
    assert "world-writable" in err and "run" in err
    assert any("group-writable" in m for m in messages(report, WARNING))
    os.chmod(root / here.namespace.split("/")[0], 0o755)
    os.chmod(ns_dir, 0o755)
    assert diagnose(ctx, env=here, environ={}, jax_config=PLAIN_JAX).ok


def test_unreachable_index(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CACHECTL_DB", f"postgresql+psycopg://x@127.0.0.1:{free_port()}/none")
    monkeypatch.setenv("CACHECTL_ROOT", str(tmp_path / "root"))
    out = CliRunner().invoke(cli, ["doctor", "--json"])
    assert out.exit_code == 1, out.output
    report = json.loads(out.output)
    assert any(
        f["check"] == "index" and f["message"].startswith("index unreachable")
        for f in report["findings"]
    )


def test_unreachable_bucket(tmp_path, monkeypatch, s3_bucket) -> None:
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    assert CliRunner().invoke(cli, ["cache", "add", "remote", s3_bucket + "/c"]).exit_code == 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    clear_fsspec_instance_caches()
    out = CliRunner().invoke(cli, ["--cache", "remote", "doctor", "--json"])
    assert out.exit_code == 1, out.output
    report = json.loads(out.output)
    storage = [f for f in report["findings"] if f["check"] == "storage"]
    assert storage and storage[0]["severity"] == ERROR and s3_bucket[5:] in storage[0]["message"]
