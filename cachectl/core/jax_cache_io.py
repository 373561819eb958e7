"""The JAX seam's persistent cache as this process opens, reads and writes it: its process state,
the verifying cache JAX's reads go through, and the sha256 of every entry this process asked it to
write (part of the seam, cachectl/core/jax_seam.py, which re-exports the public names; split off
so each module stays short).

Importing this module costs nothing: JAX is imported inside the functions.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any

from cachectl.core.temps import without_world_write

# -- the persistent cache's process state --------------------------------------------------


def reset_persistent_cache() -> None:
    """Close the cache JAX opened, so its next compile opens the configured one (and re-decides
    whether to use a cache at all: JAX decides that once per process)."""
    from jax._src import compilation_cache

    compilation_cache.reset_cache()


def opened_cache_dir() -> str | None:
    """The directory JAX's persistent cache already opened in this process, if any."""
    from jax._src import compilation_cache

    cache = getattr(compilation_cache, "_cache", None)
    if cache is None:
        return None
    return str(getattr(cache, "_path", "") or "") or None


def cache_filesystem(url: str) -> Any | None:
    """The fsspec filesystem JAX's persistent cache opens ``url`` (not local) through: etils.epath's,
    one per protocol and process, built at its first use with fsspec's defaults for the protocol
    (``jax._src.path.Path`` is ``epath.Path``). None where JAX reads it another way (pathlib
    without etils, TensorFlow's gfile)."""
    from jax._src import path as jax_path

    if not getattr(jax_path, "epath_installed", False):
        return None
    backend = getattr(jax_path.Path(url), "_backend", None)
    fs = getattr(backend, "fs", None)
    return fs(url) if callable(fs) else None


def cache_checked() -> bool:
    """True once JAX compiled anything in this process (it checks its cache on the first compile)."""
    from jax._src import compilation_cache

    return bool(getattr(compilation_cache, "_cache_checked", False))


def entry_bytes(compiled: Any, seconds: float) -> bytes:
    """The JAX cache entry of a ``jax.stages.Compiled``, exactly as JAX's own put would write it."""
    from jax._src import compilation_cache

    executable = compiled._executable.xla_executable
    return compilation_cache.compress_executable(
        compilation_cache.combine_executable_and_time(executable.serialize(), int(seconds))
    )


def write_whatever_compile_time() -> Callable[[], None]:
    """Until the returned call, on this thread: JAX writes what it compiles to its persistent
    cache however fast the compile was. JAX reads ``jax_persistent_cache_min_compile_time_secs``
    in ``compiler._cache_write``, after the compile, on the compiling thread, and the option is a
    State with a thread-local value (``swap_local``/``set_local``, what its context manager uses;
    jax 0.10: tests/test_jax_seam.py): 0 here for this thread only. The returned call restores
    the thread's own value. Where this JAX has no such State, nothing changes."""
    try:
        from jax._src import config

        state: Any = config.persistent_cache_min_compile_time_secs
        previous = state.swap_local(0.0)
    except Exception:  # noqa: BLE001 - another JAX: its own threshold stays
        return lambda: None

    def restore() -> None:
        state.set_local(previous)

    return restore


# -- a verifying persistent cache ----------------------------------------------------------------


# What the gate expects of an entry in a process that opted in to unverified code.
ANY_ENTRY = "*"


class EntryVerifier:
    """What a verifying cache asks before it hands JAX an entry: the gate
    (cachectl/trust/gate.py ``EntryGate``), which alone decides; this seam only plumbs."""

    def get(self, key: str, base: Callable[[str], bytes | None]) -> bytes | None:
        """The bytes JAX's ``get`` returns for ``key`` (None: a miss, JAX compiles). ``base``
        is JAX's own file cache's get."""
        raise NotImplementedError

    def put(self, key: str, value: bytes) -> None:
        """JAX's ``put`` was handed ``value`` for ``key`` (JAX wrote it, or skipped it because a
        file was already at the key)."""

    def handed(self, key: str) -> str | None:
        """The sha256 of the entry this process handed JAX for ``key`` (one the gate let through
        ``get``, or one JAX's ``put`` was handed); None: none. What a writer binds to it (a stored
        executable) is bound to those bytes, never to a file read back at the key."""
        return None


# The verifier installed for each cache directory (install_verifying_cache), by its path.
_VERIFIERS: dict[str, EntryVerifier] = {}


def verifier_at(path: str) -> EntryVerifier | None:
    """The gate JAX's cache at ``path`` reads through in this process, or None."""
    return _VERIFIERS.get(str(path).rstrip("/"))


# The files JAX's file cache writes per key: the entry, and its access time where it evicts.
_ENTRY_SUFFIXES = ("-cache", "-atime")


