"""The digest of each component of JAX's persistent-cache key, computed by JAX's own key code
(jax/_src/cache_key.py's get()) through cachectl.core.jax_seam.key_components.

Real lowerings in fresh processes: two XLA_FLAGS variants differ in "XLA flags" (and in the
compile options, which carry the parsed flags), two programs in "computation" only; the reading
leaves JAX's logger as it was.
"""

from __future__ import annotations

import json
from typing import Any

from support.infra import run_py

PROGRAM = """
import json, logging
import jax, jax.numpy as jnp
from cachectl.core import jax_seam

def f(x):
    return jnp.tanh(x) {op} 1.0

lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((4, 8), jnp.float32))
parts = jax_seam.key_components(lowered)
logger = logging.getLogger("jax._src.cache_key")
print(json.dumps({{"parts": parts, "key": jax_seam.persistent_cache_key(lowered),
                  "level": logger.level, "propagate": logger.propagate,
                  "handlers": len(logger.handlers)}}))
"""


def _components(op: str = "+", flags: str | None = None) -> dict[str, Any]:
    proc = run_py(PROGRAM.format(op=op), {"XLA_FLAGS": flags}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(name for name in a if a[name] != b.get(name))


def test_components_name_what_differs_between_two_keys() -> None:
    plain = _components()
    parts = plain["parts"]
    assert set(parts) >= {
        "computation",
        "jax_lib version",
        "backend version",
        "XLA flags",
        "compile_options",
        "accelerator_config",
        "compression",
        "custom_hook",
    }, parts
    assert all(len(digest) == 64 for digest in parts.values())
    # The reading leaves JAX's logger as it found it.
    assert (plain["level"], plain["propagate"], plain["handlers"]) == (0, True, 0)

    again = _components()
    assert again["parts"] == parts and again["key"] == plain["key"]  # stable across processes

    flagged = _components(flags="--xla_cpu_enable_fast_math=true")
    assert flagged["key"] != plain["key"]
    # XLA_FLAGS is hashed as text ("XLA flags") and, parsed into the debug options the compile
    # options carry, again in "compile_options"; nothing else moves.
    assert _differing(parts, flagged["parts"]) == ["XLA flags", "compile_options"]

    other = _components(op="*")
    assert _differing(parts, other["parts"]) == ["computation"]


THREADS = """
import json
from concurrent.futures import ThreadPoolExecutor
import jax, jax.numpy as jnp
from cachectl.core import jax_seam

def lowered(n):
    return jax.jit(lambda x: jnp.tanh(x) * n).lower(jax.ShapeDtypeStruct((n, 8), jnp.float32))

programs = [lowered(n) for n in range(1, 9)]
alone = [jax_seam.key_components(p) for p in programs]
with ThreadPoolExecutor(8) as pool:
    together = list(pool.map(jax_seam.key_components, programs * 4))
print(json.dumps({"same": together == alone * 4, "distinct": len({a["computation"] for a in alone})}))
"""


def test_components_read_in_threads_are_each_threads_own() -> None:
    """Warm compiles in threads: each reading holds only its own program's records."""
    proc = run_py(THREADS, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same": True, "distinct": 8}
