"""The user's part of a traceback: where in *their* code a bucket failed.

A bucket fails inside a stack of cachectl (warm, manifest), JAX (tracing,
lowering) and the standard library (thread pools). None of that is what the
user can fix; the frames of their own function or pytree callable are. These
helpers keep only those frames, for ``warm -v`` and for the ``(at file:line)``
that ends a failed bucket's one-line error.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

from cachectl.core.errors import CachectlError

_CACHECTL_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # cachectl/, above warm/


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are never the user's: cachectl, JAX, jaxlib, then the stdlib (last)."""
    dirs = [_CACHECTL_DIR]
    for name in ("jax", "jaxlib"):
        try:
            module = __import__(name)
        except ImportError:  # pragma: no cover - JAX is a dependency
            continue
        assert module.__file__ is not None  # jax and jaxlib are regular packages
        dirs.append(str(Path(module.__file__).resolve().parent) + os.sep)
    dirs.append(str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep)
    return tuple(dirs)


def _origin(exc: BaseException) -> BaseException:
    """The exception user code raised: cachectl re-raises it as BadInput ``from None``."""
    seen = {id(exc)}
    while exc.__traceback__ is None or _is_rewrap(exc):
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    return exc


def _is_rewrap(exc: BaseException) -> bool:
    return isinstance(exc, CachectlError) and (exc.__cause__ or exc.__context__) is not None


def _is_library(filename: str, libraries: tuple[str, ...]) -> bool:
    if filename.startswith("<frozen"):
        return True
    path = str(Path(filename).resolve())
    # Installed packages (a user's own among them) may live under the stdlib's directory.
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return path.startswith(libraries[:-1]) or (path.startswith(libraries[-1]) and not installed)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback that are in neither cachectl, JAX nor the stdlib."""
    libraries = _library_dirs()
    frames = traceback.extract_tb(_origin(exc).__traceback__)
    return [f for f in frames if not _is_library(f.filename, libraries)]


def location(exc: BaseException) -> str | None:
    """``file:line`` of the innermost user frame, or None when the user's code is not on the stack."""
    frames = user_frames(exc)
    if not frames:
        return None
    path = frames[-1].filename
    try:
        relative = os.path.relpath(path)
    except ValueError:  # pragma: no cover - another drive on Windows
        relative = path
    return f"{path if relative.startswith('..') else relative}:{frames[-1].lineno}"


def format_user_traceback(exc: BaseException) -> str | None:
    """A traceback of the user's frames only, ending with the exception they raised."""
    origin = _origin(exc)
    frames = user_frames(exc)
    if not frames:
        return None
    lines = ["Traceback (your code only; cachectl, JAX and stdlib frames hidden):\n"]
    lines += traceback.format_list(frames)
    error = "".join(traceback.format_exception_only(type(origin), origin))
    # JAX appends a note on its own traceback filtering after a dashed line: not the user's error.
    lines.append(error.split("\n" + _JAX_NOTE_RULE, 1)[0])
    return "".join(lines).rstrip("\n")


_JAX_NOTE_RULE = "-" * 20 + "\n"
