"""Typed, session-free views of index rows: what the library returns."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cachectl.core.cache_info import CacheInfo, utcnow  # noqa: F401 - re-exported
from cachectl.core.config import TOKEN_ROLES as ROLES
from cachectl.core.errors import BadInput, NotFound
from cachectl.core.fingerprint import Environment


@dataclass(frozen=True)
class Proof:
    """What the last ``warm-check`` of a namespace found on the machine it ran on.

    Kept on the namespace's index row (``environments.proof``): ``ls`` and ``stats`` show it. A
    namespace is proven when every bucket hit, every stored executable ran, and the canary (the
    same inputs through a fresh on-machine compile) gave equal outputs for every one.
    """

    at: datetime
    # The running machine: its fingerprint digest, devices ("cpu x1") and host name.
    machine_digest: str
    devices: str
    host: str
    buckets: int
    hits: int
    executables_called: int
    # "equal", "differs in N of M", or "not run (why)".
    canary: str
    # The manifest checked (its path), and how many of the namespace's entries this check proved
    # (distinct keys that hit, ran and, with --canary, gave a compile's outputs): a namespace is
    # proven only by checks that cover its every entry (``EnvironmentInfo.proven``), never by one
    # manifest's check of part of it. None: a proof recorded before either was kept.
    manifest: str | None = None
    entries_proven: int | None = None

    __json_extra__ = ("proven",)

    @property
    def proven(self) -> bool:
        return (
            self.buckets > 0
            and self.hits == self.buckets
            and self.executables_called == self.buckets
            and self.canary == "equal"
        )

    def to_row(self) -> dict[str, Any]:
        """The JSON the index stores (times as ISO 8601)."""
        return {
            "at": self.at.isoformat(),
            "machine_digest": self.machine_digest,
            "devices": self.devices,
            "host": self.host,
            "buckets": self.buckets,
            "hits": self.hits,
            "executables_called": self.executables_called,
            "canary": self.canary,
            "manifest": self.manifest,
            "entries_proven": self.entries_proven,
        }

    @classmethod
    def from_row(cls, data: dict[str, Any] | None) -> Proof | None:
        """The stored JSON back; None for a namespace never checked (or a row it cannot read)."""
        if not data:
            return None
        try:
            return cls(
                at=datetime.fromisoformat(data["at"]),
                machine_digest=str(data["machine_digest"]),
                devices=str(data["devices"]),
                host=str(data["host"]),
                buckets=int(data["buckets"]),
                hits=int(data["hits"]),
                executables_called=int(data["executables_called"]),
                canary=str(data["canary"]),
                manifest=None if data.get("manifest") is None else str(data["manifest"]),
                entries_proven=(
                    None if data.get("entries_proven") is None else int(data["entries_proven"])
                ),
            )
        except (KeyError, TypeError, ValueError):
            return None


def proofs_from_row(data: Any) -> dict[str, Any]:
    """``EnvironmentInfo``'s ``proof`` (the latest check) and ``proofs`` (the latest of each
    manifest) from the stored JSON: ``{"manifests": [row, ...]}``, or one row as kept before."""
    rows = data.get("manifests") if isinstance(data, dict) and "manifests" in data else [data]
    proofs = tuple(p for p in map(Proof.from_row, rows or []) if p is not None)
    latest = max(proofs, key=lambda p: p.at) if proofs else None
    return {"proof": latest, "proofs": proofs}


def proofs_to_row(stored: Any, proof: Proof) -> dict[str, Any]:
    """The stored JSON with ``proof`` recorded: it replaces the last check of its own manifest
    only, so another manifest's check of part of a namespace never replaces (or stands for) this."""
    kept = [p for p in proofs_from_row(stored)["proofs"] if p.manifest != proof.manifest]
    return {"manifests": [p.to_row() for p in (*kept, proof)]}


@dataclass(frozen=True)
class EnvironmentInfo:
    id: int
    cache: str
    digest: str
    namespace: str
    environment: Environment
    created_at: datetime | None
    last_seen_at: datetime | None
    deleted_at: datetime | None
    entries: int = 0
    # Entries and their stored executables together: what size limits and gc count.
    bytes: int = 0
    last_access_at: datetime | None = None
    # Entries with a stored executable (``<key>-aot``), and those executables' bytes (within ``bytes``).
    executables: int = 0
    aot_bytes: int = 0
    # The last warm-check on a machine of this fingerprint (None: never checked), and the last
    # of each manifest checked.
    proof: Proof | None = None
    proofs: tuple[Proof, ...] = ()

    __json_extra__ = ("proven",)

    @property
    def proven(self) -> bool:
        """Proven: a check proved every entry the namespace holds now, not part of them."""
        return self.entries > 0 and any(
            p.proven and p.entries_proven is not None and p.entries_proven >= self.entries
            for p in self.proofs
        )


