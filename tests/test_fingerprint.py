"""The environment fingerprint against the installed JAX, in fresh processes."""

from __future__ import annotations

import json
import os

from support.infra import run_py

from cachectl.core.fingerprint import (
    Environment,
    current_environment,
    excluded_xla_flags,
    normalized_xla_flags,
)

NAMESPACE_SNIPPET = """
import json, cachectl
a = cachectl.activate()
print(json.dumps({"path": a.path, "digest": a.digest, "namespace": a.namespace}))
"""


def _activate_in_fresh_process(extra_env: dict[str, str] | None = None) -> dict:
    proc = run_py(NAMESPACE_SNIPPET, env=extra_env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_digest_is_stable_and_canonical() -> None:
    env = current_environment()
    again = Environment.from_dict(json.loads(env.env_json()))
    assert again == env and again.digest == env.digest
    assert env.namespace.startswith(f"jax-{env.jax_version}/{env.backend}-")
    assert env.namespace.endswith("/" + env.digest[:16])
    assert env.enable_xla_caches == "none"


def test_digest_and_namespace_are_computed_once_and_follow_every_copy() -> None:
    """An environment's digest and namespace are kept on the instance after the first use (a
    bundle install asks for them dozens of times); a copy with another field gets its own, and a
    pickled one (a warm worker's) carries the same values."""
    import dataclasses
    import pickle

    env = current_environment()
    assert env.digest is env.digest and env.namespace is env.namespace
    assert {"digest", "namespace"} <= set(vars(env))
    other = dataclasses.replace(env, jax_version="0.0.1")
    assert other.digest != env.digest and other.namespace.startswith("jax-0.0.1/")
    assert other.digest == Environment.from_dict(other.to_dict()).digest
    copy = pickle.loads(pickle.dumps(env))
    assert copy == env and copy.digest == env.digest and copy.namespace == env.namespace


def test_flags_normalized_like_jax() -> None:
    flags = normalized_xla_flags(
        {
            "XLA_FLAGS": "--xla_b=1 --xla_dump_to=/tmp/d --xla_a=2",
            "LIBTPU_INIT_ARGS": "--xla_tpu_x=3",
        },
        argv=["prog", "--xla_c=4", "--other"],
    )
    assert flags == ("--xla_a=2", "--xla_b=1", "--xla_c=4", "--xla_tpu_x=3")


def test_exclusion_list_comes_from_installed_jax() -> None:
    from jax._src import cache_key

    assert excluded_xla_flags() == tuple(cache_key.xla_flags_to_exclude_from_cache_key)


def test_two_processes_same_environment_same_path() -> None:
    first = _activate_in_fresh_process()
    second = _activate_in_fresh_process()
    assert first == second
    assert os.path.exists(os.path.join(first["path"], "env.json"))


def test_key_flag_changes_namespace_excluded_flag_does_not(tmp_path) -> None:
    base = _activate_in_fresh_process()
    keyed = _activate_in_fresh_process({"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"})
    dumped = _activate_in_fresh_process({"XLA_FLAGS": f"--xla_dump_to={tmp_path}/dump"})
    assert keyed["digest"] != base["digest"] and keyed["path"] != base["path"]
    assert dumped["digest"] == base["digest"] and dumped["path"] == base["path"]


KEYS_SNIPPET = """
import os, jax, jax.numpy as jnp
cache_dir, mode = os.environ["T_CACHE_DIR"], os.environ["T_XLA_CACHES"]
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
if mode != "default":
    jax.config.update("jax_persistent_cache_enable_xla_caches", mode)
jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
print(" ".join(sorted(f for f in os.listdir(cache_dir) if f.startswith("jit__lambda") and f.endswith("-cache"))))
"""


def _keys(cache_dir: str, xla_caches: str) -> str:
    proc = run_py(KEYS_SNIPPET, env={"T_CACHE_DIR": cache_dir, "T_XLA_CACHES": xla_caches})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_fact1_keys_path_independent_only_without_xla_caches(tmp_path) -> None:
    """docs/jax-facts.md fact 1, pinned against the installed JAX."""
    managed = [_keys(str(tmp_path / d), "none") for d in ("c1", "c2")]
    assert managed[0] and managed[0] == managed[1]
    default = [_keys(str(tmp_path / d), "default") for d in ("d1", "d2")]
    assert default[0]
    import jax
    from packaging.version import Version

    if Version(jax.__version__) < Version("0.12"):
        assert default[0] != default[1]
    # jax 0.12.0.1 on CPU: the default no longer puts the path in the key (measured by
    # scripts/test --matrix, py313); cachectl's "none" is path-independent either way.


def test_every_layer_follows_the_one_definition_of_the_environment_key(tmp_path) -> None:
    """A key field is defined once (core/fingerprint.Environment -> ENVIRONMENT_FIELDS); the typed
    layers that must spell it again (the ORM table, the server's request schema, the migrated
    database) are checked against it here, so a field added in one place fails until all agree."""
    import sqlite3

    from cachectl.core.fingerprint import ENVIRONMENT_FIELDS
    from cachectl.index import open_index
    from cachectl.index.models import Environment as EnvironmentRow
    from cachectl_server.schemas import Fingerprint

    beside_the_key = {"id", "cache_id", "digest", "namespace", "created_at", "last_seen_at"}
    beside_the_key |= {"deleted_at", "content_signature", "proof"}
    orm = [c.name for c in EnvironmentRow.__table__.columns if c.name not in beside_the_key]
    assert orm == list(ENVIRONMENT_FIELDS)
    wire = [f for f in Fingerprint.model_fields if f not in ("digest", "namespace")]
    assert wire[: len(ENVIRONMENT_FIELDS)] == list(ENVIRONMENT_FIELDS)
    assert wire[len(ENVIRONMENT_FIELDS) :] == ["fingerprint_version"]
    db = tmp_path / "index.db"
    open_index(f"sqlite:///{db}").close()  # created and migrated to the head
    with sqlite3.connect(db) as conn:
        migrated = {r[1] for r in conn.execute("PRAGMA table_info(environments)")}
    assert set(ENVIRONMENT_FIELDS) <= migrated
