"""Who may mutate a cache in direct mode: the cache's ``writers`` policy.

Writers are OS user names and ``@group`` names. An empty policy means anyone
who can write the storage may write. Checked before anything is touched.
"""

from __future__ import annotations

import getpass
import grp
import os
import pwd

from cachectl.core.errors import PermissionDenied
from cachectl.core.records import CacheInfo


def current_user() -> str:
    """This process's user name; ``uid N`` where it has none (no passwd entry, no USER or
    LOGNAME), which no writers list names, so such a process is refused with a clear line."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        pass
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # 3.11 raises KeyError, 3.13 OSError
        return f"uid {os.geteuid()}"


def current_groups() -> set[str]:
    names = set()
    for gid in {os.getegid(), *os.getgroups()}:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


def is_writer(cache: CacheInfo, user: str | None = None, groups: set[str] | None = None) -> bool:
    if not cache.writers:
        return True
    user = user or current_user()
    groups = current_groups() if groups is None else groups
    for writer in cache.writers:
        if writer.startswith("@") and writer[1:] in groups:
            return True
        if writer == user:
            return True
    return False


def check_writer(cache: CacheInfo, operation: str) -> None:
    """Refuse (exit 4) before a mutating operation if this user is not a writer."""
    if not is_writer(cache):
        raise PermissionDenied(
            f"user {current_user()!r} may not {operation} cache {cache.name!r}: writers are "
            f"{', '.join(cache.writers)}; ask an owner to run `cachectl cache set {cache.name} --writers ...`"
        )


def parse_writers(text: str | None) -> list[str] | None:
    """``alice,@mlops`` -> ['alice', '@mlops']; '' clears the list."""
    if text is None:
        return None
    return [w.strip() for w in text.split(",") if w.strip()]
