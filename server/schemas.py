"""Request bodies: pydantic models that refuse unknown fields (422), with bounds on everything."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import FINGERPRINT_VERSION, Environment, check_version
from cachectl.storage.entries import MAX_KEY_LENGTH
from cachectl.telemetry import (
    MAX_FLUSH_COUNT,
    MAX_FLUSH_SECONDS,
    MAX_SERVING_AXES,
    MAX_SERVING_SIZES,
)

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
Hex64 = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=2**53)]
# A counter one process reports for one flush interval (cachectl.telemetry.check_batch).
FlushCount = Annotated[int, Field(ge=0, le=MAX_FLUSH_COUNT)]
Short = Annotated[str, Field(max_length=256)]


class Strict(BaseModel):
    # No NaN or Infinity in a float field (the body check at the edge, limits.json_problem, already
    # refuses their JSON tokens): neither can be written back as JSON.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Fingerprint(Strict):
    """An Environment as `cachectl fingerprint --json` prints it (digest/namespace optional, checked)."""

    jax_version: Annotated[str, Field(min_length=1, max_length=64)]
    jaxlib_version: Annotated[str, Field(min_length=1, max_length=64)]
    backend: Annotated[str, Field(min_length=1, max_length=32)]
    platform_version: Annotated[str, Field(max_length=1024)]
    device_kind: Annotated[str, Field(min_length=1, max_length=128)]
    device_count: Annotated[int, Field(ge=1, le=1_000_000)]
    process_count: Annotated[int, Field(ge=1, le=1_000_000)]
    topology: Annotated[str, Field(max_length=256)]
    xla_flags: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=256)]
    compression: Literal["zstandard", "zlib"]
    enable_xla_caches: Annotated[str, Field(max_length=256)]
    include_metadata_in_key: bool
    enable_x64: bool = False
    cpu_isa: Annotated[str, Field(max_length=128)] = ""
    digest: Hex64 | None = None
    namespace: Annotated[str, Field(max_length=512)] | None = None
    fingerprint_version: Literal[1] | None = None

    def environment(self) -> Environment:
        data = self.model_dump(exclude={"digest", "namespace", "fingerprint_version"})
        return Environment.from_dict(data)

    @field_validator("jax_version", "jaxlib_version")
    @classmethod
    def _a_version(cls, value: str, info: Any) -> str:
        try:
            check_version(info.field_name, value)
        except BadInput as exc:
            raise ValueError(exc.message) from None
        return value


assert FINGERPRINT_VERSION == 1  # bump the Literal above with the fingerprint format


class ResolveRequest(Fingerprint):
    """The fingerprint, plus whether a writer wants the environment created (default yes)."""

    create: bool = True


class FunctionCountsIn(Strict):
    function: Annotated[str, Field(max_length=512)] | None = None
    requests: FlushCount = 0
    hits: FlushCount = 0
    writes: FlushCount = 0
    # JAX's "compile time saved" is negative when reading the entry took longer than compiling.
    saved_seconds: Annotated[float, Field(ge=-MAX_FLUSH_SECONDS, le=MAX_FLUSH_SECONDS)] = 0.0
    retrieval_seconds: Annotated[float, Field(ge=0, le=MAX_FLUSH_SECONDS)] = 0.0
    uncacheable: FlushCount = 0  # requests for not-cacheable (JAX-internal staging) programs
    loads: FlushCount = 0  # stored executables cachectl.serving loaded
    miss_seconds: Annotated[float, Field(ge=0, le=MAX_FLUSH_SECONDS)] = 0.0
    hit_seconds: Annotated[float, Field(ge=0, le=MAX_FLUSH_SECONDS)] = 0.0


class HitKeyIn(Strict):
    key: Annotated[str, Field(min_length=1, max_length=512)]
    count: Annotated[int, Field(ge=1, le=MAX_FLUSH_COUNT)]
    at: AwareDatetime  # a claim: the index clamps it to [the entry's creation, now]


class ServingCountsIn(Strict):
    """cachectl.serving's counters of one function in one flush, with the raw sizes per axis."""

    function: Annotated[str, Field(min_length=1, max_length=256)]
    calls: FlushCount = 0
    aot: FlushCount = 0
    fallback: FlushCount = 0
    out_of_bucket: FlushCount = 0
    padded: FlushCount = 0
    sizes: Annotated[
        dict[
            Annotated[str, Field(max_length=64)],
            Annotated[
                dict[Annotated[str, Field(max_length=12, pattern=r"^[0-9]+$")], FlushCount],
                Field(max_length=MAX_SERVING_SIZES),
            ],
        ],
        Field(max_length=MAX_SERVING_AXES),
    ] = {}


