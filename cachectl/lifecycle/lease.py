"""A lease in the index: at most one prune/gc/verify --quarantine acts on a cache at once.

The lease is a row in ``leases`` with an expiry. Taking it is one atomic step:
on PostgreSQL an ``INSERT ... ON CONFLICT DO UPDATE ... WHERE expired`` (the
row lock makes concurrent takers queue, and only one sees its row come back);
on SQLite a ``BEGIN IMMEDIATE`` transaction (the database's write lock
serializes the read-check-write). A holder renews while it works; one that
crashed stops renewing and its lease expires, so nothing blocks forever. A
holder that died on this very host (its pid is gone) is taken over at once,
so a re-run after a crash need not wait for the expiry.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, insert, or_, select, update

from cachectl.core.errors import OperationFailed
from cachectl.index import Index, actor
from cachectl.index.models import Lease as LeaseRow
from cachectl.index.models import utcnow

DEFAULT_TTL_S = 300.0


class LeaseHeld(OperationFailed):
    """Another run holds the cache's lifecycle lease (exit 1: try again later)."""


def lease_name(cache: str) -> str:
    """One lease per cache, shared by prune, gc and verify --quarantine."""
    return f"lifecycle:{cache}"


def _holder_id(operation: str) -> str:
    # user@host:pid:operation:token — host and pid let a re-run on the same
    # host see that the holder died; the token makes every holder unique.
    return f"{actor()}:{os.getpid()}:{operation}:{uuid.uuid4().hex[:8]}"


def _parse_holder(holder: str) -> tuple[str, int | None, str]:
    """(host, pid, operation) from a holder id; pid None if unreadable."""
    parts = holder.rsplit(":", 3)
    if len(parts) != 4:
        return "", None, "?"
    who, pid, operation, _token = parts
    host = who.rsplit("@", 1)[-1]
    try:
        return host, int(pid), operation
    except ValueError:
        return host, None, operation


def _describe(holder: str, expires_at: datetime | None) -> str:
    who = holder.rsplit(":", 3)[0]
    _host, pid, operation = _parse_holder(holder)
    until = f", lease expires {expires_at:%Y-%m-%d %H:%M:%S} UTC" if expires_at else ""
    return f"{operation} by {who} (pid {pid}){until}"


def _holder_dead(holder: str) -> bool:
    """True only when the holder ran on this host and its process is gone."""
    host, pid, _op = _parse_holder(holder)
    if pid is None or host != socket.gethostname():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by someone else
    return False


