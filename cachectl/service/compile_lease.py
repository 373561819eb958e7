"""One compile per program across a fleet: the compile lease on a miss of JAX's persistent cache.

JAX's cache asks ``get(key)``; on a miss it compiles and calls ``put(key)``. A process that may
write takes the key's lease in the index before compiling (cachectl/index/compile_leases.py, or
the server's routes in server mode) and a thread renews it every ttl/3 (CACHECTL_COMPILE_LEASE_TTL_S,
10 s; at most compile_leases.MAX_TTL_S or the server's maximum, 60 s): a holder killed with
kill -9 loses it within the ttl, and a lease taken with a longer ttl is granted no more. While
it holds the lease, the compiling thread has JAX write what it compiles however fast
(jax_seam.write_whatever_compile_time: JAX's 1 s minimum would leave a fast program unwritten
and every waiter compiling). ``put`` marks it ``written`` with the sha256 of the bytes this
process handed JAX's put (never of a file read back at the key: one planted there is not
vouched for); a compile that ended without one (JAX did not write it, or it raised)
marks it ``unwritten`` when pxla's compile stage ends, and the heartbeat stops after
CACHECTL_COMPILE_LEASE_MAX_S whatever happens, so nothing holds a lease forever.

Another process that misses the same key waits and polls the row: ``written`` -> it reads the
entry and checks it against that sha256 (the index's record, as for any entry in a cache that
trusts no keys); ``unwritten`` -> it compiles. Its wait is bounded: when the heartbeat stops, one
waiter takes the lease (within the granted ttl); past about twice that key's recorded compile
time (its last lease's, else warm's entry row for it, else CACHECTL_COMPILE_LEASE_HEDGE_S, 60 s),
one waiter (the one whose hedge claim lands) compiles too. A holder ends its leases when its process
exits (atexit), and a waiter on the holder's host whose process is gone (killed, even with
kill -9) takes the lease over at once rather than at its expiry (the holder's name says its host
and pid namespace, and its pid). A read-only process never takes a lease
and waits only while a writer holds one. Anything the index cannot answer turns the lease off
for the process with one warning: it compiles what it misses, as plain JAX does.
CACHECTL_COMPILE_LEASE=0 turns it off. A cache that trusts signing keys never leases: a service's
entry counts there only when a trusted key signed it, so waiting for one would not help.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import PermissionDenied
from cachectl.index import compile_leases as q
from cachectl.trust import gate

log = logging.getLogger(__name__)

LEASE_ENV = "CACHECTL_COMPILE_LEASE"
TTL_ENV = "CACHECTL_COMPILE_LEASE_TTL_S"
MAX_ENV = "CACHECTL_COMPILE_LEASE_MAX_S"
HEDGE_ENV = "CACHECTL_COMPILE_LEASE_HEDGE_S"
DEFAULT_TTL_S = 10.0
DEFAULT_MAX_S = 1800.0
# The hedge bound of a key with no recorded compile time: one waiter compiles too past it.
DEFAULT_HEDGE_S = 60.0
POLL_S = 0.1
MAX_POLL_S = 0.5


def lease_enabled() -> bool:
    """CACHECTL_COMPILE_LEASE: on unless 0/false/no/off."""
    return os.environ.get(LEASE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _host() -> str:
    """This host as a holder's name says it: its name and pid namespace (two containers with one
    host name do not see each other's processes)."""
    try:
        ns = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{ns}" if ns else socket.gethostname()


def tag_of(holder: str) -> str:
    """The tag a holder asked for (``host:pid:nonce``): the server's name for it is
    ``token<id>|<tag>`` (server/lease_routes.py), an index opened here stores the tag itself."""
    return holder.partition("|")[2] if "|" in holder else holder


def gone_here(holder: str, host: str) -> bool:
    """Whether ``holder`` (``host:pid:tag``) was a process on this host that no longer runs (or
    is a zombie: killed, not yet reaped). Another host's, or a live one's: False."""
    where, _, rest = tag_of(holder).rpartition(":")[0].rpartition(":")
    if where != host or not rest.isdigit() or int(rest) == os.getpid():
        return False
    pid = int(rest)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it runs, as another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        log.warning("cachectl: ignoring %s=%r: use a number of seconds", name, os.environ[name])
        return default
    return value if value > 0 else default