class SignatureIn(Strict):
    """One program signature's counts in one flush (cachectl.telemetry.SignatureCounts)."""

    function: Annotated[str, Field(min_length=1, max_length=512)]
    key: Annotated[str, Field(max_length=512)] | None = None
    source: Annotated[str, Field(max_length=1024)] | None = None
    # (shape, dtype, weak_type, sharding) per flat input
    leaves: Annotated[
        list[
            tuple[
                Annotated[list[Annotated[int, Field(ge=0, le=2**40)]], Field(max_length=64)],
                Annotated[str, Field(max_length=64)],
                bool,
                Annotated[str, Field(max_length=512)] | None,
            ]
        ],
        Field(max_length=10_000),
    ] = []
    statics: (
        Annotated[
            list[
                tuple[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=1024)]]
            ],
            Field(max_length=64),
        ]
        | None
    ) = None
    requests: FlushCount = 0
    hits: FlushCount = 0
    misses: FlushCount = 0
    uncacheable: FlushCount = 0
    repeats: FlushCount = 0
    first_seen: Annotated[float, Field(ge=0, le=1e11)] = 0.0
    last_seen: Annotated[float, Field(ge=0, le=1e11)] = 0.0


class TelemetryBatchIn(Strict):
    """One flush of one process (cachectl.telemetry.TelemetryBatch on the wire)."""

    process: Annotated[str, Field(min_length=1, max_length=256)]
    cache: Name
    environment_digest: Hex64
    # With a UTC offset: a naive time cannot be compared with the index's (it was a 500).
    started_at: AwareDatetime
    ended_at: AwareDatetime
    functions: Annotated[list[FunctionCountsIn], Field(max_length=10_000)] = []
    hit_keys: Annotated[list[HitKeyIn], Field(max_length=20_000)] = []
    dropped: FlushCount = 0
    serving: Annotated[list[ServingCountsIn], Field(max_length=1_000)] = []
    signatures: Annotated[list[SignatureIn], Field(max_length=1_024)] = []
    signatures_dropped: FlushCount = 0


class TelemetryIn(Strict):
    batches: Annotated[list[TelemetryBatchIn], Field(min_length=1, max_length=100)]


class CompileLeaseIn(Strict):
    """One compile-lease call (cachectl/index/compile_leases.py): which fields an action reads.
    Writes (take, renew, hedge, finish, release) and reads (look, recorded) have a route each."""

    action: Literal["take", "renew", "hedge", "finish", "release", "look", "recorded"]
    key: Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH)] | None = None
    # The caller's tag: the server names the holder ``token<id>|<tag>`` (server/lease_routes.py).
    holder: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Above 3600: 422; above the server's lease_max_ttl_s: granted that maximum.
    ttl_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    module: Annotated[str, Field(max_length=512)] | None = None
    stale: Annotated[str, Field(max_length=64)] | None = None
    sha256: Annotated[str, Field(min_length=64, max_length=64)] | None = None
    compile_ms: Annotated[int, Field(ge=0, le=2**53)] | None = None


