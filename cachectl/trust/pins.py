"""The keys a service's owner has seen each cache trust, kept where only that owner writes.

Whoever can write the index can rewrite a cache's ``trusted_keys`` (``UPDATE caches SET
trusted_keys=NULL``, or their own key). A service must not follow: the first time it sees a
cache trust keys it pins them in ``<state dir>/trust-pins.json`` (mode 0600, in a 0700
directory), and from then on that cache trusts exactly the pinned keys (or ``CACHECTL_TRUST``),
whatever the index says. A file another user could have written is ignored with a warning: a
pin planted by someone else would make the service trust their key.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from cachectl.core.config import state_dir
from cachectl.core.temps import atomic_write, makedirs
from cachectl.trust.owned import owner_problem

PINS_FILE = "trust-pins.json"
MAX_PINS_BYTES = 4 * 1024 * 1024


def pins_path() -> Path:
    return state_dir() / PINS_FILE


def pin_id(index: str, cache: str) -> str:
    """One cache of one index (a database URL or a server URL): what a pin is for."""
    return f"{index}#{cache}"


def _owned(path: Path, problems: list[str]) -> bool:
    """Whether ``path`` and its directory belong to this user and nobody else can write them."""
    for p in (path.parent, path):
        problem = owner_problem(os.lstat(p), p)
        if problem is not None:
            problems.append(problem)
            return False
    return True


def read_pins(problems: list[str]) -> dict[str, tuple[str, ...]]:
    """Every pin; {} when there is no file, or one that others could have written or that is
    damaged (then ``problems`` says so)."""
    path = pins_path()
    try:
        if not _owned(path, problems):
            return {}
        with open(path, "rb") as fh:
            data = fh.read(MAX_PINS_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        problems.append(f"cannot read {path} ({exc.strerror or exc})")
        return {}
    try:
        doc = json.loads(data) if len(data) <= MAX_PINS_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    pins = doc.get("pins") if isinstance(doc, dict) else None
    if not isinstance(pins, dict):
        problems.append(f"{path} is damaged (remove it; services pin keys again)")
        return {}
    return {
        str(k): tuple(str(x) for x in v)
        for k, v in pins.items()
        if isinstance(v, list) and all(isinstance(x, str) for x in v)
    }


def pinned(index: str, cache: str, problems: list[str]) -> tuple[str, ...]:
    """The keys pinned for this cache; () when none."""
    return read_pins(problems).get(pin_id(index, cache), ())


def pin(index: str, cache: str, keys: tuple[str, ...], problems: list[str]) -> None:
    """Pin ``keys`` for this cache (a first sight: an existing pin is never replaced here)."""
    path = pins_path()
    try:
        makedirs(path.parent, 0o700)
        os.chmod(path.parent, stat.S_IMODE(os.lstat(path.parent).st_mode) & ~0o022)
        pins = read_pins(problems) if path.exists() else {}
        ident = pin_id(index, cache)
        if ident in pins or not _owned_dir(path.parent):
            return
        pins[ident] = tuple(sorted(keys))
        body = json.dumps({"pins": {k: list(v) for k, v in sorted(pins.items())}}, indent=1)
        atomic_write(str(path), 0o600, lambda fh: fh.write(body.encode()))
    except OSError as exc:
        problems.append(f"could not pin the trusted keys in {path} ({exc.strerror or exc})")


def _owned_dir(directory: Path) -> bool:
    info = os.lstat(directory)
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


# -- entries this owner's services wrote ------------------------------------------------------------

WRITTEN_DIR = "written"
MAX_WRITTEN_BYTES = 16 * 1024 * 1024


def _written_path(index: str, cache: str, digest: str) -> Path:
    import hashlib

    name = hashlib.sha256(f"{pin_id(index, cache)}#{digest}".encode()).hexdigest()[:32]
    return state_dir() / WRITTEN_DIR / f"{name}.txt"


def remember_written(index: str, cache: str, digest: str, key: str, sha256: str) -> None:
    """Append ``key sha256``: an entry this owner's service compiled and JAX wrote, which the
    owner's later services may read back before anyone indexes it. Never raises."""
    path = _written_path(index, cache, digest)
    try:
        makedirs(path.parent, 0o700)
        if not _owned_dir(path.parent) or not _owned_dir(path.parent.parent):
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, f"{key} {sha256}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        return


def written(index: str, cache: str, digest: str, problems: list[str]) -> dict[str, str]:
    """key -> sha256 of the entries :func:`remember_written` recorded (the last one per key); {}
    when none, or when the file could have been written by someone else."""
    path = _written_path(index, cache, digest)
    try:
        if not _owned(path, problems) or not _owned_dir(path.parent.parent):
            return {}
        with open(path, "rb") as fh:
            data = fh.read(MAX_WRITTEN_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        problems.append(f"cannot read {path} ({exc.strerror or exc})")
        return {}
    found: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(" ")
        if len(parts) == 2 and len(parts[1]) == 64:
            found[parts[0]] = parts[1]
    return found