@dataclass
class Lease:
    """A lease this process holds.

    While held (see ``held``) a daemon thread renews it every ttl/3, so one
    long storage call (a recursive delete of a huge namespace) cannot let it
    lapse; workers call ``check()`` between batches, which raises once the
    lease was lost. A process that dies stops renewing: the lease expires.
    """

    index: Index
    name: str
    holder: str
    ttl_s: float
    expires_at: datetime
    _lost: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def renew(self) -> None:
        """Push the expiry out by ttl; fail if the lease was lost."""
        expires = utcnow() + timedelta(seconds=self.ttl_s)
        value = (
            func.now() + timedelta(seconds=self.ttl_s)
            if self.index.dialect == "postgresql"
            else expires
        )
        with self.index.session() as s:
            result = s.execute(
                update(LeaseRow)
                .where(LeaseRow.name == self.name, LeaseRow.holder == self.holder)
                .values(expires_at=value)
            )
            if not cast("CursorResult[Any]", result).rowcount:
                raise OperationFailed(
                    f"lost the lease {self.name!r} (it expired and another run took it): stopping; "
                    "re-run to finish, `cachectl sync` reconciles anything left over"
                )
        self.expires_at = expires

    def check(self) -> None:
        """Raise if the keep-alive thread found the lease gone."""
        if self._lost is not None:
            raise self._lost

    def start_keepalive(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except OperationFailed as exc:
                    self._lost = exc
                    return
                except Exception:  # noqa: BLE001 - index hiccup: try again next beat
                    continue

        self._thread = threading.Thread(target=beat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self.index.session() as s:
            s.execute(
                delete(LeaseRow).where(LeaseRow.name == self.name, LeaseRow.holder == self.holder)
            )


def _acquire_sqlite(
    index: Index, name: str, holder: str, ttl_s: float
) -> tuple[bool, str, datetime]:
    now = utcnow()
    expires = now + timedelta(seconds=ttl_s)
    with index.engine.connect() as conn:
        conn.info["immediate"] = True  # db._sqlite_begin issues BEGIN IMMEDIATE
        try:
            with conn.begin():
                row = conn.execute(
                    select(LeaseRow.holder, LeaseRow.expires_at).where(LeaseRow.name == name)
                ).first()
                if row is not None and row.expires_at > now and not _holder_dead(row.holder):
                    return False, row.holder, row.expires_at
                if row is None:
                    conn.execute(
                        insert(LeaseRow).values(
                            name=name, holder=holder, acquired_at=now, expires_at=expires
                        )
                    )
                else:
                    conn.execute(
                        update(LeaseRow)
                        .where(LeaseRow.name == name)
                        .values(holder=holder, acquired_at=now, expires_at=expires)
                    )
        finally:
            conn.info.pop("immediate", None)
    return True, holder, expires


def _acquire_postgres(
    index: Index, name: str, holder: str, ttl_s: float
) -> tuple[bool, str, datetime]:
    # Imported here: the PostgreSQL dialect (and asyncpg's) is an import an SQLite index never needs.
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    # Server time, not ours: hosts with skewed clocks still agree on expiry.
    now = func.now()
    expires = func.now() + timedelta(seconds=ttl_s)
    table = LeaseRow.__table__
    for _attempt in range(3):
        upsert = pg_insert(LeaseRow).values(
            name=name, holder=holder, acquired_at=now, expires_at=expires
        )
        stmt = upsert.on_conflict_do_update(
            index_elements=[table.c.name],
            set_={"holder": holder, "acquired_at": now, "expires_at": expires},
            where=or_(table.c.expires_at <= func.now(), table.c.holder == holder),
        ).returning(table.c.expires_at)
        with index.session() as s:
            got = s.execute(stmt).first()
            if got is not None:
                return True, holder, got.expires_at
            row = s.execute(
                select(LeaseRow.holder, LeaseRow.expires_at).where(LeaseRow.name == name)
            ).first()
            if row is None:
                continue  # released between the two statements: try again
            if not _holder_dead(row.holder):
                return False, row.holder, row.expires_at
            # The holder died on this host: take over exactly that holder's lease.
            taken = s.execute(
                update(LeaseRow)
                .where(LeaseRow.name == name, LeaseRow.holder == row.holder)
                .values(holder=holder, acquired_at=now, expires_at=expires)
                .returning(LeaseRow.expires_at)
            ).first()
            if taken is not None:
                return True, holder, taken.expires_at
    return False, "?", utcnow()


def acquire(index: Index, name: str, operation: str, *, ttl_s: float = DEFAULT_TTL_S) -> Lease:
    """Take the lease or raise LeaseHeld naming who holds it."""
    holder = _holder_id(operation)
    take = _acquire_postgres if index.dialect == "postgresql" else _acquire_sqlite
    ok, current, expires = take(index, name, holder, ttl_s)
    if not ok:
        cache = name.split(":", 1)[-1]
        raise LeaseHeld(
            f"cache {cache!r} is busy: {_describe(current, expires)}; not acting — "
            "re-run when it has finished (a crashed holder's lease expires on its own)"
        )
    return Lease(index, name, holder, ttl_s, expires)


@contextmanager
def held(
    index: Index, cache: str, operation: str, *, ttl_s: float | None = None
) -> Iterator[Lease]:
    """Hold the cache's lifecycle lease for the duration of the block."""
    ttl = (
        ttl_s if ttl_s is not None else float(os.environ.get("CACHECTL_LEASE_TTL_S", DEFAULT_TTL_S))
    )
    lease = acquire(index, lease_name(cache), operation, ttl_s=ttl)
    lease.start_keepalive()
    try:
        yield lease
    finally:
        lease.release()
