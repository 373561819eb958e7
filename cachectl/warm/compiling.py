"""Compile one bucket and say what the persistent cache did; warm's JAX configuration."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import Environment
from cachectl.core.jaxlog import CAPTURE, Event
from cachectl.manifest import lowering_scope
from cachectl.manifest.mesh import explain_mesh_error
from cachectl.service.activate import apply_jax_config, jax_config_for
from cachectl.storage.executables import ExecutableError, payload_of
from cachectl.warm.slice_guard import refuse_foreign_program
from cachectl.warm.tracebacks import format_user_traceback, location

_ERROR_CHARS = 400

# Settings warm adds to activate()'s: write every program, whatever its compile
# time or size, and never let a JAX-side switch disable the cache.
WARM_EXTRA_CONFIG: dict[str, Any] = {
    "jax_enable_compilation_cache": True,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


@dataclass(frozen=True)
class Outcome:
    """What JAX did with one program: looked it up under ``key``, hit or compiled, wrote or not."""

    lookup: str | None  # hit | miss | None (JAX did not consult the persistent cache)
    key: str | None
    written: bool
    seconds: float
    skip_reason: str | None = None
    # payload_of() of the compiled program, or why JAX could not serialize it.
    payload: bytes | None = None
    aot_error: str | None = None
    lower_seconds: float = 0.0  # in ``.lower()``: tracing and lowering, Python under the GIL
    # Not compiled: its entry and stored executable were already there (``present``).
    stored: bool = False
    # The custom-call targets of the compiled program (stored with its executable); None: unknown.
    custom_calls: tuple[str, ...] | None = None
    # In a process JAX never writes from (``peer_entry``): the entry JAX would have written for
    # a miss, and whether the program has host callbacks (then JAX writes it from no process).
    entry: bytes | None = None
    host_callbacks: bool = False
    # The sha256s of what this process asked JAX to write at ``key`` (jax_seam.record_puts): a
    # file there with another sha256 is not this run's (JAX logs a write it then skips).
    put_sha256s: tuple[str, ...] = ()


def clear_in_memory_executables() -> None:
    """Forget what this process compiled (lowerings memoize their executables), so JAX
    consults the persistent cache again."""
    import jax

    jax.clear_caches()


def _lower(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    with lowering_scope():
        lowered = jitted.lower(*args, **kwargs)
    return lowered, time.perf_counter() - started


def compile_once(
    jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Event], float, Any]:
    return _compile_lowered(_lower(jitted, args, kwargs)[0])


def _compile_lowered(lowered: Any) -> tuple[list[Event], float, Any]:
    with CAPTURE.sink() as events:
        started = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - started
    return events, seconds, compiled


def _payload(compiled: Any) -> tuple[bytes | None, str | None]:
    try:
        return payload_of(compiled), None
    except ExecutableError as exc:
        return None, str(exc)


def compile_bucket(
    jitted: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    executables: bool = False,
    present: Callable[[str], bool] | None = None,
    peer_entry: bool = False,
) -> Outcome:
    """Lower and compile one bucket, and say what the persistent cache did.

    With ``peer_entry`` (a distributed job's process other than 0, which JAX never writes
    from) a miss carries the entry JAX would have written, unless the lowering has host
    callbacks: JAX's own reason to write it from no process, which its log says only in process 0.

    With ``present``, the lowered program's key is computed first (jax_seam.persistent_cache_key: a wrong key can only miss a file);
    when ``present(key)`` says everything warm would write is already stored, the
    bucket is a hit without compiling: loading a hit only to learn its key was
    what re-warm spent its time on after lowering.
    A program this process already compiled comes from JAX's in-memory cache and
    never reaches the persistent one (no key is logged); then the in-memory
    executables are dropped and the bucket compiled again, which now hits.
    """
    jax_seam.record_puts()
    with CAPTURE.installed():
        lowered, lower_seconds = _lower(jitted, args, kwargs)
        refuse_foreign_program(lowered)  # a deviceless warm: nothing for this machine's backend
        if present is not None:
            started = time.perf_counter()
            key = jax_seam.persistent_cache_key(lowered)
            if key is not None and present(key):
                return Outcome(
                    "hit",
                    key,
                    False,
                    time.perf_counter() - started,
                    lower_seconds=lower_seconds,
                    stored=True,
                )
        events, seconds, compiled = _compile_lowered(lowered)
        if not any(e.kind in ("hit", "miss") for e in events):
            clear_in_memory_executables()
            events, seconds, compiled = compile_once(jitted, args, kwargs)
    lookups = [e for e in events if e.kind in ("hit", "miss")]
    if not lookups:
        return Outcome(None, None, False, seconds, lower_seconds=lower_seconds)
    last = lookups[-1]
    written = any(e.kind == "write" and e.key == last.key for e in events)
    skip = next((e.text for e in events if e.kind == "skip"), None)
    payload, aot_error = _payload(compiled) if executables else (None, None)
    custom_calls = jax_seam.custom_call_targets(compiled) if payload is not None else None
    entry, host_callbacks = None, False
    if peer_entry and last.kind == "miss":
        host_callbacks = jax_seam.lowered_has_host_callbacks(lowered)
        entry = None if host_callbacks else jax_seam.entry_bytes(compiled, seconds)
    return Outcome(
        last.kind,
        last.key,
        written,
        seconds,
        skip,
        payload,
        aot_error,
        lower_seconds,
        custom_calls=custom_calls,
        entry=entry,
        host_callbacks=host_callbacks,
        put_sha256s=jax_seam.put_sha256s(last.key) if written and last.key else (),
    )


class ErrorText(str):
    """A bucket's one-line error that also carries the traceback of the user's code (for ``-v``).

    A str, so it travels unchanged wherever warm passes error messages (and pickles
    back from worker processes with its traceback).
    """

    traceback: str | None = None


def error_text(exc: BaseException) -> ErrorText:
    """One line: the error, ended by ``(at file:line)`` of the user's code that raised it."""
    explained = explain_mesh_error(exc)
    if isinstance(exc, BadInput):
        message = exc.message
    elif explained is not None:
        message = explained
    else:
        text = str(exc).strip().splitlines()
        first = text[0] if text else ""
        message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if len(message) > _ERROR_CHARS:
            message = message[: _ERROR_CHARS - 3] + "..."
    where = location(exc)
    result = ErrorText(f"{message} (at {where})" if where else message)
    result.traceback = format_user_traceback(exc)
    return result


