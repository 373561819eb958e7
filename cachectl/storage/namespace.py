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

from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import Environment
from cachectl.storage.entries import ENV_FILE
from cachectl.storage.store import Store

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
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        env = Environment.from_dict(data)
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadInput(
            f"corrupt {location}: {exc}; move it aside and run `cachectl sync` to rebuild"
        ) from exc
    recorded = data.get("digest")
    if recorded and recorded != env.digest:
        raise BadInput(
            f"corrupt {location}: digest {recorded[:16]} does not match its fields ({env.digest[:16]})"
        )
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
            raise BadInput(
                f"namespace {store.url_for(rel)} holds env.json of another environment ({existing.digest[:16]})"
            )
        return
    store.write_bytes(f"{rel}/{ENV_FILE}", env.env_json().encode())


# Pseudo filesystems: whatever is under them, it is no place for a cache.
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def check_local_root(path: str) -> None:
    """BadInput unless ``path`` can be a cache root: a directory, or creatable as one, and not
    on a pseudo filesystem (/proc, /sys, /dev). Nothing is created."""
    real = os.path.realpath(path)
    for pseudo in _PSEUDO_ROOTS:
        if real == pseudo or real.startswith(pseudo + "/"):
            raise BadInput(
                f"cache root {path!r} is under {pseudo}, a pseudo filesystem: use a real directory"
            )
    probe = real
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        what = (
            "exists and is not a directory"
            if probe == real
            else f"is below {probe!r}, which is not a directory"
        )
        raise BadInput(f"cache root {path!r} {what}: use a directory")


def prepare_root(store: Store, group: str | None) -> None:
    """Create a local root; with a group, group-owned and setgid (2775)."""
    if not store.is_local:
        return
    root = store.url_for("")
    check_local_root(root)
    try:
        store.makedirs("", mode=GROUP_DIR_MODE if group else DIR_MODE)
    except OSError as exc:
        raise BadInput(
            f"cannot create cache root {root!r}: {exc.strerror or type(exc).__name__}"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise BadInput(f"cache root {root!r} is not writable by this user")
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
