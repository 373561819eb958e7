"""What a `cachectl verify` reports and how it runs: kinds of finding, the actions execution
takes about them, the run's options, and the plan and result records (``lifecycle/verify.py``
describes the command).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

from cachectl.index.plan_reads import WARM_HEARTBEAT_WINDOW
from cachectl.storage.entries import EXECUTABLE_SUFFIX

# Kinds of finding, and what --quarantine / --repair does about each.
MISSING = "missing"  # index row, no file: row dropped (repair)
CORRUPT = "corrupt"  # does not decompress / header insane: quarantined
MISMATCH = "mismatch"  # decompresses, but size or sha256 differ from the index: quarantined
UNKNOWN = "unknown-writer"  # a file in a namespace the index does not know: quarantined
ORPHAN_ATIME = "orphan-atime"  # -atime without -cache: deleted (repair)
MISSING_ATIME = "missing-atime"  # -cache without -atime where JAX eviction is on: written (repair)
BAD_ENV = "bad-env-json"  # env.json unreadable or for another environment: reported
UNINDEXED_NAMESPACE = "unindexed-namespace"  # a whole namespace the index lacks: `cachectl sync`
MISSING_NAMESPACE = "missing-namespace"  # an indexed namespace with no files: `cachectl sync`
ORPHAN_AOT = "orphan-aot"  # -aot without its -cache: quarantined
XLA_SUBCACHE = "xla-subcache"  # an XLA sub-cache directory: keys become path-dependent; reported
STRAY = "stray-file"  # a file in the root outside every namespace: reported
SERVICE_WRITE = "service-write"  # a service wrote an entry although the cache denies service writes
NOT_LOADABLE = "not-loadable"  # --deep: the header is fine but JAX cannot load the executable
# The records the gate trusts (trust/gate.py) disagree so that it refuses a file: an index row that
# no list a trusted key signed vouches for (another sha256, or not listed): reported.
RECORDS_DISAGREE = "records-disagree"
# A dead writer's .tmp-* file or bundle staging directory (lifecycle/sweep.py): deleted (repair).
# One whose writer may still be writing is not a finding.
STALE_TEMP = "stale-temp"

QUARANTINE, DROP_ROW, DELETE_ATIME, WRITE_ATIME = (
    "quarantine",
    "drop-row",
    "delete-atime",
    "write-atime",
)
DELETE_TEMP = "delete-temp"  # a stale-temp file or directory is removed (repair), re-checked first
CLEAR_AOT = "clear-executable"  # an indexed -aot is gone: its entry's executable columns are cleared (repair)
# An unknown file younger than this may be a writer's between its storage
# write and its index row: reported, not quarantined (verify --min-age).
RECENT_GRACE = WARM_HEARTBEAT_WINDOW


class Fix(Enum):
    """What a verify may change: nothing; JAX's sidecars, debris and index rows (repair); or
    also move bad files into quarantine (which repairs too)."""

    NONE = "none"
    REPAIR = "repair"
    QUARANTINE = "quarantine"


@dataclass(frozen=True)
class VerifyOptions:
    """How one verify runs: the CLI's and the jobs API's flags, mapped once (``from_flags``)."""

    fix: Fix = Fix.NONE
    dry_run: bool = False
    deep: bool = False  # also load this machine's entries in a subprocess
    env_prefix: str | None = None
    min_age: timedelta = RECENT_GRACE

    @classmethod
    def from_flags(
        cls,
        *,
        quarantine: bool = False,
        repair: bool = False,
        dry_run: bool = False,
        deep: bool = False,
        env_prefix: str | None = None,
        min_age: timedelta = RECENT_GRACE,
    ) -> VerifyOptions:
        """The flags as `cachectl verify` takes them: --quarantine implies --repair."""
        fix = Fix.QUARANTINE if quarantine else Fix.REPAIR if repair else Fix.NONE
        return cls(fix, dry_run, deep, env_prefix, min_age)

    @property
    def quarantine(self) -> bool:
        return self.fix is Fix.QUARANTINE

    @property
    def repair(self) -> bool:
        return self.fix is not Fix.NONE

    @property
    def mutating(self) -> bool:
        """Whether this run changes storage or the index (under the lifecycle lease)."""
        return self.repair and not self.dry_run

    def action(self, action: str) -> str:
        """``action`` if these options allow it (quarantine, or any repair), else "" (reported only)."""
        return action if (self.quarantine if action == QUARANTINE else self.repair) else ""


@dataclass(frozen=True, slots=True)
class VerifyFinding:
    kind: str
    namespace: str
    path: str  # relative to the cache root
    detail: str
    action: str = ""  # what execution does about it ("" = nothing)
    environment_id: int | None = None
    key: str | None = None


@dataclass
class VerifyPlan:
    cache: str
    root: str
    entries_checked: int = 0
    executables_checked: int = 0
    bytes_read: int = 0
    files_listed: int = 0
    namespaces: int = 0
    findings: list[VerifyFinding] = field(default_factory=list)
    quarantine_dir: str | None = None

    __json_extra__ = ("counts",)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.findings))


@dataclass(frozen=True)
class VerifyResult:
    plan: VerifyPlan
    quarantined: int
    atimes_deleted: int
    atimes_written: int
    rows_dropped: int
    dry_run: bool
    duration_s: float
    executables_cleared: int = 0
    temps_removed: int = 0

    __json_extra__ = ("ok",)

    @property
    def ok(self) -> bool:
        return not self.plan.findings


def is_executable(f: VerifyFinding) -> bool:
    """Whether a finding is about a stored executable (``-aot``), not a JAX entry."""
    return f.path.endswith(EXECUTABLE_SUFFIX)
