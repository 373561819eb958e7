"""Namespaces: where one environment's entries live inside a cache root.

``<root>/jax-<version>/<backend>-<device-kind>-x<count>/<digest16>/`` holds the
JAX files plus an ``env.json`` describing the environment, so storage is
self-describing and a lost index can be rebuilt by scanning.
"""

from __future__ import annotations

import grp
import json
import os
from dataclasses import dataclass

from cachectl.entries import ENV_FILE
from cachectl.errors import BadInput
from cachectl.fingerprint import Environment
from cachectl.store import Store

QUARANTINE_DIR = ".quarantine"
DIR_MODE = 0o755
GROUP_DIR_MODE = 0o2775


@dataclass(frozen=True)
class Namespace:
    """One environment's place in one cache."""

    cache: str
    relpath: str
    url: str
    digest: str
    environment: Environment


def namespace_of(store: Store, cache: str, env: Environment) -> Namespace:
    return Namespace(cache, env.namespace, store.url_for(env.namespace), env.digest, env)


def read_env_json(store: Store, relpath: str) -> Environment:
    """The Environment a namespace describes; a corrupt file is bad input."""
    location = store.url_for(f"{relpath}/{ENV_FILE}")
    try:
        data = json.loads(store.read_bytes(f"{relpath}/{ENV_FILE}"))
        env = Environment.from_dict(data)
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise BadInput(f"corrupt {location}: {exc}; move it aside and run `cachectl sync` to rebuild") from exc
    recorded = data.get("digest")
    if recorded and recorded != env.digest:
        raise BadInput(f"corrupt {location}: digest {recorded[:16]} does not match its fields ({env.digest[:16]})")
    return env


def ensure_namespace(store: Store, env: Environment, *, group: str | None = None) -> None:
    """Create the namespace and its env.json if missing; never world-writable."""
    rel = env.namespace
    if store.is_local:
        mode = GROUP_DIR_MODE if group else DIR_MODE
        store.makedirs(rel, mode=mode)
        if group:
            _chgrp_tree(store, rel, group)
    if store.exists(f"{rel}/{ENV_FILE}"):
        existing = read_env_json(store, rel)
        if existing.digest != env.digest:
            raise BadInput(f"namespace {store.url_for(rel)} holds env.json of another environment ({existing.digest[:16]})")
        return
    store.write_bytes(f"{rel}/{ENV_FILE}", env.env_json().encode())


def prepare_root(store: Store, group: str | None) -> None:
    """Create a local root; with a group, group-owned and setgid (2775)."""
    if not store.is_local:
        return
    store.makedirs("", mode=GROUP_DIR_MODE if group else DIR_MODE)
    if group:
        gid = _gid(group)
        os.chown(store.url_for(""), -1, gid)
        os.chmod(store.url_for(""), GROUP_DIR_MODE)


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise BadInput(f"no such group {group!r}: create it or choose an existing group") from exc


def _chgrp_tree(store: Store, rel: str, group: str) -> None:
    gid = _gid(group)
    parts = rel.split("/")
    for depth in range(1, len(parts) + 1):
        path = store.url_for("/".join(parts[:depth]))
        if os.stat(path).st_gid != gid:
            os.chown(path, -1, gid)
        os.chmod(path, GROUP_DIR_MODE)
