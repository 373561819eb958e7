"""Program signatures in telemetry: what is recorded, the bounds (what is read from JAX: test_jax_seam.py)."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

from sqlalchemy import func, select
from support.infra import run_py

from cachectl import telemetry
from cachectl.core import jax_seam
from cachectl.core.fingerprint import current_environment
from cachectl.index import db as index_db
from cachectl.index import open_index
from cachectl.index.models import SignatureRecord
from cachectl.index.telemetry_queries import record_telemetry, signature_usage
from cachectl.telemetry import Collector, MemorySink
from cachectl.telemetry.rows import MAX_SIGNATURES_PER_FUNCTION

SERVICE = """
import json, numpy as np, jax
from cachectl.telemetry import Collector, MemorySink
from cachectl.telemetry.rows import MAX_SIGNATURES_PER_FUNCTION
jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
c = Collector(cache="c", environment_digest="d", sink=MemorySink(), interval_s=3600)
c.install()
def scale(x, factor, n):
    return x * factor * n
f = jax.jit(scale, static_argnames=["n"])
f(jax.device_put(np.ones((2, 3), np.float32), jax.devices()[0]), 0.5, n=3).block_until_ready()
f(np.ones((2, 3), np.float32), np.float32(0.5), n=3).block_until_ready()
jax.debug.callback(lambda: None)  # noqa
jax.jit(lambda x: (jax.debug.callback(lambda v: None, x), x)[1])(np.ones(2, np.float32))
out = []
for (module, *_), s in c.take().signatures.items():
    out.append(dict(module=module, leaves=[list(map(str, l)) for l in s.leaves], statics=s.statics,
                    source=s.source, hits=s.hits, misses=s.misses, uncacheable=s.uncacheable, key=s.key))
print(json.dumps(out))
"""


def test_signatures_of_a_real_service(tmp_path) -> None:
    proc = run_py(SERVICE.format(cache=str(tmp_path / "jax")), check=True)
    sigs = json.loads(proc.stdout.strip().splitlines()[-1])
    scale = [s for s in sigs if s["module"] == "jit_scale"]
    assert len(scale) == 2
    committed, plain = scale
    assert committed["leaves"] == [
        ["(2, 3)", "float32", "False", "SingleDeviceSharding(cpu:0)"],
        ["()", "float32", "True", "None"],
    ]
    assert plain["leaves"] == [
        ["(2, 3)", "float32", "False", "None"],
        ["()", "float32", "False", "None"],
    ]
    assert committed["statics"] == [["n", "3"]] and committed["source"].startswith(
        "scale at <string>:"
    )
    assert committed["misses"] == 1 and committed["hits"] == committed["uncacheable"] == 0
    assert committed["key"].startswith("jit_scale-") and committed["key"] != plain["key"]
    (cb,) = [s for s in sigs if s["module"] == "jit__lambda"]
    # Host callbacks: JAX looked it up and missed, but never writes it, so no warm can serve it:
    # not cacheable, as the function's counts (and `stats`) say, never a miss.
    assert cb["misses"] == 0 and cb["uncacheable"] == 1
    # np.float32(0.5) passed eagerly is staged by JAX itself: not cacheable, not a miss.
    staged = [s for s in sigs if s["source"] and "/jax/_src/dispatch.py:" in s["source"]]
    assert all(s["uncacheable"] == s["hits"] + s["misses"] + s["uncacheable"] for s in staged)


def test_signature_rows_stay_bounded_under_10000_distinct_shapes(db_url) -> None:
    """Through the real pxla and compiler loggers, 10,000 lowerings of distinct shapes in 10 flushes."""
    import jax.numpy as jnp
    from jax import core, monitoring

    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)
    engine.dispose()
    index = open_index(db_url)
    index.add_cache("c", "/tmp/unused-root")
    env = current_environment()
    env_id = index.ensure_environment("c", env).id
    sink = MemorySink()
    collector = Collector(cache="c", environment_digest=env.digest, sink=sink, interval_s=3600)
    pxla_logger = jax_seam.pxla_logger()
    compiler_logger = telemetry._compiler_logger()
    level = pxla_logger.level
    collector.install()
    try:
        assert pxla_logger.level == level and not pxla_logger.isEnabledFor(logging.INFO)
        for i in range(10_000):
            monitoring.record_event(telemetry.EVENT_REQUESTS)
            if pxla_logger.isEnabledFor(logging.DEBUG):
                pxla_logger.log(
                    logging.DEBUG,
                    "Compiling %s with global shapes and types %s. Argument mapping: %s.",
                    "jit(decode)",
                    [core.ShapedArray((i + 1,), jnp.float32)],
                    [None],
                )
            compiler_logger.log(
                logging.DEBUG,
                "PERSISTENT COMPILATION CACHE MISS for '%s' with key %r",
                "jit_decode",
                f"jit_decode-{i:064x}",
            )
            # the miss's compile ends, as JAX says after every miss (a miss still compiling at a
            # flush keeps its signature for the next one: JAX may yet call it not cacheable)
            monitoring.record_event_duration_secs(jax_seam.EVENT_BACKEND_COMPILE, 0.001)
            if i % 1000 == 999:
                collector.flush()
    finally:
        collector.uninstall(flush=False)
    assert pxla_logger.level == level and "isEnabledFor" not in pxla_logger.__dict__
    assert len(sink.batches) == 10 and all(len(b.signatures) == 1000 for b in sink.batches)
    for b in sink.batches:
        record_telemetry(index, env_id, b)
    with index.read_session() as s:
        rows = s.scalar(select(func.count()).select_from(SignatureRecord))
        total = s.scalar(select(func.sum(SignatureRecord.requests)))
    assert rows == MAX_SIGNATURES_PER_FUNCTION + 1  # the rest add up in one overflow row
    assert total == 10_000
    usage = signature_usage(index, "c", timedelta(hours=1))
    (overflow,) = [u for u in usage if u.digest == "*"]
    assert overflow.requests == overflow.misses == 10_000 - MAX_SIGNATURES_PER_FUNCTION
    index.close()


def test_the_per_flush_bound_drops_and_counts() -> None:
    import jax.numpy as jnp
    from jax import core

    collector = Collector(
        cache="c", environment_digest="d", sink=MemorySink(), interval_s=3600, max_signatures=10
    )
    for i in range(25):
        collector._on_lowering("jit(f)", [core.ShapedArray((i,), jnp.float32)], [None])
        collector._on_log(False, "jit_f", f"jit_f-{i}")
    batch = collector.take()
    assert len(batch.signatures) == 10 and batch.signatures_dropped == 15
    assert [c.leaves for c in batch.signatures.values()][3] == (((3,), "float32", False, None),)
