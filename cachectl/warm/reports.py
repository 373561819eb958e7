"""What warm and its coverage check report: frozen dataclasses whose JSON is what scripts read.

The JSON comes from :func:`cachectl.core.jsonable.to_jsonable`: a field marked
``_NOT_JSON`` stays out of it (kept for the CLI), one marked ``_MS`` is rounded to
the millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachectl.core.config import DEFAULT_WARM_EXECUTOR, WARM_EXECUTORS
from cachectl.core.jsonable import to_jsonable
from cachectl.core.records import Proof
from cachectl.warm.padding_check import PaddingReport

# Statuses of a bucket in a warm report.
COMPILED = "compiled"  # compiled and written (and indexed)
CACHED = "cached"  # already in the namespace: loaded, not compiled
FAILED = "failed"  # import, shape or compile error; or JAX did not write it
TOO_LARGE = "too-large"  # written, then removed: above the cache's max entry size
SKIPPED = "skipped"  # not attempted: --fail-fast stopped the run first
PLANNED = "planned"  # --dry-run
# Statuses of a bucket in a coverage check.
HIT = "hit"
MISS = "miss"

# What calling a bucket's stored executable once on zeros did, in a coverage check.
CALL_OK = "ok"
CALL_RAISED = "raised"
CALL_CRASHED = "crashed"  # the calling process died (a signal, an abort) or hung
CALL_SKIPPED = "not-called"  # no zero value for its arguments, or the calling process failed
CALL_FAILED = (CALL_RAISED, CALL_CRASHED)

EXECUTORS = WARM_EXECUTORS
DEFAULT_EXECUTOR = DEFAULT_WARM_EXECUTOR

_NOT_JSON: dict[str, Any] = {"json": False}
_MS: dict[str, Any] = {"round": 3}


@dataclass(frozen=True)
class BucketResult:
    """One bucket's outcome; the JSON report lists exactly these fields."""

    function: str
    bucket: dict[str, Any]
    status: str
    key: str | None = None
    compile_seconds: float | None = field(default=None, metadata=_MS)
    bytes: int | None = None
    error: str | None = None
    # The stored executable (cachectl/storage/executables.py): its size, or why there is none.
    aot_bytes: int | None = None
    aot_error: str | None = None
    # The user's frames of a failure, for -v; not in the JSON report.
    traceback: str | None = field(default=None, metadata=_NOT_JSON)
    lower_seconds: float | None = field(default=None, metadata=_NOT_JSON)  # in ``.lower()``
    # (file name, size, sha256) of what this run wrote for the bucket: what a signer may sign.
    written: tuple[tuple[str, int, str], ...] = field(default=(), metadata=_NOT_JSON)


@dataclass(frozen=True)
class WarmSummary:
    """Counts and times of a warm; ``parallel_efficiency`` says how well ``--jobs`` was used."""

    buckets: int
    compiled: int
    cached: int
    failed: int
    compile_seconds: float = field(metadata=_MS)
    wall_seconds: float = field(metadata=_MS)
    # Seconds in ``.lower()`` (tracing and lowering: Python, under the GIL) of every bucket.
    lower_seconds: float = field(default=0.0, metadata=_MS)
    # compile_seconds / (wall_seconds x jobs): 1.0 when every job compiled all the time.
    parallel_efficiency: float | None = field(default=None, metadata=_MS)
    # What compiled: ``jobs`` threads of this process or spawned processes (``executor``), and
    # how many buckets failed among threads and were run again alone, after the pool.
    executor: str = DEFAULT_EXECUTOR
    jobs: int = 1
    retried_alone: int = 0


@dataclass(frozen=True)
class WarmReport:
    """What `cachectl warm` did; :meth:`to_json` is the contract scripts read."""

    environment: dict[str, Any]
    namespace: str
    summary: WarmSummary
    buckets: list[BucketResult]
    # What the CLI prints besides the JSON report.
    cache: str = field(default="", metadata=_NOT_JSON)
    manifest: str = field(default="", metadata=_NOT_JSON)
    run_id: int | None = field(default=None, metadata=_NOT_JSON)
    jobs: int = field(default=1, metadata=_NOT_JSON)
    executor: str = field(default=DEFAULT_EXECUTOR, metadata=_NOT_JSON)
    dry_run: bool = field(default=False, metadata=_NOT_JSON)
    target_problems: list[str] = field(default_factory=list, metadata=_NOT_JSON)
    # Files other processes of a distributed warm compiled, which this one stored.
    peer_written: tuple[tuple[str, int, str], ...] = field(default=(), metadata=_NOT_JSON)
    # Programs JAX wrote during the run that are no bucket's (a function's eager operations while
    # tracing): indexed under this run, so verify knows their writer.
    side_programs: list[str] = field(default_factory=list)
    side_written: tuple[tuple[str, int, str], ...] = field(default=(), metadata=_NOT_JSON)

    @property
    def ok(self) -> bool:
        return self.summary.failed == 0 and not self.target_problems

    @property
    def written(self) -> list[tuple[str, int, str]]:
        """Every file this run wrote (name, size, sha256): what its signer signs."""
        return (
            [f for b in self.buckets for f in b.written]
            + list(self.peer_written)
            + list(self.side_written)
        )

    def to_json(self) -> dict[str, Any]:
        return to_jsonable(self)

    @property
    def executables(self) -> int:
        return sum(b.aot_bytes is not None for b in self.buckets)


