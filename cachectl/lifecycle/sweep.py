"""Debris of writers that died: ``.tmp-*`` files, bundle staging directories, upload spool files.

A writer killed with kill -9 runs no cleanup. Its files are found here and removed by verify's
repair (under the lifecycle lease), by the next bundle install (its own staging directory's
siblings) and by the server at start (its spool directory), never while their writer lives:
``temps.writer_gone`` reads the writer's host and pid from the name, as the lifecycle lease
reads its holder's.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachectl.core import temps
from cachectl.storage.store import Store


@dataclass(frozen=True, slots=True)
class Debris:
    path: str  # relative to the store's root (a spool file: its full path)
    why: str
    directory: bool = False


def _age(st: os.stat_result, now: float) -> float:
    return max(0.0, now - st.st_mtime)


def find_debris(
    store: Store, temp_paths: Iterable[str], *, staging: bool = True, now: float | None = None
) -> list[Debris]:
    """The ``.tmp-*`` files among ``temp_paths`` (relative to the root, from a listing) and, with
    ``staging``, the bundle staging directories whose writers are gone. Local stores only: an
    object store's writes are single PUTs that leave nothing behind."""
    if not store.is_local:
        return []
    now = time.time() if now is None else now
    found = []
    for rel in temp_paths:
        try:
            st = os.lstat(store.url_for(rel))
        except FileNotFoundError:
            continue
        why = temps.writer_gone(rel.rsplit("/", 1)[-1], temps.TEMP_PREFIX, _age(st, now))
        if why:
            found.append(Debris(rel, why))
    where = Path(store.url_for(temps.STAGING_DIR))
    try:
        names = sorted(os.listdir(where)) if staging else []
    except OSError:  # none, or not ours to list
        names = []
    for name in names:
        try:
            st = os.lstat(where / name)
        except FileNotFoundError:
            continue
        why = temps.writer_gone(name, temps.STAGING_PREFIX, _age(st, now))
        if why:
            found.append(Debris(f"{temps.STAGING_DIR}/{name}", why, directory=True))
    return found


def remove(store: Store, debris: Iterable[Debris]) -> int:
    """Remove what is still debris now (a second look right before, as verify's quarantine does)."""
    wanted = list(debris)
    again = {d.path for d in find_debris(store, [d.path for d in wanted if not d.directory])}
    removed = 0
    for d in wanted:
        if d.path not in again:
            continue
        full = store.url_for(d.path)
        try:
            if d.directory:
                shutil.rmtree(full)
            else:
                os.unlink(full)
            removed += 1
        except OSError:  # gone meanwhile, or not ours to remove: left for its owner
            pass
    return removed


def sweep_staging(store: Store) -> int:
    """Remove the staging directories of bundle installs that died (before one stages anew)."""
    return remove(store, find_debris(store, []))


def sweep_dir(directory: str, kind: str) -> int:
    """Remove the ``kind`` temporaries (files or directories) in a local ``directory`` whose
    writers are gone; the count removed."""
    now = time.time()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(kind):
            continue
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
            if temps.writer_gone(name, kind, _age(st, now)):
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(full)
                else:
                    os.unlink(full)
                removed += 1
        except OSError:  # gone meanwhile, or another user's: left for its owner
            continue
    return removed


def sweep_spool(directory: str | None) -> int:
    """Remove the spool files of uploads whose server died (``directory``: the server's upload
    directory, None for the system temporary directory it then uses)."""
    return sweep_dir(directory or tempfile.gettempdir(), temps.SPOOL_PREFIX)
