"""warm-check --canary: every stored executable against a fresh compile here, and the proof the
index keeps on the namespace (``ls`` and ``stats`` show it).

Real warms and checks of a small manifest in fresh processes on the CPU backend, where the
stored executable and ``jax.jit`` come from the same compiler: their outputs are equal to the bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support.warming import invoke, tiny

from cachectl.warm.canary import compare

# A module constant read from the environment at import: a check run with another WC_SCALE
# traces another program than the stored executable was compiled from.
SCALED_MODULE = """
import os
import jax.numpy as jnp

SCALE = float(os.environ.get("WC_SCALE", "1"))

def scaled(x):
    return jnp.tanh(x) * SCALE
"""

SCALED_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wc_scaled:scaled
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [2, 4]}
"""


# A train step that donates its state, as an optimizer step does: the state's buffers are gone
# after the first call, so every call must get inputs of its own.
DONATED_MODULE = """
import jax
import jax.numpy as jnp

def state_specs():
    return {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "rng": jax.eval_shape(lambda: jax.random.key(0))}

def step(state, x):
    rng, sub = jax.random.split(state["rng"])
    noise = jax.random.normal(sub, state["w"].shape) * 0.01
    return {"w": state["w"] - 0.1 * jnp.tanh(x).mean() * state["w"] + noise, "rng": rng}
"""

DONATED_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wc_donated:step
    args:
      - {pytree: wc_donated:state_specs}
      - {shape: [batch, 8], dtype: float32}
    jit: {donate_argnums: [0]}
    buckets: {batch: [2, 4]}