class AuditIn(Strict):
    operation: Annotated[str, Field(min_length=1, max_length=64)]
    actor: Annotated[str, Field(max_length=256)] | None = None
    entries: Count = 0
    bytes: Count = 0
    duration_ms: Count | None = None
    details: Annotated[dict[Annotated[str, Field(max_length=64)], Any], Field(max_length=50)] = {}


class PruneParams(Strict):
    """`cachectl prune` selectors (AND); none = the cache's retention."""

    older_than: Annotated[str, Field(max_length=16)] | None = None
    unused_for: Annotated[str, Field(max_length=16)] | None = None
    jax_version: Annotated[str, Field(max_length=64)] | None = None
    superseded: bool = False
    keep: Annotated[int, Field(ge=1, le=1000)] | None = None
    env: Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]+$")] | None = None
    function: Annotated[str, Field(max_length=256)] | None = None
    dry_run: bool = False


class GcParams(Strict):
    policy: Literal["lru", "cost"] = "lru"
    max_size: int | Annotated[str, Field(max_length=32)] | None = None
    protect_warm: bool = False
    dry_run: bool = False


class VerifyParams(Strict):
    env: Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]+$")] | None = None
    quarantine: bool = False
    repair: bool = False
    # Unknown files younger than this are not quarantined (a writer may be about to index them).
    min_age: Annotated[str, Field(max_length=16)] | None = None
    dry_run: bool = False


SizeValue = int | Annotated[str, Field(max_length=32)]


class PolicyUpdate(Strict):
    """Cache policy an admin may change; sizes as bytes or '50GiB', durations as seconds or '30d'."""

    max_size: SizeValue | None = None
    max_entry_size: SizeValue | None = None
    env_max_size: SizeValue | None = None
    retention: SizeValue | None = None
    keep_versions: Annotated[int, Field(ge=1, le=1000)] | None = None
    service_writes: Literal["allow", "deny"] | None = None


class TokenCreate(Strict):
    name: Name
    role: Literal["reader", "writer", "admin"]
    caches: Annotated[list[Name], Field(max_length=100)] | None = None
    expires: Annotated[str, Field(max_length=32)] | None = None


class EntryIn(Strict):
    """An entry a writer stored itself (e.g. warm into a bucket it may write), to be recorded."""

    key: Annotated[str, Field(min_length=66, max_length=MAX_KEY_LENGTH)]
    size: Annotated[int, Field(ge=0, le=2**50)]
    sha256: Hex64
    origin: Literal["warm", "observed", "upload", "import"] = "warm"
    compile_time_ms: Annotated[int, Field(ge=0, le=2**40)] | None = None
    function: Annotated[str, Field(max_length=256)] | None = None
    bucket: dict[Annotated[str, Field(max_length=128)], Any] | None = None
    # Its stored executable (<key>-aot), when the writer stored one beside it.
    aot_size: Annotated[int, Field(ge=0, le=2**50)] | None = None
    aot_sha256: Hex64 | None = None

    @field_validator("bucket")
    @classmethod
    def _small_bucket(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(value) > 64:
            raise ValueError("at most 64 bucket fields")
        return value


class EntryRegistration(Strict):
    entries: Annotated[list[EntryIn], Field(min_length=1, max_length=10_000)]
    warm_run_id: Annotated[int, Field(ge=1, le=2**31)] | None = None


class WarmRunStart(Strict):
    manifest_digest: Annotated[str, Field(min_length=1, max_length=64)]
    manifest_path: Annotated[str, Field(max_length=1024)] | None = None
    buckets: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    # Where the warm runs (lifecycle names it while the run protects its environment).
    host: Annotated[str, Field(max_length=256)] | None = None
    user: Annotated[str, Field(max_length=128)] | None = None


class WarmRunUpdate(Strict):
    """A heartbeat (no status) or the final report (status set)."""

    status: Literal["succeeded", "failed", "interrupted"] | None = None
    compiled: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    cached: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    failed: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
