"""Joining a ``jax.distributed`` job: what `warm --distributed`, `warm-check` and `misses` inside
a job do first (warm/distributed.py has the collective warm itself). Imports JAX only inside
``join``, and nothing of the warm package, so the coverage check and `misses` can import it."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput, EnvironmentMismatch, Unreachable

WRITER = 0
TIMEOUT_ENV = "CACHECTL_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 600
_JAX_GRACE_S = 30  # JAX's own init timeout comes this much later than ours


@dataclass(frozen=True)
class ProcessInfo:
    index: int
    count: int
    writer: int = WRITER


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise BadInput(f"{name} must be a whole number, got {raw!r}")
    return int(raw)


def timeout_seconds() -> int:
    """How long any process waits for the others, at each step (joining included): every wait is bounded."""
    value = _int_env(TIMEOUT_ENV)
    if value == 0:
        raise BadInput(f"{TIMEOUT_ENV} must be at least 1 (seconds)")
    return DEFAULT_TIMEOUT_S if value is None else value


def join() -> ProcessInfo:
    """Initialize jax.distributed (once) and say which process this is.

    Nothing that can fail on one process only may run before this: a process that exits
    before joining leaves the others waiting in ``initialize`` (bounded by the timeout).
    """
    import jax

    if jax_seam.distributed_client() is None:
        timeout = timeout_seconds()
        kwargs: dict[str, Any] = {}
        address = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None
        count, rank = _int_env("JAX_NUM_PROCESSES"), _int_env("JAX_PROCESS_ID")
        if address:
            kwargs["coordinator_address"] = address
        if count is not None:
            kwargs["num_processes"] = count
        if rank is not None:
            kwargs["process_id"] = rank
        # JAX aborts the process (SIGABRT, a C++ stack) when its own init timeout passes: this
        # watchdog ends it first, with the one-line error and exit code of Unreachable.
        watchdog = threading.Timer(
            timeout,
            _give_up,
            args=(
                f"--distributed: the JAX job's other processes did not join within {timeout} s ({TIMEOUT_ENV}); "
                "did one of them fail before joining?",
            ),
        )
        watchdog.daemon = True
        watchdog.start()
        try:
            try:
                jax.distributed.initialize(**kwargs, initialization_timeout=timeout + _JAX_GRACE_S)
            except Exception as exc:  # noqa: BLE001 - JAX raises RuntimeError, ValueError or its own error
                raise EnvironmentMismatch(
                    f"--distributed: could not join the JAX job ({first_line(exc)}); set JAX_COORDINATOR_ADDRESS, "
                    "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or run where JAX detects the cluster"
                ) from exc
            # Creating the backend exchanges every process's devices: it waits for all of them too.
            return ProcessInfo(jax.process_index(), jax.process_count())
        finally:
            watchdog.cancel()
    return ProcessInfo(jax.process_index(), jax.process_count())


def _give_up(message: str) -> None:
    """End this process now with cachectl's one-line error (exit 2, Unreachable): JAX's threads hold
    no state of ours yet, and its shutdown at exit would wait for the peers that never came."""
    sys.stderr.write(f"cachectl: error: {message}\n")
    sys.stderr.flush()
    os._exit(Unreachable.exit_code)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
