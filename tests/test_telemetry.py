"""Hit/miss telemetry: real compiles in fresh processes, the log tap, the bound, the stats window."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

from click.testing import CliRunner
from support.infra import run_py

from cachectl import telemetry
from cachectl.cli import cli
from cachectl.core.fingerprint import current_environment
from cachectl.index import db as index_db
from cachectl.index import open_index
from cachectl.index.telemetry_queries import record_telemetry, telemetry_stats
from cachectl.telemetry import Collector, FunctionCounts, MemorySink, TelemetryBatch

SERVICE = """
import json, cachectl, jax, jax.numpy as jnp
from cachectl import telemetry
a = cachectl.activate("loc", readonly={readonly})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
@jax.jit
def predict(x):
    return jnp.tanh(x @ x.T).sum()
predict(jnp.ones((16, 16))).block_until_ready()
print(json.dumps({{"digest": a.digest, "telemetry": a.telemetry}}))
"""  # no explicit flush: the exit flush must deliver


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_service_telemetry_reaches_the_index_with_hit_keys(tmp_path, monkeypatch) -> None:
    db = f"sqlite:///{tmp_path}/index.db"
    monkeypatch.setenv("CACHECTL_DB", db)
    monkeypatch.setenv("CACHECTL_CACHE", "loc")
    _cli("cache", "add", "loc", str(tmp_path / "shared"), "--service-writes", "allow")

    first = run_py(SERVICE.format(readonly=False))  # misses: writes every program
    assert first.returncode == 0, first.stderr
    _cli("sync", "--min-age", "0")
    second = run_py(SERVICE.format(readonly=True))  # hits everything
    assert second.returncode == 0, second.stderr
    info = json.loads(second.stdout.strip().splitlines()[-1])
    assert info["telemetry"] == f"index {db}"

    usage = json.loads(_cli("stats", "--since", "1h", "--json"))
    (env,) = usage["environments"]
    assert env["environment"] == info["digest"] and env["processes"] == 2
    # jnp.ones's eager staging programs (broadcast_in_dim, convert_element_type) are looked up,
    # written by the first process and found by the second, yet not cacheable: counted apart.
    assert env["requests"] == env["hits"] + env["misses"] + env["uncacheable"]
    assert env["misses"] == env["hits"] == 1 and env["uncacheable"] == 4
    fn = {f["function"]: f for f in usage["functions"]}
    assert all(f["hits"] == f["misses"] == 0 for m, f in fn.items() if m != "jit_predict")
    assert fn["jit_predict"]["requests"] == 2 and fn["jit_predict"]["hits"] == 1
    assert fn["jit_predict"]["misses"] == 1 and fn["jit_predict"]["writes"] == 1
    assert fn["jit_predict"]["hit_rate"] == 0.5
    assert None not in fn  # every request was attributed to its module

    # The hit keys reached the entries: last access and hit count, from the log tap.
    index = open_index(db)
    env_info = index.find_environment("loc", info["digest"])
    entries = {e.module: e for e in index.list_entries(env_info.id)}
    assert (
        entries["jit_predict"].hit_count == 1 and entries["jit_predict"].last_access_at is not None
    )
    assert all(e.hit_count == 1 for e in entries.values())
    index.close()

    text = _cli("stats", "--since", "1h")
    assert "jit_predict" in text and "50%" in text


def test_log_tap_keeps_service_logs_as_they_were(tmp_path) -> None:
    """The tap feeds the collector without changing the service's logs: JAX's DEBUG records reach
    the service's handlers only once it asks for DEBUG itself, and still name JAX's source line."""
    code = f"""
    import logging, sys, json, jax, jax.numpy as jnp, cachectl
    from cachectl import telemetry
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(filename)s %(message)s")
    cachectl.activate(root={str(tmp_path / "c")!r}, readonly=False, db="sqlite:///{tmp_path}/i.db")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda x: x * 3)(jnp.ones(3)).block_until_ready()
    print("MARK")
    logging.getLogger().setLevel(logging.DEBUG)
    jax.jit(lambda x: x * 4)(jnp.ones(3)).block_until_ready()
    c = telemetry.current(); c.flush()
    print("STATS " + json.dumps(c.stats().__dict__))
    """
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.split("MARK")
    assert "PERSISTENT COMPILATION CACHE MISS" not in before
    assert not [line for line in before.splitlines() if line.startswith("LOG jax._src.compiler")]
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit__lambda'" in after
    miss = next(line for line in after.splitlines() if "PERSISTENT COMPILATION CACHE MISS" in line)
    assert miss.startswith("LOG jax._src.compiler compiler.py ")
    stats = json.loads(next(line for line in after.splitlines() if line.startswith("STATS "))[6:])
    assert stats["requests"] >= 2 and stats["failed_flushes"] == 0


def test_collector_buffer_is_bounded_and_counts_drops() -> None:
    """Through JAX's real monitoring and logging entry points, with a tiny bound."""
    from jax import monitoring

    sink = MemorySink()
    logger = logging.getLogger(telemetry.COMPILER_LOGGER)
    level = logger.level
    collector = Collector(
        cache="c",
        environment_digest="d" * 64,
        sink=sink,
        interval_s=3600,
        max_functions=2,
        max_keys=2,
    )
    collector.install()
    try:
        assert logger.level == level  # the tap changes no level (so no DEBUG records are built)
        for i in range(5):
            monitoring.record_event(telemetry.EVENT_REQUESTS)
            logger.debug(
                "Persistent compilation cache hit for '%s' with key %r",
                f"jit_f{i}",
                f"jit_f{i}-{i:064x}",
            )
            monitoring.record_event(telemetry.EVENT_HITS)
            monitoring.record_event_duration_secs(telemetry.EVENT_SAVED, 0.5)
        assert collector.flush() is True
    finally:
        collector.uninstall(flush=False)
    assert logger.level == level
    (batch,) = sink.batches
    assert set(batch.functions) == {"jit_f0", "jit_f1"}
    assert len(batch.hit_keys) == 2
    assert batch.dropped > 0
    stats = collector.stats()
    assert stats.requests == 5 and stats.hits == 5 and stats.saved_seconds == 2.5
    assert stats.dropped == batch.dropped
    # Uninstalled: JAX events no longer reach it.
    monitoring.record_event(telemetry.EVENT_REQUESTS)
    assert collector.stats().requests == 5