@dataclass(frozen=True)
class CheckBucket:
    function: str
    bucket: dict[str, Any]
    status: str  # hit | miss | failed
    key: str | None = None
    seconds: float | None = field(default=None, metadata=_MS)
    error: str | None = None
    # The stored executable, loaded and called once on zeros in another fresh process (one
    # that never lowers, as a service): "loaded" when it ran, else why not.
    aot: str | None = None
    # What its call did: ok | raised | crashed | not-called; None: no executable loaded.
    aot_call: str | None = None
    # A stored executable is there for this bucket and a service will not use it (refused:
    # stored for another program or backend, unverified; or it failed to load): ``aot`` says why.
    aot_refused: bool = False
    # With --canary: "equal", "differs (...)" or "not run (why)" (cachectl.warm.canary); None:
    # no canary asked for.
    canary: str | None = None


@dataclass(frozen=True)
class CheckSummary:
    buckets: int
    hits: int
    misses: int
    failed: int
    coverage: float = field(metadata={"round": 2})
    aot_loaded: int
    # Percent of buckets whose stored executable loaded and ran on zeros.
    aot_coverage: float = field(metadata={"round": 2})
    aot_ran: int = 0
    aot_failed: int = 0  # loaded, then raised or crashed when called: marked unusable
    # With --canary: buckets whose outputs equal a fresh compile's here, and those that do not
    # (differ, or the canary could not run on an executable that ran on zeros).
    canary_equal: int = 0
    canary_failed: int = 0


@dataclass(frozen=True)
class CheckReport:
    """Coverage as a fresh, read-only service process sees it."""

    environment: dict[str, Any]
    namespace: str
    # Computed from ``buckets``; a field so that the JSON lists it before them.
    summary: CheckSummary = field(init=False)
    cache: str = field(metadata=_NOT_JSON)
    buckets: list[CheckBucket]
    warning: str | None = field(default=None, metadata=_NOT_JSON)
    # Nothing hit, and the cache holds another environment of this machine's JAX, backend and
    # devices (x64, CPU instruction set, XLA flags): what differs and its fix.
    closest: str | None = None
    # Stored executables whose verdict (unusable, or usable again) the index recorded, or why
    # it could not record them.
    marked: int = 0
    mark_error: str | None = None
    # What the index now keeps on the namespace's row (None: not recorded, see proof_error).
    proof: Proof | None = None
    proof_error: str | None = None
    # With --padding: each function's padded answers against jax.jit at the raw shapes.
    padding: PaddingReport | None = None

    def __post_init__(self) -> None:
        n, hits = len(self.buckets), sum(b.status == HIT for b in self.buckets)
        loaded = sum(b.aot_call is not None for b in self.buckets)
        ran = sum(b.aot_call == CALL_OK for b in self.buckets)
        object.__setattr__(
            self,
            "summary",
            CheckSummary(
                buckets=n,
                hits=hits,
                misses=sum(b.status == MISS for b in self.buckets),
                failed=sum(b.status == FAILED for b in self.buckets),
                coverage=100.0 * hits / n if n else 100.0,
                aot_loaded=loaded,
                aot_coverage=100.0 * ran / n if n else 100.0,
                aot_ran=ran,
                aot_failed=len(self.unusable),
                canary_equal=sum(b.canary == "equal" for b in self.buckets),
                canary_failed=len(self.canary_failed),
            ),
        )

    @property
    def unusable(self) -> list[CheckBucket]:
        """Buckets whose stored executable raised or crashed when called."""
        return [b for b in self.buckets if b.aot_call in CALL_FAILED]

    @property
    def canary_failed(self) -> list[CheckBucket]:
        """Buckets whose stored executable ran but whose canary did not find equal outputs."""
        return [
            b
            for b in self.buckets
            if b.canary is not None and b.canary != "equal" and b.aot_call == CALL_OK
        ]

    @property
    def refused(self) -> list[CheckBucket]:
        """Buckets that hit whose stored executable a service will not use (``aot`` says why):
        serving would trace them through jax.jit although warm stored them."""
        return [b for b in self.buckets if b.aot_refused and b.status == HIT]

    @property
    def not_called(self) -> list[CheckBucket]:
        """Buckets whose stored executable loaded but was not called: not proven to run."""
        return [b for b in self.buckets if b.aot_call == CALL_SKIPPED]

    @property
    def hits(self) -> int:
        return self.summary.hits

    @property
    def coverage(self) -> float:
        """Percent of buckets that hit; an empty manifest shard is fully covered."""
        return self.summary.coverage

    @property
    def ok(self) -> bool:
        return (
            self.hits == len(self.buckets)
            and not self.unusable
            and not self.refused
            and not self.not_called
            and not self.canary_failed
            and (self.padding is None or self.padding.ok)
        )

    @property
    def aot_loaded(self) -> int:
        return self.summary.aot_loaded

    @property
    def aot_coverage(self) -> float:
        return self.summary.aot_coverage

    def to_json(self) -> dict[str, Any]:
        return to_jsonable(self)