@dataclass
class _Held:
    key: str
    module: str | None
    started: float
    read: Callable[[str], bytes | None]
    hedge: bool = False  # compiling as the hedge of another holder's compile, not holding


class Lessor:
    """What one leasing process asks: the index's driver (SQL here, or the server's routes)."""

    def take(
        self, key: str, holder: str, ttl_s: float, module: str | None, stale: str | None
    ) -> q.Seen | None:
        raise NotImplementedError

    def look(self, key: str) -> q.Seen | None:
        raise NotImplementedError

    def renew(self, key: str, holder: str, ttl_s: float) -> bool:
        raise NotImplementedError

    def hedge(self, key: str, holder: str) -> bool:
        raise NotImplementedError

    def release(self, key: str, holder: str) -> bool:
        raise NotImplementedError

    def finish(self, key: str, holder: str, sha256: str | None, compile_ms: int | None) -> bool:
        raise NotImplementedError

    def recorded_ms(self, key: str) -> int | None:
        raise NotImplementedError


class SqlLessor(Lessor):
    """The lease on an index this process opened (stdlib sqlite3 or SQLAlchemy)."""

    def __init__(self, runner: q.Runner, cache: str, digest: str) -> None:
        self.r, self.cache, self.digest = runner, cache, digest
        self.scope = f"{cache}/{digest}"

    def take(
        self, key: str, holder: str, ttl_s: float, module: str | None, stale: str | None
    ) -> q.Seen | None:
        return q.take(
            self.r, self.scope, key, holder, ttl_s=ttl_s, module=module, stale_sha256=stale
        )

    def look(self, key: str) -> q.Seen | None:
        return q.look(self.r, self.scope, key)

    def renew(self, key: str, holder: str, ttl_s: float) -> bool:
        return q.renew(self.r, self.scope, key, holder, ttl_s=ttl_s)

    def hedge(self, key: str, holder: str) -> bool:
        return q.hedge(self.r, self.scope, key, holder)

    def release(self, key: str, holder: str) -> bool:
        return q.release(self.r, self.scope, key, holder)

    def finish(self, key: str, holder: str, sha256: str | None, compile_ms: int | None) -> bool:
        return q.finish(self.r, self.scope, key, holder, sha256=sha256, compile_ms=compile_ms)

    def recorded_ms(self, key: str) -> int | None:
        return q.recorded_ms(self.r, self.scope, self.cache, self.digest, key)


class RemoteLessor(Lessor):
    """The lease through the server's routes (a process in server mode)."""

    def __init__(self, client: Any, cache: str, digest: str) -> None:
        self.client, self.cache, self.digest = client, cache, digest

    def _call(self, action: str, **body: Any) -> Any:
        return self.client.compile_lease(self.cache, self.digest, action, body)

    def take(
        self, key: str, holder: str, ttl_s: float, module: str | None, stale: str | None
    ) -> q.Seen | None:
        doc = self._call("take", key=key, holder=holder, ttl_s=ttl_s, module=module, stale=stale)
        return q.Seen.from_json(doc) if doc else None

    def look(self, key: str) -> q.Seen | None:
        doc = self._call("look", key=key)
        return q.Seen.from_json(doc) if doc else None

    def renew(self, key: str, holder: str, ttl_s: float) -> bool:
        return bool(self._call("renew", key=key, holder=holder, ttl_s=ttl_s))

    def hedge(self, key: str, holder: str) -> bool:
        return bool(self._call("hedge", key=key, holder=holder))

    def release(self, key: str, holder: str) -> bool:
        """``holder``: the tag; the server acts for this token's holder of that tag (403 for
        another token's lease: not ours to end, the waiter waits for its expiry)."""
        try:
            return bool(self._call("release", key=key, holder=tag_of(holder)))
        except PermissionDenied:
            return False

    def finish(self, key: str, holder: str, sha256: str | None, compile_ms: int | None) -> bool:
        try:
            return bool(
                self._call("finish", key=key, holder=holder, sha256=sha256, compile_ms=compile_ms)
            )
        except PermissionDenied:  # taken over meanwhile: no longer ours to finish
            return False

    def recorded_ms(self, key: str) -> int | None:
        value = self._call("recorded", key=key)
        return int(value) if value is not None else None


def lessor_for(index: Any, cache: str, digest: str) -> Lessor | None:
    """The lessor over the index a process holds; None where it has none to lease through."""
    if index is None:
        return None
    if getattr(index, "dialect", None) == "remote":
        client = getattr(index, "client", None)
        return RemoteLessor(client, cache, digest) if client is not None else None
    runner = q.runner_for(index)
    return SqlLessor(runner, cache, digest) if runner is not None else None