# --------------------------------------------------------------------------- JAX configuration


def warm_jax_config(path: str, env: Environment) -> dict[str, Any]:
    """activate()'s settings for ``path`` (writable) plus warm's: write everything."""
    return {**jax_config_for(path, env, readonly=False), **WARM_EXTRA_CONFIG}


@contextlib.contextmanager
def jax_configured(config: dict[str, Any]) -> Iterator[None]:
    """Point JAX at warm's namespace for the duration, then put the previous config back.

    warm owns the process's persistent cache while it runs: any cache JAX had
    opened is closed first, and reopened lazily afterwards with the old settings.
    """
    import jax

    saved = {name: getattr(jax.config, name) for name in config}
    jax_seam.reset_persistent_cache()
    apply_jax_config(config)
    clear_in_memory_executables()
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        jax_seam.reset_persistent_cache()


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """Build abstract arguments without writing what user code compiles on the way.

    A pytree function such as ``param_specs`` may run JAX eagerly (e.g.
    ``jax.random.key(0)``); those programs are not buckets and stay out of the namespace.
    JAX decides once per process whether to use its cache (``is_cache_used``), so
    the switch is flipped with a reset on both sides; no bucket compiles meanwhile.
    """
    import jax

    # JAX adds its options to Config at run time (setattr): its types declare none of them.
    saved = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    jax_seam.reset_persistent_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)
        jax_seam.reset_persistent_cache()
