"""The field suite: services built on real JAX libraries from the package index, each in fresh processes.

Per case: (a) no cache, (b) plain ``cachectl.activate()`` after the warm, (c) ``cachectl.serving``
where a manifest can name the program (a library's private jit is warmed with ``cachectl
warm-run`` instead). What is checked is what JAX itself counted in the same process
(``/jax/compilation_cache/*`` events, ``/jax/core/compile/*`` durations): no crash, zero compiles
in (c) and a hit for every program in (b), outputs equal to ``jax.jit``'s on the same padded
inputs, ``warm-check`` at 100% (for a warm-run, ``warm-check --replay`` of its command: every
compile request a hit), and ``cachectl misses`` naming nothing. The libraries are the ``field``
extra (scripts/test installs it). Wall times of (a)-(c) are printed for BENCHMARKS.md's "Field" section, never asserted.
How a case is served and checked: tests/support/field_run.py.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support.field_cases import CASES, REQUIRES
from support.field_run import check_case, field_cachectl
from support.infra import run_py

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_field_service(tmp_path: Path, name: str) -> None:
    check_case(tmp_path, name, CASES[name], REQUIRES.get(name))


REFUSED_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: case:predict
    args:
      - {pytree: case:param_specs}
      - pytree: case:graph_specs
        leaf_axes: {nodes: {0: n_node}, edges: {0: n_edge}, senders: {0: n_edge},
                    receivers: {0: n_edge}, globals: {0: n_graph}, n_node: {0: n_graph},
                    n_edge: {0: n_graph}}
    buckets: {n_node: [16], n_edge: [32], n_graph: [3]}
"""

REFUSED_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import numpy as np
import jax, jraph
import cachectl
import case
rt = cachectl.serving({manifest!r})
g = case.batch((3, 4), 0)
compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.__setitem__(0, compiles[0] + (e == "/jax/core/compile/backend_compile_duration")))
served = [np.asarray(rt["predict"](case.PARAMS, g)).tolist() for _ in range(3)]
compiled = compiles[0]
right = np.asarray(jax.jit(case.predict)(case.PARAMS, g)).tolist()
# what zero-filling every leaf to the bucket computes (before: served, with no warning)
zeros = jax.tree_util.tree_map(
    lambda x, n: np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)]),
    g, jraph.GraphsTuple(nodes=16, edges=32, senders=32, receivers=32, globals=3, n_node=3, n_edge=3))
zero_filled = np.asarray(jax.jit(case.predict)(case.PARAMS, zeros)).tolist()[:2]
print(json.dumps(dict(served=served, right=right, zero_filled=zero_filled, compiled=compiled,
                      report=rt.report().to_dict())))
"""


def test_field_jraph_zero_fill_is_refused_with_one_warning(tmp_path: Path) -> None:
    """A GraphsTuple declared by leaf_axes alone: its senders/receivers (and graph sizes) are
    integer leaves that index others, which zeros would attach to node 0 of graph 0 (a wrong
    answer). Serving refuses to pad them: jax.jit at the call's own shapes, the right answer,
    one warning that names those leaves and the fix (pad_fn: jraph:pad_with_graphs)."""
    if importlib.util.find_spec("jraph") is None:
        pytest.skip("jraph is not installed: the field extra, pip install -e '.[field]'")
    (tmp_path / "case.py").write_text(textwrap.dedent(CASES["jraph"].module))
    manifest = tmp_path / "refused.yaml"
    manifest.write_text(textwrap.dedent(REFUSED_MANIFEST))
    warm = field_cachectl(tmp_path, "warm", str(manifest), "--json")
    assert warm.returncode == 0, warm.stderr
    proc = run_py(
        REFUSED_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), timeout=600, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for answer in out["served"]:
        assert np.allclose(answer, out["right"], rtol=1e-5, atol=1e-5), out
    assert not np.allclose(out["zero_filled"], out["right"], rtol=1e-3, atol=1e-3), out
    rep = out["report"]["functions"]["predict"]
    assert (rep["calls"], rep["aot"], rep["fallback"], rep["padded"]) == (3, 0, 3, 0), rep
    assert out["compiled"] == 1, out  # JAX's own count: jax.jit at the call's shapes, once
    said = [line for line in proc.stderr.splitlines() if "not zero-padded" in line]
    assert len(said) == 1, proc.stderr
    assert (
        "argument 1's integer leaves receivers (int64), senders (int64), n_node (int32), "
        "n_edge (int32) are not zero-padded" in said[0]  # batch_np's offsets: int64
    ), said[0]
    assert "jraph:pad_with_graphs" in said[0] and "n_edge=..., n_graph=..., n_node=..." in said[0]
