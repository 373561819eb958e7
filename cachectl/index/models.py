"""SQLAlchemy 2 models of the index: the schema Alembic migrations create.

Every fingerprint field is its own column so prune and doctor can query them;
entries are indexed for the queries prune and gc run (by environment and
time, by function).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from cachectl.core.records import utcnow  # re-exported: the rows and the records share one clock


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on every backend (SQLite keeps no zone of its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    if TYPE_CHECKING:
        # Each model here maps one Table (DeclarativeBase says FromClause, which covers joins).
        __table__: ClassVar[Table]


class Cache(Base):
    __tablename__ = "caches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    root_url: Mapped[str] = mapped_column(Text)
    max_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_entry_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    env_max_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    retention_seconds: Mapped[int | None] = mapped_column(BigInteger)
    keep_versions: Mapped[int | None] = mapped_column(Integer)
    writers: Mapped[list[str]] = mapped_column(JSON, default=list)
    service_writes: Mapped[str | None] = mapped_column(String(8))
    group_name: Mapped[str | None] = mapped_column(String(64))
    storage_options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Ed25519 public keys ("ed25519:<base64>") whose signatures readers accept (cachectl/trust/signing.py).
    trusted_keys: Mapped[list[str] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    environments: Mapped[list[Environment]] = relationship(back_populates="cache")


class Environment(Base):
    __tablename__ = "environments"
    __table_args__ = (UniqueConstraint("cache_id", "digest", name="uq_environments_cache_digest"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"), index=True)
    digest: Mapped[str] = mapped_column(String(64))
    namespace: Mapped[str] = mapped_column(Text)
    jax_version: Mapped[str] = mapped_column(String(64))
    jaxlib_version: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(32))
    platform_version: Mapped[str] = mapped_column(Text)
    device_kind: Mapped[str] = mapped_column(String(128))
    device_count: Mapped[int] = mapped_column(Integer)
    process_count: Mapped[int] = mapped_column(Integer)
    topology: Mapped[str] = mapped_column(String(256))
    xla_flags: Mapped[list[str]] = mapped_column(JSON, default=list)
    compression: Mapped[str] = mapped_column(String(32))
    enable_xla_caches: Mapped[str] = mapped_column(String(256))
    include_metadata_in_key: Mapped[bool] = mapped_column(Boolean)
    enable_x64: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    cpu_isa: Mapped[str] = mapped_column(String(128), default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The namespace's content list as last signed: {"content": ..., "key": ..., "signature": ...}.
    content_signature: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The last warm-check on a machine of this fingerprint (cachectl.core.records.Proof.to_row).
    proof: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    cache: Mapped[Cache] = relationship(back_populates="environments")


class Entry(Base):
    __tablename__ = "entries"
    __table_args__ = (
        UniqueConstraint("environment_id", "key", name="uq_entries_env_key"),
        Index("ix_entries_env_last_access", "environment_id", "last_access_at"),
        Index("ix_entries_env_created", "environment_id", "created_at"),
        Index("ix_entries_created", "created_at"),
        Index("ix_entries_function", "function"),
        Index("ix_entries_warm_run", "warm_run_id"),
        # Covers what planning reads of every row (migrations 0007, 0008): the per-environment
        # totals (entry + executable bytes) every plan starts from, gc's cost score, its sample
        # and its cut's rows (the key too); those scans never read the table.
        # ``id`` last: PostgreSQL's indexes do not hold the row id by themselves, as SQLite's do.
        Index(
            "ix_entries_env_plan",
            "environment_id",
            "size_bytes",
            "aot_size_bytes",
            "compile_time_ms",
            "last_access_at",
            "created_at",
            "warm_run_id",
            "key",
            "id",
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(512))
    module: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    compile_time_ms: Mapped[int | None] = mapped_column(BigInteger)
    origin: Mapped[str] = mapped_column(String(16))
    function: Mapped[str | None] = mapped_column(String(256))
    bucket: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    warm_run_id: Mapped[int | None] = mapped_column(ForeignKey("warm_runs.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_access_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    hit_count: Mapped[int] = mapped_column(BigInteger, default=0)
    # The stored executable (``<key>-aot``) beside the JAX entry: one unit for gc and prune.
    aot_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    aot_sha256: Mapped[str | None] = mapped_column(String(64))
    # Why warm-check found the stored executable unusable (it raised or crashed when called on
    # dummy inputs); a service then serves that bucket through jax.jit. None: usable or unchecked.
    aot_unusable: Mapped[str | None] = mapped_column(Text)


# "Last used" (last access, else creation): what --unused-for filters on and gc's lru order
# is. Indexed as an expression (migration 0007) so gc walks entries in eviction order and
# stops once it has enough, instead of sorting every row; ``id`` breaks ties.
def last_used() -> Any:
    """``coalesce(last_access_at, created_at)``, spelled exactly as the indexes are."""
    return func.coalesce(Entry.last_access_at, Entry.created_at)


Index("ix_entries_last_used", last_used(), Entry.id)
Index("ix_entries_env_last_used", Entry.environment_id, last_used(), Entry.id)


class WarmRun(Base):
    __tablename__ = "warm_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    environment_id: Mapped[int] = mapped_column(
        ForeignKey("environments.id", ondelete="CASCADE"), index=True
    )
    manifest_digest: Mapped[str] = mapped_column(String(64))
    manifest_path: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str] = mapped_column(String(256))
    user: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    buckets: Mapped[int] = mapped_column(Integer, default=0)
    compiled: Mapped[int] = mapped_column(Integer, default=0)
    cached: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)


class AuditRecord(Base):
    """Append-only: who did what to which cache, with counts and bytes."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(256))
    operation: Mapped[str] = mapped_column(String(64))
    cache_name: Mapped[str | None] = mapped_column(String(128), index=True)
    entries: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    duration_ms: Mapped[int | None] = mapped_column(BigInteger)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Lease(Base):
    """A named lock with expiry, so a crashed holder never blocks forever."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class CompileLease(Base):
    """One program's compile across a fleet (cachectl/index/compile_leases.py): who compiles it,
    until when (a heartbeat pushes ``expires_at``), and what was written (migration 0013)."""

    __tablename__ = "compile_leases"
    __table_args__ = (
        Index("ix_compile_leases_module", "scope", "module"),
        Index("ix_compile_leases_expires", "expires_at"),
    )

    scope: Mapped[str] = mapped_column(String(256), primary_key=True)  # cache/environment digest
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))  # compiling | written | unwritten
    module: Mapped[str | None] = mapped_column(String(512))
    hedger: Mapped[str | None] = mapped_column(String(256))
    sha256: Mapped[str | None] = mapped_column(String(64))
    compile_ms: Mapped[int | None] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class TelemetryRecord(Base):
    """One flush of one process's counters for one environment."""

    __tablename__ = "telemetry"
    __table_args__ = (Index("ix_telemetry_env_at", "environment_id", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    process: Mapped[str] = mapped_column(String(256))
    function: Mapped[str | None] = mapped_column(String(512))
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    misses: Mapped[int] = mapped_column(BigInteger, default=0)
    writes: Mapped[int] = mapped_column(BigInteger, default=0)
    saved_seconds: Mapped[float] = mapped_column(default=0.0)
    dropped: Mapped[int] = mapped_column(BigInteger, default=0)
    # requests for not-cacheable programs: JAX-internal staging (jit_stage, ...), apart from
    # hits and misses (rows before migration 0009 counted fast-compiled misses here)
    uncacheable: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # stored executables cachectl.serving loaded: uses of an entry, never requests or hits
    loads: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # the service's compile stage for its misses and for its hits, seconds ("saved" estimate)
    miss_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    hit_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")


class ServingRecord(Base):
    """One flush of one process's cachectl.serving counters for one function."""

    __tablename__ = "serving_telemetry"
    __table_args__ = (Index("ix_serving_telemetry_env_at", "environment_id", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    process: Mapped[str] = mapped_column(String(256))
    function: Mapped[str] = mapped_column(String(256))
    calls: Mapped[int] = mapped_column(BigInteger, default=0)
    aot: Mapped[int] = mapped_column(BigInteger, default=0)
    fallback: Mapped[int] = mapped_column(BigInteger, default=0)
    out_of_bucket: Mapped[int] = mapped_column(BigInteger, default=0)
    padded: Mapped[int] = mapped_column(BigInteger, default=0)
    # {axis: {raw size: calls}}: the request sizes before padding.
    sizes: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class SignatureRecord(Base):
    """One program signature a service compiled (one row per environment, function and
    signature, counters added on each flush; bounded per function, overflow in digest '*')."""

    __tablename__ = "signatures"
    __table_args__ = (
        Index("ix_signatures_env_fn_digest", "environment_id", "function", "digest"),
        Index("ix_signatures_env_last", "environment_id", "last_seen"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id", ondelete="CASCADE"))
    function: Mapped[str] = mapped_column(String(512))
    digest: Mapped[str] = mapped_column(String(64))
    key: Mapped[str | None] = mapped_column(String(512))
    # [[shape, dtype, weak_type, sharding or null], ...] per flat input
    leaves: Mapped[list[Any]] = mapped_column(JSON, default=list)
    source: Mapped[str | None] = mapped_column(String(512))  # "f at model.py:12"
    statics: Mapped[list[Any] | None] = mapped_column(JSON)  # [[argnum or argname, repr], ...]
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    misses: Mapped[int] = mapped_column(BigInteger, default=0)
    uncacheable: Mapped[int] = mapped_column(BigInteger, default=0)
    repeats: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Token(Base):
    __tablename__ = "tokens"
    # A name is unique among the tokens not revoked: a revoked token's row (and the audit rows
    # that name it) stays, and its name can be given to a new token (migration 0014).
    __table_args__ = (
        Index(
            "ix_tokens_active_name",
            "name",
            unique=True,
            sqlite_where=text("revoked_at IS NULL"),
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    caches: Mapped[list[str] | None] = mapped_column(JSON)
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    cache_name: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