@dataclass(frozen=True)
class EntryInfo:
    key: str
    module: str
    size: int
    sha256: str
    compile_time_ms: int | None
    origin: str
    function: str | None
    bucket: dict[str, Any] | None
    created_at: datetime | None
    last_access_at: datetime | None
    hit_count: int
    environment_id: int
    aot_size: int | None = None
    aot_sha256: str | None = None
    # Why warm-check marked the stored executable unusable (serving uses jax.jit); None: usable.
    aot_unusable: str | None = None


@dataclass(frozen=True)
class NewEntry:
    """What a writer knows about an entry it just stored or found."""

    key: str
    module: str
    size: int
    sha256: str
    origin: str
    compile_time_ms: int | None = None
    function: str | None = None
    bucket: dict[str, Any] | None = None
    warm_run_id: int | None = None
    created_at: datetime | None = None
    # The stored executable beside the entry, when the writer stored one.
    aot_size: int | None = None
    aot_sha256: str | None = None


@dataclass(frozen=True)
class HeldEntry:
    """What an environment's row holds for one key: the entry's size and sha256, and its stored
    executable's (None: it has none). What an install compares a bundle's entries with."""

    size: int
    sha256: str
    aot_size: int | None = None
    aot_sha256: str | None = None


@dataclass(frozen=True)
class AuditInfo:
    at: datetime
    actor: str
    operation: str
    cache: str | None
    entries: int
    bytes: int
    duration_ms: int | None
    details: dict[str, Any]


def actor() -> str:
    """user@host, as the audit log records who acted."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def pick_environment(
    cache: str, prefix: str, environments: Callable[[str], Iterable[EnvironmentInfo]]
) -> EnvironmentInfo:
    """The one environment whose digest starts with ``prefix``; unknown or ambiguous prefixes are
    bad input. ``environments(prefix)`` lists candidates, given the checked prefix (lower-case
    hex) to narrow them by; any it lists that do not start with it are left out here."""
    prefix = prefix.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise BadInput(
            f"bad environment digest prefix {prefix!r}: use hex digits from `cachectl ls`"
        )
    matches = [e for e in environments(prefix) if e.digest.startswith(prefix)]
    if not matches:
        raise NotFound(
            f"no environment in cache {cache!r} has a digest starting {prefix!r}: see `cachectl ls`"
        )
    if len(matches) > 1:
        names = ", ".join(m.digest[:16] for m in matches[:5])
        raise BadInput(
            f"environment prefix {prefix!r} matches {len(matches)} environments ({names}): give more digits"
        )
    return matches[0]


ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}


@dataclass(frozen=True)
class TokenInfo:
    """A token as listed: everything except the secret, which is never kept."""

    id: int
    name: str
    role: str
    caches: tuple[str, ...] | None
    created_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > utcnow())

    def allows(self, role: str, cache: str | None = None) -> bool:
        """Role at least ``role``, and ``cache`` inside the token's scope (if scoped)."""
        if ROLE_RANK[self.role] < ROLE_RANK[role]:
            return False
        return cache is None or self.caches is None or cache in self.caches


@dataclass(frozen=True)
class CreatedToken:
    info: TokenInfo
    token: str


@dataclass(frozen=True)
class NewToken:
    """A token row about to be written, checked by cachectl.trust.token_rules (``new_token``):
    either driver stores it as it is. ``secret`` is returned once and never stored."""

    name: str
    role: str
    caches: list[str] | None
    token_hash: str
    created_at: datetime
    expires_at: datetime | None
    secret: str

    def info(self, token_id: int) -> TokenInfo:
        """The stored row as listed."""
        caches = tuple(self.caches) if self.caches is not None else None
        return TokenInfo(
            token_id, self.name, self.role, caches, self.created_at, self.expires_at, None, None
        )


@dataclass(frozen=True)
class WarmRunInfo:
    """One warm run as the index recorded it."""

    id: int
    environment_id: int
    manifest_digest: str
    manifest_path: str | None
    host: str
    user: str
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    buckets: int
    compiled: int
    cached: int
    failed: int
