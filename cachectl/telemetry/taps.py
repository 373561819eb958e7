"""Taps on JAX's compiler and pxla loggers: read a log call's arguments, pass the call on unchanged.

JAX names the key of a hit only in a DEBUG log call, and a program's input avals only
in a guarded DEBUG lowering call (cachectl.core.jax_seam). Lowering a logger to DEBUG would
make every debug call in that module build a LogRecord and hand it to the service's
handlers; a tap instead wraps the one logger object's methods, so its level, its
handlers and what the service sees stay exactly as they were.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from cachectl.core import jax_seam


class CompilerCalls(Protocol):
    """What LogTap hands each compiler log call it reads to (the Collector implements it):
    a protocol here, so that taps.py needs nothing from collector.py."""

    def _on_log(self, hit: bool, module: str, key: str) -> None: ...

    def _on_not_written(self, module: str) -> None: ...

    def _on_host_callbacks(self, module: str) -> None: ...


class Lowerings(Protocol):
    """What SignatureTap hands each lowering to (the Collector; misses' and tests' recorders)."""

    def _on_lowering(self, module: Any, in_avals: Any, in_shardings: Any) -> None: ...


class _Tap:
    """What both taps share: the logger's own methods they replace, saved and put back."""

    METHODS: tuple[str, ...] = ()

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._saved: dict[str, Any] = {}

    def _save(self) -> None:
        for name in self.METHODS:
            if name in self.logger.__dict__:
                self._saved[name] = self.logger.__dict__[name]

    def uninstall(self) -> None:
        for name in self.METHODS:
            if name in self._saved:
                setattr(self.logger, name, self._saved[name])
            else:
                self.logger.__dict__.pop(name, None)


class LogTap(_Tap):
    """Reads the hit/miss records of JAX's compiler logger as JAX emits them, for free.

    JAX names the key of a hit only in a DEBUG record. Lowering the logger to
    DEBUG would make every debug call in that module build a LogRecord (stack
    walk, timestamps; several per compile) and hand it to the
    service's handlers. Instead the tap wraps this one logger's ``log`` and
    ``debug`` methods: it reads module and key from the call's arguments and
    passes every call on unchanged, so the logger's level, its handlers and
    what the service sees stay exactly as they were, and a suppressed DEBUG
    record is never built at all.
    """

    METHODS = ("log", "debug")

    def __init__(self, collector: CompilerCalls, logger: logging.Logger) -> None:
        super().__init__(logger)
        self.collector = collector

    def install(self) -> None:
        logger = self.logger
        cls_log, cls_debug = type(logger).log, type(logger).debug
        self._save()
        prev_log = self._saved.get("log")
        prev_debug = self._saved.get("debug")
        peek = jax_seam.compiler_call_reader(
            self.collector._on_log,
            self.collector._on_not_written,
            self.collector._on_host_callbacks,
        )

        # stacklevel + 1: records keep naming JAX's line, not this wrapper.
        def log(level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
            peek(msg, args)
            if prev_log is not None:
                prev_log(level, msg, *args, **kwargs)
            elif logger.isEnabledFor(level):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls_log(logger, level, msg, *args, **kwargs)

        def debug(msg: Any, *args: Any, **kwargs: Any) -> None:
            peek(msg, args)
            if prev_debug is not None:
                prev_debug(msg, *args, **kwargs)
            elif logger.isEnabledFor(logging.DEBUG):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls_debug(logger, msg, *args, **kwargs)

        logger.log = log  # type: ignore[method-assign]
        logger.debug = debug  # type: ignore[method-assign]


class SignatureTap(_Tap):
    """Reads each lowering's module name, input avals and shardings from the one guarded
    debug call of JAX's pxla logger (see cachectl.core.jax_seam)."""

    METHODS = ("log", "isEnabledFor")

    def __init__(self, collector: Lowerings, logger: logging.Logger) -> None:
        super().__init__(logger)
        self.collector = collector

    def install(self) -> None:
        logger = self.logger
        cls = type(logger)
        self._save()
        prev_log = self._saved.get("log")
        prev_enabled = self._saved.get("isEnabledFor")
        collector = self.collector
        is_lowering = jax_seam.is_lowering

        def really_enabled(level: int) -> bool:
            return (
                prev_enabled(level) if prev_enabled is not None else cls.isEnabledFor(logger, level)
            )

        def is_enabled(level: int) -> bool:
            return level == logging.DEBUG or really_enabled(level)

        def log(level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
            if is_lowering(msg, args):
                collector._on_lowering(args[0], args[1], args[2])
            if prev_log is not None:
                prev_log(level, msg, *args, **kwargs)
            elif really_enabled(level):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls.log(logger, level, msg, *args, **kwargs)

        logger.isEnabledFor = is_enabled  # type: ignore[method-assign]
        logger.log = log  # type: ignore[method-assign]
