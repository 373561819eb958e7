"""A service is never worse off than plain JAX: index down, bucket down."""

from __future__ import annotations

import json

from click.testing import CliRunner
from support.infra import free_port, run_py

from cachectl.cli import cli

SERVICE = """
import json, logging, time, sys
t0 = time.monotonic()
import jax, jax.numpy as jnp, cachectl
from cachectl import telemetry
a = cachectl.activate({args})
t1 = time.monotonic()
y = jax.jit(lambda x: jnp.sin(x) + 2.0)(jnp.zeros(4)).block_until_ready()
t2 = time.monotonic()
c = telemetry.current()
flushed = c.flush() if c else None
s = c.stats() if c else None
print(json.dumps({{"path": a.path, "readonly": a.readonly, "warning": a.warning, "y": float(y.sum()),
                  "activate_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "flushed": flushed,
                  "requests": s and s.requests, "dropped": s and s.dropped,
                  "failed_flushes": s and s.failed_flushes, "last_error": s and s.last_error}}))
"""


def _service(args: str, env: dict[str, str | None]) -> tuple[dict, str]:
    proc = run_py(SERVICE.format(args=args), env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _cachectl_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "cachectl:" in line]


def test_index_unreachable_activates_from_root_with_one_warning(tmp_path) -> None:
    root = tmp_path / "root"
    out, stderr = _service(
        "",
        {
            "CACHECTL_DB": f"postgresql+psycopg://x@127.0.0.1:{free_port()}/none",
            "CACHECTL_ROOT": str(root),
        },
    )
    assert out["path"].startswith(str(root) + "/jax-")
    assert out["y"] == 8.0
    assert "index unavailable" in out["warning"]
    warnings = _cachectl_warnings(stderr)
    assert len(warnings) == 2, stderr
    assert "index unavailable" in warnings[0]
    # Nothing can verify the cache (no index, no trusted key): nothing is read from it (issue 50).
    assert "cannot be verified" in warnings[1] and "CACHECTL_RUN_UNVERIFIED_CODE" in warnings[1]
    # Telemetry could not reach the index: counts dropped and counted, nothing raised.
    assert out["requests"] >= 1
    assert out["flushed"] is False and out["failed_flushes"] >= 1 and out["dropped"] >= 1
    assert out["last_error"]


def test_bucket_unreachable_service_still_compiles(tmp_path, monkeypatch, s3_bucket) -> None:
    """Registered s3:// cache, then the endpoint goes away: JAX warns, the service runs."""
    monkeypatch.setenv("CACHECTL_DB", f"sqlite:///{tmp_path}/index.db")
    result = CliRunner().invoke(cli, ["cache", "add", "remote", s3_bucket + "/cache"])
    assert result.exit_code == 0, result.output
    dead = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}

    # Read-only (the s3 default): activation touches no storage, so no cachectl warning at all.
    out, stderr = _service("'remote'", dead)
    assert out["readonly"] is True and out["y"] == 8.0 and out["warning"] is None
    assert _cachectl_warnings(stderr) == [], stderr
    assert "Error reading persistent compilation cache entry" in stderr  # JAX's own warning
    print(
        f"read-only, bucket down: activate {out['activate_s']}s, first compile {out['compile_s']}s"
    )

    # A writer prepares the namespace with one short attempt: one cachectl warning, then JAX's.
    out, stderr = _service("'remote', readonly=False", dead)
    assert out["readonly"] is False and out["y"] == 8.0
    warnings = _cachectl_warnings(stderr)
    assert len(warnings) == 1 and "could not prepare namespace" in warnings[0], stderr
    print(
        f"writable, bucket down: activate {out['activate_s']}s, first compile {out['compile_s']}s"
    )