"""


def _proof_rows() -> list[dict[str, Any] | None]:
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT proof FROM environments WHERE deleted_at IS NULL").fetchall()
    # One manifest per test: its proof, of the per-manifest rows the column keeps.
    return [json.loads(proof)["manifests"][-1] if proof is not None else None for (proof,) in rows]


def test_canary_equal_on_every_bucket_proves_the_namespace(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)  # static kwargs as a bucket axis, and a pytree argument
    invoke("warm", str(manifest), "--json")
    assert _proof_rows() == [None]  # never checked

    result = invoke("warm-check", str(manifest), "--canary", "--json")
    data = json.loads(result.stdout)
    assert [b["canary"] for b in data["buckets"]] == ["equal"] * 5, data["buckets"]
    assert data["summary"]["canary_equal"] == 5 and data["summary"]["canary_failed"] == 0
    assert data["proof_error"] is None
    proof = data["proof"]
    assert (proof["buckets"], proof["hits"], proof["executables_called"]) == (5, 5, 5)
    assert proof["canary"] == "equal" and proof["proven"] is True
    assert proof["devices"] == "cpu x1"
    assert proof["machine_digest"] == data["environment"]["digest"]

    (row,) = _proof_rows()
    assert row is not None and row["canary"] == "equal" and row["hits"] == 5

    listing = json.loads(invoke("ls", "--json").stdout)
    (env,) = listing["environments"]
    assert env["proof"]["proven"] is True and env["proof"]["host"] == proof["host"]
    text = invoke("ls").output
    assert "proven" in text and "yes," in text and "cpu x1" in text, text

    stats = json.loads(invoke("stats", "--json").stdout)
    (totals,) = stats if isinstance(stats, list) else [stats]
    assert totals["proven"] == 1 and totals["per_environment"][0]["proof"]["canary"] == "equal"
    assert "1/1" in invoke("stats").output

    human = invoke("warm-check", str(manifest), "--canary").output
    assert "canary: 5/5 stored executables give the outputs of a compile here" in human
    assert "recorded in the index: proven on cpu x1" in human


def test_without_canary_the_check_is_recorded_but_does_not_prove(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    invoke("warm", str(manifest), "--json")
    data = json.loads(invoke("warm-check", str(manifest), "--json").stdout)
    assert all(b["canary"] is None for b in data["buckets"])
    assert data["proof"]["canary"] == "not run (--canary not given)"
    assert data["proof"]["proven"] is False
    text = invoke("ls").output
    assert "no: canary not run" in text, text
    assert json.loads(invoke("stats", "--json").stdout)[0]["proven"] == 0


def test_a_shard_is_not_recorded_as_proof(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    invoke("warm", str(manifest), "--json")
    data = json.loads(invoke("warm-check", str(manifest), "--shard", "1/2", "--json").stdout)
    assert data["proof"] is None
    assert data["proof_error"] == "not recorded: a shard checks part of the manifest"
    assert _proof_rows() == [None]


def test_outputs_that_differ_fail_the_check_and_unprove_the_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "wc_scaled.py").write_text(SCALED_MODULE)
    manifest = tmp_path / "scaled.yaml"
    manifest.write_text(SCALED_MANIFEST)
    invoke("warm", str(manifest), "--json")
    invoke("warm-check", str(manifest), "--canary", "--json")
    (row,) = _proof_rows()
    assert row is not None and row["canary"] == "equal"

    # The stored executables compute tanh(x); this machine's jit now computes 3 * tanh(x).
    monkeypatch.setenv("WC_SCALE", "3")
    result = invoke("warm-check", str(manifest), "--canary", "--json", code=1)
    data = json.loads(result.stdout)
    verdicts = [b["canary"] for b in data["buckets"]]
    assert all(v.startswith("differs (max abs diff ") for v in verdicts), verdicts
    assert data["summary"]["canary_failed"] == 2
    assert data["proof"]["canary"] == "differs in 2 of 2" and data["proof"]["proven"] is False
    (row,) = _proof_rows()
    assert row is not None and row["canary"] == "differs in 2 of 2"
    assert "no: " in invoke("ls").output

    text = invoke("warm-check", str(manifest), "--canary", code=1).output
    assert "canary: 2 stored executable(s) did not give the outputs of a compile here" in text
    assert "Traceback" not in text


def test_canary_of_a_donated_train_step_is_equal(tmp_path: Path) -> None:
    """Donation deletes the state's buffers at the stored executable's call: the fresh compile
    must get its own copy of the inputs, or the canary can never prove a train step."""
    (tmp_path / "wc_donated.py").write_text(DONATED_MODULE)
    manifest = tmp_path / "donated.yaml"
    manifest.write_text(DONATED_MANIFEST)
    invoke("warm", str(manifest), "--json")
    data = json.loads(invoke("warm-check", str(manifest), "--canary", "--json").stdout)
    assert [b["canary"] for b in data["buckets"]] == ["equal", "equal"], data["buckets"]
    assert data["proof"]["proven"] is True


def test_canary_with_replay_is_refused_in_one_line() -> None:
    result = invoke("warm-check", "--replay", "--canary", code=2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--canary checks a MANIFEST's buckets" in lines[0], lines


def test_compare_is_exact_nan_safe_and_dtype_aware() -> None:
    x = np.array([1.0, np.nan, 3.0], np.float32)
    assert compare([x], [x.copy()]) == "equal"  # NaN equals NaN
    assert compare([x], [x + np.float32(0.5)]) == "differs (max abs diff 0.5 in 1 of 1 outputs)"
    y = x.copy()
    y[1] = 2.0
    assert compare([x], [y]).endswith("; NaN on one side only)")
    assert compare([x], [x.astype(np.float64)]) == (
        "differs (output 0: float32[3] stored, float64[3] by jit)"
    )
    b = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    assert compare([b], [b.copy()]) == "equal"
    assert compare([b], [b.astype(np.float32)]).startswith("differs (output 0: bfloat16[2]")
    assert compare([np.arange(3)], [np.arange(3) + 2]) == (
        "differs (max abs diff 2 in 1 of 1 outputs)"
    )
    assert compare([x], [x, x]).startswith("differs (1 outputs")


@pytest.fixture
def index(db_url: str) -> Any:
    from cachectl.index import db as index_db
    from cachectl.index import open_index

    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)
    idx = open_index(db_url)
    yield idx
    idx.close()
    engine.dispose()


def test_the_index_keeps_the_last_proof_on_sqlite_and_postgresql(index: Any) -> None:
    from datetime import UTC, datetime

    from support.environments import ENV

    from cachectl.core.records import Proof

    index.add_cache("c", "/tmp/proof-cache")
    env = index.ensure_environment("c", ENV)
    assert index.find_environment("c", env.digest).proof is None
    first = Proof(
        at=datetime(2026, 12, 6, 2, 0, tzinfo=UTC),
        machine_digest=env.digest,
        devices="TPU v5 lite x1",
        host="tpu-vm",
        buckets=11,
        hits=11,
        executables_called=11,
        canary="equal",
    )
    index.record_proof(env.id, first)
    (listed,) = index.environment_stats("c")
    assert listed.proof == first and listed.proof.proven
    later = dataclasses.replace(first, hits=10, canary="not run for 1 of 11")
    index.record_proof(env.id, later)
    again = index.find_environment("c", env.digest).proof
    assert again == later and not again.proven


TWO_MODULE = """
import jax.numpy as jnp

