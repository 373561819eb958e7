"""A cache's storage options, handed to JAX's own reads and writes of an object-store cache.

JAX opens a cache directory that is not local through etils.epath, whose fsspec backend builds
one filesystem per protocol and process, with no arguments (``fsspec.filesystem("s3")``), at the
first compile. The one way a cache's options (``--storage-option``: endpoint, region, profile...)
and the storage bounds reach it is fsspec's per-protocol defaults (``fsspec.config.conf``), which
fsspec applies to every filesystem of that protocol built afterwards without that argument, and
which a child process reads from ``FSSPEC_<PROTOCOL>`` (JSON) when it imports fsspec. Without
them JAX talks to the default endpoint: for ``s3://bkt`` the public ``bkt.s3.amazonaws.com``, a
same-named bucket anyone may own.

The defaults are the process's: other code in it that opens that protocol through fsspec with no
options of its own gets them too. After setting them, the filesystem JAX will use is asked
(``jax_seam.cache_filesystem``) whether it carries the cache's options; where it does not (etils
built it earlier in this process, or reads through TensorFlow's gfile), the cache is refused with
one line and the defaults are put back.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import EnvironmentMismatch
from cachectl.core.urls import url_kind
from cachectl.storage.backends import backend

# Options that are the client's business, not the filesystem's (never handed on).
_NOT_HANDED = ("skip_instance_cache",)


class JaxStorageRefused(EnvironmentMismatch):
    """JAX in this process cannot be handed the cache's storage options."""


def jax_options(root_url: str, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """(fsspec protocol, the options JAX's filesystem must carry) for a root on an object store,
    None for one JAX opens as a local path."""
    kind = url_kind(root_url)
    if kind is None:
        return None
    store = backend(kind)  # the store's backend module says what JAX's filesystem carries
    handed = store.jax_options(dict(options or {}))
    if handed is None:
        return None
    return store.FSSPEC, {k: v for k, v in handed.items() if k not in _NOT_HANDED}


def _carries(carried: Any, wanted: Any) -> bool:
    """``carried`` holds ``wanted``: equal, or for a mapping, every wanted key carried (the
    process's own settings and the bounds may add keys)."""
    if isinstance(wanted, dict):
        return isinstance(carried, dict) and all(
            _carries(carried.get(k), v) for k, v in wanted.items()
        )
    return bool(carried == wanted)


def _protocols(fs: Any) -> tuple[str, ...]:
    """The fsspec protocols a filesystem answers to."""
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _missing(fs: Any, wanted: dict[str, Any]) -> list[str]:
    """The cache's options the filesystem JAX uses does not carry."""
    carried = dict(getattr(fs, "storage_options", None) or {})
    return sorted(k for k, v in wanted.items() if not _carries(carried.get(k), v))


def hand_to_jax(
    root_url: str,
    options: dict[str, Any] | None,
    path: str,
    *,
    client_config: dict[str, Any] | None = None,
) -> Callable[[], None] | None:
    """Make JAX's filesystem for ``path`` (under ``root_url``) carry the cache's options and the
    storage bounds (and ``client_config``, botocore settings such as a retry policy, where the
    process set none); returns what puts fsspec's defaults back (None: nothing was set). Raises
    JaxStorageRefused, defaults put back, where the filesystem JAX uses cannot carry them."""
    found = jax_options(root_url, options)
    if found is None:
        return None
    protocol, handed = found
    if client_config and "config_kwargs" in handed:
        handed["config_kwargs"] = {**client_config, **handed["config_kwargs"]}
    import fsspec.config

    conf = fsspec.config.conf
    before = conf.get(protocol)
    merged = dict(before or {})
    if "config_kwargs" in handed and isinstance(merged.get("config_kwargs"), dict):
        # The process's own client settings (a retry policy, a bound) stay where it set them.
        handed = {**handed, "config_kwargs": {**handed["config_kwargs"], **merged["config_kwargs"]}}
    merged.update(handed)
    conf[protocol] = merged

    def restore() -> None:
        if before is None:
            conf.pop(protocol, None)
        else:
            conf[protocol] = before

    own = {k: v for k, v in (options or {}).items() if k not in _NOT_HANDED}
    try:
        fs = jax_seam.cache_filesystem(path)
    except Exception as exc:  # noqa: BLE001 - a client that cannot be built cannot be checked
        restore()
        raise JaxStorageRefused(
            f"JAX's filesystem for {root_url} could not be built ({type(exc).__name__}: {exc})".splitlines()[
                0
            ]
        ) from None
    if fs is None:
        restore()
        raise JaxStorageRefused(
            f"JAX reads {root_url} through TensorFlow's gfile here (etils.epath), which takes no "
            "storage options: set EPATH_USE_TF=false, or uninstall tensorflow"
        )
    if protocol not in _protocols(fs):
        restore()
        raise JaxStorageRefused(
            f"JAX opens {root_url} as {type(fs).__name__}, not through fsspec's {protocol!r} "
            "filesystem (an etils.epath without that scheme): upgrade etils"
        )
    missing = _missing(fs, own)
    if missing:
        restore()
        raise JaxStorageRefused(
            f"JAX's filesystem for {root_url} was built in this process before cachectl could "
            f"hand it the cache's storage option(s) {', '.join(missing)}: activate before "
            "anything opens that storage through etils.epath"
        )
    return restore


def child_env(root_url: str, options: dict[str, Any] | None) -> dict[str, str]:
    """``FSSPEC_<PROTOCOL>``: the cache's options for a child process's JAX (fsspec reads it at
    import). JSON only: the whole-request bound (a session class) stays in this process; a child
    gets the connect and silence bounds."""
    found = jax_options(root_url, options)
    if found is None:
        return {}
    protocol, handed = found

    def plain(value: Any) -> bool:
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return False
        return True

    config = {k: v for k, v in dict(handed.get("config_kwargs") or {}).items() if plain(v)}
    rest = {k: v for k, v in handed.items() if k != "config_kwargs" and plain(v)}
    return {f"FSSPEC_{protocol.upper()}": json.dumps({**rest, "config_kwargs": config})}


@contextlib.contextmanager
def jax_storage(root_url: str, options: dict[str, Any] | None, path: str) -> Iterator[None]:
    """For a command's JAX (warm): the cache's options handed to this process's JAX and, through
    the environment, to the worker processes it starts; both put back afterwards."""
    restore = hand_to_jax(root_url, options, path)
    env = child_env(root_url, options)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if restore is not None:
            restore()
