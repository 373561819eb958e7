"""activate() on a managed cache: read-only mode, the typed result, exec/env, ordering rules.

Every JAX check runs in a fresh process (infra.run_py): JAX's persistent cache
is process-wide state, and "a miss writes no file" needs a real compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

from click.testing import CliRunner
from support.infra import run_py

from cachectl.cli import cli
from cachectl.storage.store import Store

COMPILE = """
import json, os, jax, jax.numpy as jnp, cachectl
a = cachectl.activate({args})
f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x)
f(jnp.ones((8,))).block_until_ready()
from cachectl import telemetry
s = telemetry.current().stats() if telemetry.current() else None
print(json.dumps({{"path": a.path, "namespace": a.namespace, "readonly": a.readonly, "digest": a.digest,
                  "telemetry": a.telemetry, "warning": a.warning, "indexed": a.indexed,
                  "requests": s and s.requests, "hits": s and s.hits, "writes": s and s.writes}}))
"""


def _run(args: str = "", env: dict[str, str | None] | None = None) -> dict:
    proc = run_py(COMPILE.format(args=args), env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _entries(path: str) -> list[str]:
    return (
        sorted(n for n in os.listdir(path) if n.endswith("-cache")) if os.path.isdir(path) else []
    )


def test_readonly_policy_miss_writes_no_file_and_override_writes(tmp_path, monkeypatch) -> None:
    """Policy deny -> read-only: a real miss writes nothing; CACHECTL_READONLY=false overrides it."""
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    root = tmp_path / "shared"
    _cli("cache", "add", "svc", str(root), "--service-writes", "deny")
    # Even with JAX told to write everything, read-only activation wins.
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    ro = _run("'svc'", env)
    assert ro["readonly"] is True and ro["indexed"] is True
    assert ro["path"] == str(root / ro["namespace"])
    assert ro["requests"] >= 1 and ro["hits"] == 0 and ro["writes"] == 0
    assert _entries(ro["path"]) == []

    rw = _run("'svc'", {**env, "CACHECTL_READONLY": "false"})
    assert rw["readonly"] is False and rw["path"] == ro["path"]
    assert rw["writes"] >= 1
    assert any(n.startswith("jit__lambda") for n in _entries(rw["path"]))

    # The argument beats both the policy and the environment.
    again = _run("'svc', readonly=True", {**env, "CACHECTL_READONLY": "false"})
    assert again["readonly"] is True and again["writes"] == 0 and again["hits"] >= 1


def test_activation_is_typed_and_object_stores_default_to_readonly(
    tmp_path, monkeypatch, s3_bucket
) -> None:
    """An s3:// cache is read-only for services by default; the result says where telemetry goes."""
    db = f"sqlite:///{tmp_path}/index.db"
    monkeypatch.setenv("CACHECTL_DB", db)
    _cli("cache", "add", "remote", s3_bucket + "/cache")
    code = """
    import json, dataclasses, cachectl
    a = cachectl.activate("remote", telemetry=True)
    import jax
    print(json.dumps({**dataclasses.asdict(a), "jax_dir": jax.config.jax_compilation_cache_dir,
                      "min": jax.config.jax_persistent_cache_min_compile_time_secs,
                      "xla": jax.config.jax_persistent_cache_enable_xla_caches,
                      "max": jax.config.jax_compilation_cache_max_size}))
    """
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    a = json.loads(proc.stdout.strip().splitlines()[-1])
    assert a["readonly"] is True and a["warning"] is None and a["indexed"] is True
    assert a["path"] == f"{s3_bucket}/cache/{a['namespace']}" == a["jax_dir"]
    assert a["telemetry"] == f"index {db}"
    assert a["min"] >= 1e9 and a["xla"] == "none" and a["max"] == -1
    # Read-only: activation wrote nothing to the bucket (not even env.json).
    assert Store(s3_bucket + "/cache").list("") == []