def install_verifying_cache(path: str, verifier: EntryVerifier) -> None:
    """From the next time JAX opens its persistent cache at ``path`` (it does that at its first
    compile, and again after reset_persistent_cache), its ``get`` returns what ``verifier`` (the
    gate) returns for that key, and its ``put`` tells the verifier the bytes it was handed. JAX opens the cache in ``compilation_cache._initialize_cache`` through the
    module's ``get_file_cache(path)`` (jax 0.9 to 0.12: tests/test_jax_seam.py); the wrapper
    replaces that function once, and a later call replaces the verifier."""
    from jax._src import compilation_cache
    from jax._src.compilation_cache_interface import CacheInterface

    original = getattr(compilation_cache.get_file_cache, "_cachectl_original", None)
    original = original or compilation_cache.get_file_cache
    wanted = str(path).rstrip("/")
    _VERIFIERS[wanted] = verifier

    class VerifyingCache(CacheInterface):
        """JAX's own file cache, read only through ``verifier``."""

        def __init__(self, base: Any) -> None:
            self._base = base

        @property
        def _path(self) -> Any:  # JAX and opened_cache_dir() read the directory here
            return self._base._path

        @_path.setter
        def _path(self, value: Any) -> None:
            self._base._path = value

        def get(self, key: str) -> bytes | None:
            return verifier.get(key, self._base.get)

        def put(self, key: str, value: bytes) -> None:
            self._base.put(key, value)
            local = str(self._base._path)
            if "://" not in local:  # JAX writes at the umask's mode: never world-writable
                for suffix in _ENTRY_SUFFIXES:
                    without_world_write(os.path.join(local, key + suffix))
            verifier.put(key, bytes(value))

    def get_file_cache(path: str) -> tuple[CacheInterface, str] | None:
        made = original(path)
        if made is None or str(path).rstrip("/") != wanted:
            return made
        return VerifyingCache(made[0]), made[1]

    get_file_cache._cachectl_original = original  # type: ignore[attr-defined]
    compilation_cache.get_file_cache = get_file_cache
    opened = compilation_cache._cache
    if opened is not None and str(getattr(opened, "_path", "")).rstrip("/") == wanted:
        # Opened already (activate() again): wrap JAX's own cache in place.
        base = (
            getattr(opened, "_base", opened)
            if type(opened).__name__ == "VerifyingCache"
            else opened
        )
        compilation_cache._cache = VerifyingCache(base)


def uninstall_verifying_cache() -> None:
    """JAX's own get_file_cache again (a process that opts out of verification)."""
    from jax._src import compilation_cache

    original = getattr(compilation_cache.get_file_cache, "_cachectl_original", None)
    if original is not None:
        compilation_cache.get_file_cache = original


# -- what this process asked JAX's file cache to write ---------------------------------------

# key -> sha256 of every value this process handed JAX's file cache to write (record_puts()).
_PUTS: dict[str, set[str]] = {}
_PUT_LISTENERS: list[Callable[[str, str], None]] = []
_PUTS_LOCK = threading.Lock()


def record_puts(listener: Callable[[str, str], None] | None = None) -> None:
    """From now on remember the sha256 of every entry JAX's file cache is asked to write in this
    process (and hand ``(key, sha256)`` to ``listener``). JAX logs "Writing" and then its
    ``LRUCache.put`` returns without writing when a file is already at the key (jax 0.9 to
    0.12: tests/test_jax_seam.py), so a write is this process's only when the bytes on storage
    have a sha256 it recorded here: what warm and warm-run check before they index a file."""
    from jax._src import lru_cache

    with _PUTS_LOCK:
        if listener is not None:
            _PUT_LISTENERS.append(listener)
        cls = lru_cache.LRUCache
        if getattr(cls.put, "_cachectl_put", False):
            return
        original = cls.put

        def put(self: Any, key: str, value: bytes) -> None:
            original(self, key, value)
            digest = hashlib.sha256(value).hexdigest()
            with _PUTS_LOCK:
                _PUTS.setdefault(key, set()).add(digest)
                listeners = list(_PUT_LISTENERS)
            for on_put in listeners:
                on_put(key, digest)

        put._cachectl_put = True  # type: ignore[attr-defined]
        cls.put = put  # type: ignore[method-assign]


def put_sha256s(key: str) -> tuple[str, ...]:
    """The sha256s of what this process asked JAX to write at ``key`` (record_puts)."""
    with _PUTS_LOCK:
        return tuple(sorted(_PUTS.get(key, ())))


def remember_puts(key: str, sha256s: Any) -> None:
    """A worker process's puts at ``key``, told to the parent that indexes them."""
    with _PUTS_LOCK:
        _PUTS.setdefault(key, set()).update(sha256s)