class CompileLeases:
    """The lease side of one process's verifying cache (service/namespace_verifier.py NamespaceVerifier)."""

    def __init__(
        self,
        lessor: Callable[[], Lessor | None],
        *,
        writer: bool,
        warn: Callable[[str], None],
    ) -> None:
        self._lessor_of = lessor
        self._lessor: Lessor | None = None
        self._opened = False
        self.writer = writer
        self._warn = warn
        self._off = False
        self.ttl_s = min(_seconds(TTL_ENV, DEFAULT_TTL_S), q.MAX_TTL_S)
        self.max_s = _seconds(MAX_ENV, DEFAULT_MAX_S)
        self.hedge_s = _seconds(HEDGE_ENV, DEFAULT_HEDGE_S)
        self.host = _host()
        self.me = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._beat: threading.Thread | None = None
        self._hooked = False

    # -- the verifying cache's calls ----------------------------------------------------------

    def missed(self, key: str, read: Callable[[str], bytes | None]) -> bytes | None:
        """On a miss: None to compile (holding the lease, hedging, or with no lease at all), or
        the entry another process stored meanwhile, checked against the sha256 it recorded."""
        lessor = self._get_lessor()
        if lessor is None:
            return None
        if getattr(self._local, "key", None) is not None:
            self._compile_ended()  # this thread's last compile has ended, whatever JAX said
        module = jax_seam.compiling_module(1)
        try:
            seen = self._take(lessor, key, module, None, read) if self.writer else lessor.look(key)
            return self._wait(lessor, key, module, seen, read)
        except Exception as exc:  # noqa: BLE001 - the index is down: compile as plain JAX
            self._turn_off(exc)
            return None

    def wrote(self, key: str, sha256: str) -> None:
        """``put`` was handed the entry: mark the lease written with ``sha256``, that of the
        bytes this process handed JAX's put, never of a file read back at the key (a file
        planted there is not this process's compile). Waiters check what they read against it."""
        with self._lock:
            held = self._held.pop(key, None)
        if held is None or self._lessor is None:
            return
        self._finish(held, sha256)

    def _compile_ended(self) -> None:
        """pxla's compile stage ended on this thread: a lease its put did not finish ends
        ``unwritten`` (JAX did not write the program, or the compile raised)."""
        restore = getattr(self._local, "restore", None)
        if restore is not None:
            self._local.restore = None
            restore()  # JAX's own minimum compile time again on this thread
        key = getattr(self._local, "key", None)
        if key is None:
            return
        self._local.key = None
        with self._lock:
            held = self._held.pop(key, None)
        if held is not None:
            self._finish(held, None)

    # -- the steps ------------------------------------------------------------------------------

    def _get_lessor(self) -> Lessor | None:
        if self._off:
            return None
        if not self._opened:
            self._opened = True
            try:
                self._lessor = self._lessor_of()
            except Exception as exc:  # noqa: BLE001
                self._turn_off(exc)
        return self._lessor

    def _take(
        self,
        lessor: Lessor,
        key: str,
        module: str | None,
        stale: str | None,
        read: Callable[[str], bytes | None],
    ) -> q.Seen | None:
        for _ in range(3):
            seen = lessor.take(key, self.me, self.ttl_s, module, stale)
            if seen is not None:
                if seen.mine:
                    if 0 < seen.left_s < 0.8 * self.ttl_s:  # granted less: beat to its pace
                        self.ttl_s = max(seen.left_s, 0.3)
                    self._hold(key, module, read, hedge=False)
                return seen
        return None

    def _wait(
        self,
        lessor: Lessor,
        key: str,
        module: str | None,
        seen: q.Seen | None,
        read: Callable[[str], bytes | None],
    ) -> bytes | None:
        """Poll the row until the entry is written (read it), the compile ended without one, the
        holder's heartbeat stopped (one waiter takes over), or the hedge is due."""
        started = time.monotonic()
        hedge_after: float | None = None
        while True:
            if seen is None or seen.mine:
                return None  # no lease to wait for (a reader), or ours: compile
            if seen.state == q.WRITTEN:
                data = read(key)
                if data is not None and gate.matches(data, seen.sha256):
                    return data
                if not self.writer:
                    return None
                seen = self._take(lessor, key, module, seen.sha256, read)  # stored bytes gone: ours
                continue
            if seen.state != q.COMPILING:
                return None  # unwritten: the holder's compile stored nothing; compile here
            if seen.left_s <= 0 or gone_here(seen.holder, self.host):  # the holder stopped
                if not self.writer:
                    return None
                if seen.left_s > 0:
                    lessor.release(key, seen.holder)  # gone from this host: no need to wait
                seen = self._take(lessor, key, module, None, read)
                continue
            if hedge_after is None:  # this key's own compile time bounds the wait, not its module's
                ms = seen.compile_ms if seen.compile_ms is not None else lessor.recorded_ms(key)
                took = ms / 1000.0 if ms is not None else None
                hedge_after = self.hedge_s if took is None else max(2.0 * took, took + 1.0)
            if seen.age_s > hedge_after and seen.hedger is None:
                if not self.writer:
                    return None
                if lessor.hedge(key, self.me):
                    self._hold(key, module, read, hedge=True)
                    return None
            waited = time.monotonic() - started
            if waited > self.max_s + self.ttl_s:
                return None  # a backstop past any heartbeat: never wait without end
            time.sleep(min(MAX_POLL_S, POLL_S + waited / 20.0))
            seen = lessor.look(key)
            if seen is None and self.writer:
                seen = self._take(lessor, key, module, None, read)

    def _hold(
        self,
        key: str,
        module: str | None,
        read: Callable[[str], bytes | None],
        *,
        hedge: bool,
    ) -> None:
        self._hook()
        with self._lock:
            self._held[key] = _Held(key, module, time.monotonic(), read, hedge)
            if not hedge and (self._beat is None or not self._beat.is_alive()):
                self._beat = threading.Thread(
                    target=self._heartbeat, name="cachectl-compile-lease", daemon=True
                )
                self._beat.start()
        self._local.key = key
        if getattr(self._local, "restore", None) is None:  # waiters read it, however fast
            self._local.restore = jax_seam.write_whatever_compile_time()

    def _hook(self) -> None:
        if not self._hooked:
            self._hooked = True
            jax_seam.on_compile_stage_end(self._compile_ended)
            atexit.register(self._release_all, os.getpid())

    def _release_all(self, pid: int) -> None:
        """At exit: end the leases this process still holds (a compile on a thread the exit cut
        short), so a waiter takes them over now rather than at their expiry."""
        if pid != os.getpid():
            return  # a forked child's exit: the leases are its parent's
        with self._lock:
            held = [h.key for h in self._held.values() if not h.hedge]
            self._held.clear()
        lessor = self._lessor
        for key in held:
            try:
                if lessor is not None:
                    lessor.release(key, self.me)
            except Exception:  # noqa: BLE001 - the lease expires on its own
                return

    def _finish(self, held: _Held, sha256: str | None) -> None:
        lessor = self._lessor
        if lessor is None or (held.hedge and sha256 is None):
            return  # a hedge that stored nothing leaves the holder's lease to the holder
        ms = int((time.monotonic() - held.started) * 1000)
        try:
            lessor.finish(held.key, self.me, sha256, ms)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            self._turn_off(exc)

    def _heartbeat(self) -> None:
        """Renew every held lease each ttl/3, each for at most max_s (a compile that never ends
        stops holding its lease: it expires a ttl later)."""
        while True:
            time.sleep(self.ttl_s / 3)
            now = time.monotonic()
            with self._lock:
                due = [h for h in self._held.values() if not h.hedge]
                for h in due:
                    if now - h.started > self.max_s:
                        self._held.pop(h.key, None)
                if not self._held:
                    self._beat = None
                    return
            lessor = self._lessor
            for h in due:
                if now - h.started > self.max_s or lessor is None:
                    continue
                try:
                    if not lessor.renew(h.key, self.me, self.ttl_s):
                        with self._lock:
                            self._held.pop(h.key, None)  # finished by a hedger, or taken over
                except Exception:  # noqa: BLE001 - an index hiccup: the next beat tries again
                    continue

    def _turn_off(self, exc: BaseException) -> None:
        if self._off:
            return
        self._off = True
        text = (getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}").splitlines()[0]
        self._warn(
            f"cachectl: compile lease off ({text[:300]}): this process compiles what it misses "
            "without waiting for other processes"
        )