def test_warns_when_jax_compiled_before_activate_and_refuses_another_dir(tmp_path) -> None:
    code = f"""
    import json, jax, jax.numpy as jnp, cachectl, logging
    jax.jit(lambda x: x + 1)(jnp.ones(2))
    a = cachectl.activate(root={str(tmp_path / "c")!r})
    print(json.dumps({{"compiled_before": a.compiled_before, "warning": a.warning}}))
    jax.jit(lambda x: x * 5)(jnp.ones(2)).block_until_ready()
    try:
        cachectl.activate(root={str(tmp_path / "other")!r})
    except cachectl.service.activate.ActivationError as exc:
        print("refused:", exc)
    """
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    first, refused = proc.stdout.strip().splitlines()[-2:]
    result = json.loads(first)
    assert result["compiled_before"] is True
    assert "JAX compiled before cachectl.activate()" in result["warning"]
    assert refused.startswith("refused: JAX already compiled with the persistent cache at ")
    assert str(tmp_path / "c") in refused


def test_exec_readonly_runs_the_command_with_the_env_and_writes_nothing(
    tmp_path, monkeypatch
) -> None:
    """`cachectl exec --readonly`: a service that cannot call activate() reads but never writes."""
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    root = tmp_path / "local"
    _cli("cache", "add", "loc", str(root), "--service-writes", "allow")
    env_out = _cli("--cache", "loc", "env", "--readonly", "--format", "json")
    variables = json.loads(env_out)
    assert float(variables["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) >= 1e9
    assert variables["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] == "none"
    ns_dir = variables["JAX_COMPILATION_CACHE_DIR"]
    snippet = (
        "import os, jax, jax.numpy as jnp; "
        "jax.jit(lambda x: jnp.cos(x) * 7)(jnp.ones(16)).block_until_ready(); "
        "print(os.environ['JAX_COMPILATION_CACHE_DIR'])"
    )
    cachectl = os.path.join(os.path.dirname(sys.executable), "cachectl")
    proc = subprocess.run(
        [cachectl, "--cache", "loc", "exec", "--readonly", "--", sys.executable, "-c", snippet],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ns_dir
    assert _entries(ns_dir) == []
    # CACHECTL_READONLY drives `cachectl env` too when no flag is given.
    monkeypatch.setenv("CACHECTL_READONLY", "true")
    assert (
        float(
            json.loads(_cli("--cache", "loc", "env", "--format", "json"))[
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
            ]
        )
        >= 1e9
    )


def test_root_and_mode_given_activation_skips_the_index(tmp_path) -> None:
    """CACHECTL_ROOT + CACHECTL_READONLY: no index (nor SQLAlchemy) before JAX starts; the
    environment and telemetry still reach the index, from the background."""
    db = f"sqlite:///{tmp_path}/fresh-index.db"  # does not exist yet: created in the background
    code = """
    import json, sys, cachectl, jax, jax.numpy as jnp
    a = cachectl.activate()
    loaded = "sqlalchemy" in sys.modules
    jax.jit(lambda x: x - 1)(jnp.ones(3)).block_until_ready()
    print(json.dumps({"indexed": a.indexed, "readonly": a.readonly, "path": a.path, "sqlalchemy": loaded,
                      "digest": a.digest, "warning": a.warning}))
    """
    proc = run_py(
        code, {"CACHECTL_DB": db, "CACHECTL_ROOT": str(tmp_path / "root"), "CACHECTL_READONLY": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sqlalchemy"] is False and out["indexed"] is False and out["readonly"] is True
    assert out["warning"] is None and out["path"].startswith(str(tmp_path / "root"))
    from cachectl.index import open_index
    from cachectl.index.telemetry_queries import telemetry_stats

    index = open_index(db)
    assert index.find_environment("default", out["digest"]).digest == out["digest"]
    (usage,) = telemetry_stats(index, "default", timedelta(hours=1)).environments
    assert usage.requests >= 1 and usage.hits == 0
    index.close()
