"""open_index: the one place that chooses and opens the index a command or a service works with.

Three drivers, named in :data:`DRIVERS` by dotted path and imported only when chosen (as fsspec's
registry does), so a plain ``activate()`` never imports SQLAlchemy nor httpx:

- ``stdlib``: :class:`cachectl.index.stdlib.StdlibReads`, sqlite3 on a plain ``sqlite:///PATH``
  index at SCHEMA_REVISION; it answers reads and a service's writes itself, and opens the
  ``sqlalchemy`` driver behind it only for what it does not run;
- ``sqlalchemy``: :class:`cachectl.index.sql.Index`, any database, creating and migrating;
- ``http``: :class:`cachectl.client.remote.RemoteIndex`, the cachectl server (CACHECTL_SERVER).

Each returns an :class:`cachectl.index.protocol.IndexBackend`. The role says who asks:
``command`` (the CLI, long timeouts, migrations) or ``service`` (activate() and
cachectl.serving: short timeouts, no Alembic unless the schema is missing).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from cachectl.core.errors import BadInput

if TYPE_CHECKING:
    from cachectl.core.config import Settings
    from cachectl.index.protocol import IndexBackend
    from cachectl.index.sql import Index

Role = Literal["command", "service"]
ROLES: tuple[Role, ...] = ("command", "service")

# name -> "module:callable"; the callable takes (settings, role) and returns the opened index,
# or None where that driver cannot serve these settings (the next one in open_index's order does).
DRIVERS: dict[str, str] = {
    "stdlib": "cachectl.index.stdlib:StdlibReads.open_for",
    "sqlalchemy": "cachectl.index.sql:Index.open_for",
    "http": "cachectl.client.remote:RemoteIndex.open_for",
}

# A database URL, rather than settings, names the sqlalchemy driver's own opener.
URL_OPENER = "cachectl.index.sql:open_url"

Opener = Callable[["Settings", Role], "IndexBackend | None"]


def _load(name: str, path: str) -> Any:
    """The object ``path`` ("module:attr.attr") names, imported now."""
    module_name, _, attr = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(
            f"index driver {name!r} cannot load ({exc}): install it with "
            "`pip install 'cachectl[all]'`"
        ) from None
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def driver(name: str) -> Opener:
    """The opener ``name`` stands for in DRIVERS, imported now; BadInput names what is missing."""
    try:
        path = DRIVERS[name]
    except KeyError:
        raise BadInput(
            f"unknown index driver {name!r}: use one of {', '.join(sorted(DRIVERS))}"
        ) from None
    opener: Opener = _load(name, path)
    return opener


@overload
def open_index(
    target: str, role: Role = "command", *, auto_migrate: bool | None = None
) -> Index: ...


@overload
def open_index(target: Settings, role: Role = "command") -> IndexBackend: ...


def open_index(
    target: str | Settings, role: Role = "command", *, auto_migrate: bool | None = None
) -> IndexBackend | Index:
    """The index ``target`` names: a database URL opens the ``sqlalchemy`` driver on it (created
    and migrated for SQLite unless ``auto_migrate`` says otherwise); settings open ``http`` in
    server mode, else ``stdlib`` where it can serve the file, else ``sqlalchemy``."""
    if role not in ROLES:
        raise BadInput(f"unknown index role {role!r}: use one of {', '.join(ROLES)}")
    if isinstance(target, str):
        index: Index = _load("sqlalchemy", URL_OPENER)(target, auto_migrate=auto_migrate)
        return index
    order = ("http",) if target.server else ("stdlib", "sqlalchemy")
    for name in order:
        opened = driver(name)(target, role)
        if opened is not None:
            return opened
    raise BadInput(f"no index driver can open {target.db}")  # sqlalchemy always answers


__all__ = ["DRIVERS", "ROLES", "Role", "driver", "open_index"]