def test_stats_window_and_dropped_counts(db_url) -> None:
    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)  # PostgreSQL is never migrated implicitly
    engine.dispose()
    index = open_index(db_url)
    index.add_cache("c", "/tmp/unused-root")
    env = current_environment()
    env_id = index.ensure_environment("c", env).id
    now = datetime.now(UTC)

    def batch(
        at: datetime, process: str, fn: str, req: int, hits: int, dropped: int = 0
    ) -> TelemetryBatch:
        return TelemetryBatch(
            process,
            "c",
            env.digest,
            at,
            at,
            {
                fn: FunctionCounts(
                    requests=req, hits=hits, writes=req - hits, saved_seconds=1.5 * hits
                )
            },
            {},
            dropped,
        )

    record_telemetry(index, env_id, batch(now - timedelta(days=3), "old:1", "jit_old", 10, 0))
    record_telemetry(
        index, env_id, batch(now - timedelta(minutes=5), "a:1", "jit_f", 4, 3, dropped=7)
    )
    record_telemetry(index, env_id, batch(now - timedelta(minutes=1), "b:2", "jit_f", 2, 2))
    record_telemetry(index, env_id, batch(now - timedelta(minutes=1), "b:2", "jit_g", 1, 0))

    day = telemetry_stats(index, "c", timedelta(hours=24))
    (e,) = day.environments
    assert (e.processes, e.requests, e.hits, e.misses, e.writes, e.dropped) == (2, 7, 5, 2, 2, 7)
    assert abs(e.saved_seconds - 7.5) < 1e-9 and abs(e.hit_rate - 5 / 7) < 1e-9
    assert [(f.function, f.requests, f.hits) for f in day.functions] == [
        ("jit_f", 6, 5),
        ("jit_g", 1, 0),
    ]
    week = telemetry_stats(index, "c", timedelta(days=7))
    assert week.environments[0].requests == 17
    assert telemetry_stats(index, "c", timedelta(seconds=1)).environments == []
    index.close()