def scaled(x):
    return jnp.tanh(x) * 2

def shifted(x):
    return jnp.tanh(x) + 1
"""

PART_MANIFEST = """
version: 1
target: {{backend: cpu}}
functions:
  - fn: wc_two:{fn}
    args: [{{shape: [batch, 8], dtype: float32}}]
    buckets: {{batch: {buckets}}}
"""


def test_one_manifests_check_never_proves_the_whole_namespace(tmp_path: Path) -> None:
    """Two manifests warmed one namespace (3 entries); the canary of the one with 1 bucket proves
    its own entry, not the namespace: `ls` said the whole environment `proven: yes`. Each
    manifest's proof is kept apart; the namespace is proven once a check covers every entry."""
    (tmp_path / "wc_two.py").write_text(TWO_MODULE)
    small, big = tmp_path / "small.yaml", tmp_path / "big.yaml"
    small.write_text(PART_MANIFEST.format(fn="shifted", buckets="[2]"))
    big.write_text(PART_MANIFEST.format(fn="scaled", buckets="[2, 4]"))
    invoke("warm", str(small), "--json")
    invoke("warm", str(big), "--json")
    data = json.loads(invoke("warm-check", str(small), "--canary", "--json").stdout)
    assert data["proof"]["proven"] is True and data["proof"]["entries_proven"] == 1, data["proof"]
    (env,) = json.loads(invoke("ls", "--json").stdout)["environments"]
    assert env["entries"] == 3 and env["proven"] is False, env
    assert "no: small.yaml proved 1 of 3 entries" in invoke("ls").output
    assert json.loads(invoke("stats", "--json").stdout)[0]["proven"] == 0

    # The other manifest's check is kept beside it, not over it; neither alone covers all 3.
    invoke("warm-check", str(big), "--canary", "--json")
    (env,) = json.loads(invoke("ls", "--json").stdout)["environments"]
    assert sorted((Path(p["manifest"]).name, p["entries_proven"]) for p in env["proofs"]) == [
        ("big.yaml", 2),
        ("small.yaml", 1),
    ]
    assert env["proven"] is False and "no: big.yaml proved 2 of 3 entries" in invoke("ls").output

    # A manifest naming both functions proves every entry: the namespace is proven.
    both = tmp_path / "both.yaml"
    both.write_text(big.read_text() + small.read_text().split("functions:\n", 1)[1])
    invoke("warm-check", str(both), "--canary", "--json")
    (env,) = json.loads(invoke("ls", "--json").stdout)["environments"]
    assert env["proven"] is True and len(env["proofs"]) == 3, env
    assert "yes," in invoke("ls").output
    assert json.loads(invoke("stats", "--json").stdout)[0]["proven"] == 1
